"""Request options at every tree node equal vLLM's V1 sampler at the same place of a chain.

Ours: the batch's V1 sampling metadata (committed outputs) -> `read_v1_options` -> `process_node_logits`
on the tree. The oracle: vLLM 0.32's own `Sampler.apply_logits_processors` (allowed tokens,
`apply_bad_words`, the min_tokens and logit_bias processors, `apply_all_penalties`) on one row per
node, whose request's output is the committed output followed by the node's path (the node's history,
as plain decoding would hold it). Compared value for value, no tolerance: our penalties do vLLM's float
ops in vLLM's order (`node_logits._apply_penalties`). NaN equals NaN (an inf bias on a masked token gives
NaN in both); -0.0 equals +0.0 (vLLM subtracts a zero penalty from the logits of tokens no history holds,
which we leave as they are: a -0.0 there is +0.0 in vLLM's).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from tests.core.strategies import draft_tables
from vllm_ddtree.core import DraftTree, build_draft_trees
from vllm_ddtree.vllm.node_logits import path_tokens, process_node_logits
from vllm_ddtree.vllm.sampling import plain_sampler_serves
from vllm_ddtree.vllm.v1.options import read_v1_options

VOCAB = 8
CPU = torch.device("cpu")
INF = float("inf")


@dataclass
class Request:
    """One request's options and token history, as V1's input batch would hold them."""

    prompt: list[int]
    output: list[int]
    allowed: list[int] | None = None
    bad_words: list[list[int]] = field(default_factory=list)
    min_tokens: int = 0
    stops: list[int] = field(default_factory=list)
    structured: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0


def v1_metadata(requests: list[Request]) -> SamplingMetadata:
    """V1's sampling metadata of a batch of `requests`, its processors updated as V1's input batch
    updates them (one `BatchUpdate` adding every request)."""
    num_reqs = len(requests)
    processors = [
        MinTokensLogitsProcessor(None, CPU, False),
        LogitBiasLogitsProcessor(None, CPU, False),
        MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=num_reqs)), CPU, False),
    ]
    added = [
        (i, SimpleNamespace(min_tokens=r.min_tokens, all_stop_token_ids=set(r.stops), structured_outputs=object() if r.structured else None,
                            logit_bias=r.logit_bias or None, min_p=r.min_p), r.prompt, r.output)
        for i, r in enumerate(requests)
    ]
    update = BatchUpdate(batch_size=num_reqs, removed=[], added=added, moved=[])
    for processor in processors:
        processor.update_state(update)
    no_penalties = all(r.presence == 0 and r.frequency == 0 and r.repetition == 1 for r in requests)
    prompt_width = max(len(r.prompt) for r in requests)
    mask = None
    if any(r.allowed is not None for r in requests):
        mask = torch.zeros(num_reqs, VOCAB, dtype=torch.bool)
        for i, r in enumerate(requests):
            if r.allowed is not None:
                mask[i] = True
                mask[i, r.allowed] = False
    return SamplingMetadata(
        temperature=torch.ones(num_reqs),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=no_penalties,
        prompt_token_ids=None if no_penalties else torch.tensor([r.prompt + [VOCAB] * (prompt_width - len(r.prompt)) for r in requests]),
        frequency_penalties=torch.tensor([r.frequency for r in requests]),
        presence_penalties=torch.tensor([r.presence for r in requests]),
        repetition_penalties=torch.tensor([r.repetition for r in requests]),
        output_token_ids=[r.output for r in requests],
        allowed_token_ids_mask=mask,
        bad_words_token_ids={i: r.bad_words for i, r in enumerate(requests) if r.bad_words},
        logitsprocs=LogitsProcessors(processors),
    )


def ours(requests: list[Request], tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    options = read_v1_options(v1_metadata(requests), len(requests), CPU, VOCAB)
    return process_node_logits(logits.clone(), tree, options)


def vllms_chain(requests: list[Request], tree: DraftTree, logits: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The valid nodes (request, node) and vLLM's processed logits of each, one chain row per node."""
    nodes, chain = [], []
    for r, request in enumerate(requests):
        for node, path in enumerate(path_tokens(tree, r)[: int(tree.num_nodes[r])]):
            nodes.append((r, node))
            chain.append(replace(request, output=request.output + path))
    rows = torch.stack([logits[r, node] for r, node in nodes])
    return nodes, Sampler().apply_logits_processors(rows, v1_metadata(chain), predict_bonus_token=False)


def assert_equal_to_vllms_chain(requests: list[Request], tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    processed = ours(requests, tree, logits)
    nodes, expected = vllms_chain(requests, tree, logits)
    got = torch.stack([processed[r, node] for r, node in nodes])
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    return processed


def small_tree(paths: list[list[int]]) -> DraftTree:
    """One request's tree from its nodes' paths, parents before children (the root's path is [])."""
    index = {tuple(p): i for i, p in enumerate(paths)}
    parents = [-1] + [index[tuple(p[:-1])] for p in paths[1:]]
    tokens = [0] + [p[-1] for p in paths[1:]]
    as_row = lambda values: torch.tensor([values])
    return DraftTree(
        token_ids=as_row(tokens), parents=as_row(parents), depths=as_row([len(p) for p in paths]),
        ranks=as_row([0] * len(paths)), valid=torch.ones(1, len(paths), dtype=torch.bool),
        num_nodes=torch.tensor([len(paths)]), max_depth=max(len(p) for p in paths),
    )


def _two(tree: DraftTree) -> DraftTree:
    """The same tree for two requests."""
    return DraftTree(*(torch.cat([t, t]) for t in (tree.token_ids, tree.parents, tree.depths, tree.ranks, tree.valid, tree.num_nodes)),
                     max_depth=tree.max_depth)


# A tree over tokens 1..3: root; 1 -> 2 -> 3; 2 (a sibling of 1).
PATHS = [[], [1], [1, 2], [1, 2, 3], [2]]


def test_a_bad_word_is_banned_only_at_nodes_whose_history_ends_with_its_prefix():
    tree = small_tree(PATHS)
    request = Request(prompt=[0], output=[5, 4], bad_words=[[4, 1, 6], [2, 7]])
    processed = assert_equal_to_vllms_chain([request], tree, torch.zeros(1, len(PATHS), VOCAB))
    banned = torch.isneginf(processed[0]).nonzero().tolist()
    # [4, 1, 6]: history ..4, 1 (node 1); [2, 7]: history ends with 2 (nodes 2 and 4)
    assert banned == [[1, 6], [2, 7], [4, 7]]


def test_min_tokens_masks_stops_at_the_nodes_short_of_it_and_a_grammar_keeps_its_only_tokens():
    tree = small_tree(PATHS)
    requests = [Request(prompt=[0], output=[5, 5], min_tokens=4, stops=[7]),
                Request(prompt=[0], output=[5, 5], min_tokens=4, stops=[6, 7], structured=True)]
    logits = torch.zeros(2, len(PATHS), VOCAB)
    logits[1, 1, :6] = -INF  # a grammar admits only stops at node 1
    processed = assert_equal_to_vllms_chain(requests, _two(tree), logits)
    # output positions 2 + depth: below 4 at depths 0 and 1 (root, nodes 1 and 4)
    assert torch.isneginf(processed[0, :, 7]).tolist() == [True, True, False, False, True]
    assert torch.isneginf(processed[1, :, 6]).tolist() == [True, False, False, False, True]


def test_penalties_count_the_committed_output_and_the_nodes_path():
    tree = small_tree(PATHS)
    request = Request(prompt=[3], output=[1], frequency=0.5, presence=0.25, repetition=2.0)
    processed = assert_equal_to_vllms_chain([request], tree, torch.ones(1, len(PATHS), VOCAB))
    # node 2 (path 1, 2): token 1 twice, token 2 once, token 3 in the prompt: 1/2 - 2 x 0.5 - 0.25 ...
    assert processed[0, 2, :4].tolist() == [1.0, 0.5 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.5]


tokens = st.integers(0, VOCAB - 1)


@st.composite
def requests(draw) -> Request:
    output = draw(st.lists(tokens, max_size=6))
    stops = draw(st.lists(tokens, max_size=2, unique=True))
    some = st.lists(tokens, min_size=1, max_size=VOCAB - 1, unique=True)
    return Request(
        prompt=draw(st.lists(tokens, min_size=1, max_size=4)),
        output=output,
        allowed=draw(st.sampled_from([None, stops or None]) | some),  # only stops: rows all masked
        bad_words=draw(st.lists(st.lists(tokens, min_size=1, max_size=3), max_size=3)),
        min_tokens=draw(st.integers(0, len(output) + 4)),
        stops=stops,
        structured=draw(st.booleans()),
        logit_bias=draw(st.dictionaries(tokens, st.sampled_from([-2.5, -0.75, 1.5, 3.0, -INF, INF]), max_size=3)),
        presence=draw(st.sampled_from([0.0, 0.5, -1.25])),
        frequency=draw(st.sampled_from([0.0, 0.3, -0.7])),
        repetition=draw(st.sampled_from([1.0, 1.3, 0.7])),
    )


@given(tables=draft_tables(vocab=VOCAB), budget=st.integers(0, 8), data=st.data())
def test_every_option_at_every_node_equals_vllms_chain(tables, budget, data):
    roots, top_logprobs, top_token_ids = tables
    tree = build_draft_trees(roots, top_logprobs, top_token_ids, budget)
    batch = [data.draw(requests()) for _ in range(tree.num_requests)]
    seed = data.draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(tree.num_requests, tree.nodes_per_request, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[logits.abs() < 0.5] = 0.0  # zero logits: neither side of the repetition penalty's branch
    assert_equal_to_vllms_chain(batch, tree, logits)


def test_the_v1_reader_reads_the_sampling_parameters():
    requests = [Request(prompt=[0], output=[], min_p=0.1), Request(prompt=[0], output=[])]
    metadata = v1_metadata(requests)
    metadata.temperature = torch.tensor([0.7, 1.3])
    metadata.top_k = torch.tensor([1, 5])
    metadata.generators = {1: torch.Generator().manual_seed(123)}
    metadata.max_num_logprobs = 3
    options = read_v1_options(metadata, 2, CPU, VOCAB)
    params = options.sampling_params()
    assert params.temperature.tolist() == pytest.approx([0.0, 1.3])  # top_k 1: greedy
    assert options.sampling_params(top_k_one_is_greedy=False).temperature.tolist() == pytest.approx([0.7, 1.3])
    assert params.min_p.tolist() == pytest.approx([0.1, 0.0])
    assert params.seeds == {1: 123}
    assert options.wants_logprobs and options.num_logprobs == 3
    assert not options.needs_node_processing


def test_min_tokens_without_stop_tokens_keeps_its_batch_on_the_core_rule():
    """ignore_eos and no stop ids: nothing to mask, but the batch stays a core-rule batch at every step."""
    request = Request(prompt=[0], output=[1], min_tokens=3)
    options = read_v1_options(v1_metadata([request]), 1, CPU, VOCAB)
    assert options.needs_node_processing and not plain_sampler_serves(options, has_structured_requests=False)
    logits = torch.randn(1, len(PATHS), VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(assert_equal_to_vllms_chain([request], small_tree(PATHS), logits), logits)


def test_the_shared_option_modules_import_no_vllm():
    """Runner-neutral: the record, the per-node processing and the sampling glue import neither runner."""
    modules = "vllm_ddtree.vllm.options, vllm_ddtree.vllm.node_logits, vllm_ddtree.vllm.sampling"
    code = f"import sys, {modules}; assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
