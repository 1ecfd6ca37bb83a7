"""The V2 reader (`v2/options.py`) fills `RequestOptions` as V1's reader does: for random batches of
requests (every per-node option, random outputs), the tree nodes' logits processed with the V2 reader's
record equal those processed with the V1 reader's (V1's sampling metadata and logits processors of the
same requests, tests/adapter/test_node_options.py, whose processing is itself checked against vLLM's V1
ops), value for value. The output mirror (`v2/output_mirror.py`) keeps the prompt and committed output
of the requests whose options read them, from vLLM's own `NewRequestData` and SamplingParams.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from tests.adapter.test_node_options import CPU, VOCAB, Request, requests, v1_metadata
from tests.core.strategies import draft_tables
from vllm_ddtree.core import build_draft_trees
from vllm_ddtree.vllm.node_logits import process_node_logits
from vllm_ddtree.vllm.v1.options import read_v1_options
from vllm_ddtree.vllm.v2.options import read_v2_options, vllm_sampler_serves
from vllm_ddtree.vllm.v2.output_mirror import MirroredRequest, OutputMirror, needs_history


def v2_states(temperature: list[float], top_k: list[int] | None = None, seeds: dict[int, int] | None = None) -> SimpleNamespace:
    """The host mirrors of V2's `SamplingStates` that the reader reads, slot i for batch row i."""
    num_reqs = len(temperature)
    host = lambda values, dtype: SimpleNamespace(np=np.array(values, dtype=dtype))
    seeds = seeds or {}
    return SimpleNamespace(
        temperature=host(temperature, np.float32),
        top_k=host(top_k or [VOCAB] * num_reqs, np.int32),
        top_p=host([1.0] * num_reqs, np.float32),
        min_p=host([0.0] * num_reqs, np.float32),
        seeds=host([seeds.get(i, 99) for i in range(num_reqs)], np.int64),
        seeds_set=np.array([i in seeds for i in range(num_reqs)]),
    )


def mirrored(request: Request) -> MirroredRequest:
    """The mirror's record of a request: SamplingParams' fields as vLLM names them (bad words already
    tokenized, as vLLM's validation leaves them)."""
    params = SimpleNamespace(
        presence_penalty=request.presence, frequency_penalty=request.frequency, repetition_penalty=request.repetition,
        bad_words_token_ids=request.bad_words, min_tokens=request.min_tokens, all_stop_token_ids=set(request.stops),
        logit_bias=request.logit_bias or None, allowed_token_ids=request.allowed,
        structured_outputs=object() if request.structured else None,
    )
    return MirroredRequest(params, request.prompt, list(request.output) if needs_history(params) else None)


def read_v2(batch: list[Request], states: SimpleNamespace | None = None):
    states = states or v2_states([1.0] * len(batch))
    return read_v2_options(states, np.arange(len(batch)), [mirrored(r) for r in batch], VOCAB, CPU)


@given(tables=draft_tables(vocab=VOCAB), budget=st.integers(0, 8), data=st.data())
def test_the_v2_reader_processes_every_node_as_the_v1_reader(tables, budget, data):
    roots, top_logprobs, top_token_ids = tables
    tree = build_draft_trees(roots, top_logprobs, top_token_ids, budget)
    batch = [data.draw(requests()) for _ in range(tree.num_requests)]
    logits = torch.randn(tree.num_requests, tree.nodes_per_request, VOCAB, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))) * 3
    v1 = read_v1_options(v1_metadata(batch), len(batch), CPU, VOCAB)
    v2 = read_v2(batch)
    assert v2.needs_node_processing == v1.needs_node_processing
    assert vllm_sampler_serves(v2, has_structured_requests=False, wants_logprobs=False) == (not v1.needs_node_processing)
    expected = process_node_logits(logits.clone(), tree, v1)
    torch.testing.assert_close(process_node_logits(logits.clone(), tree, v2), expected, rtol=0, atol=0, equal_nan=True)


def test_the_v2_reader_reads_the_sampling_states():
    batch = [Request(prompt=[0], output=[]), Request(prompt=[1], output=[], logit_bias={2: 1.0})]
    options = read_v2(batch, v2_states([0.7, 1.3], top_k=[1, 5], seeds={1: 123}))
    params = options.sampling_params()
    assert params.temperature.tolist() == pytest.approx([0.0, 1.3])  # top_k 1: greedy
    assert params.seeds == {1: 123}
    assert options.logit_bias == {1: {2: 1.0}} and not options.min_tokens and options.penalties is None
    assert not vllm_sampler_serves(options, has_structured_requests=False, wants_logprobs=False)
    assert not vllm_sampler_serves(read_v2([Request(prompt=[0], output=[])]), has_structured_requests=True, wants_logprobs=False)
    assert vllm_sampler_serves(read_v2([Request(prompt=[0], output=[])]), has_structured_requests=False, wants_logprobs=False)
    assert not vllm_sampler_serves(read_v2([Request(prompt=[0], output=[])]), has_structured_requests=False, wants_logprobs=True)


def test_the_mirror_keeps_what_vllm_hands_and_the_core_rule_commits():
    """Prompt and output from `NewRequestData` (a resumed request brings the output it had), then the
    committed rows of each step; requests whose options read no history keep no output."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    def new(req_id: str, params: SamplingParams, tokens: list[int], prompt_len: int) -> NewRequestData:
        return NewRequestData(req_id=req_id, prompt_token_ids=tokens[:prompt_len], mm_features=[], sampling_params=params,
                              pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None,
                              prefill_token_ids=tokens)

    mirror = OutputMirror()
    penalized = SamplingParams(repetition_penalty=1.2, min_tokens=4)
    mirror.note_new_requests([new("a", penalized, [5, 6, 7, 1], 3), new("b", SamplingParams(logit_bias={3: 1.0}), [5, 6], 2)])
    mirror.commit(["a", "b"], np.array([[2, 3, -1], [4, -1, -1]]), np.array([2, 1]))
    mirror.commit(["a", "b"], np.array([[8, -1, -1], [9, -1, -1]]), np.array([0, 1]))  # a row still prefilling commits nothing
    a, b = mirror.requests(["a", "b"])
    assert (list(a.prompt), a.output, list(b.prompt), b.output) == ([5, 6, 7], [1, 2, 3], [5, 6], None)
    options = read_v2_options(v2_states([0.0, 0.0]), np.arange(2), [a, b], VOCAB, CPU)
    assert options.min_tokens[0].tokens_left == 1 and options.penalties.output_counts[0, 1:4].tolist() == [1, 1, 1]
    mirror.drop(["a"])
    mirror.note_new_requests([new("a", penalized, [5, 6, 7, 1, 2, 3, 8], 3)])  # resumed after preemption
    assert mirror.requests(["a"])[0].output == [1, 2, 3, 8]
