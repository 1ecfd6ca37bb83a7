"""Method 'ddtree' on a hybrid target (Qwen3-Next: Gated DeltaNet + full attention + MoE) in bf16.

vLLM 0.32 runs GDN layers on CPU in bf16 only, where even vLLM's own DFlash chain departs from plain
greedy decoding (different reduction orders, bf16 rounding), so the bar is: ddtree's greedy output agrees
with plain decoding at least as far as the chain's does, and the tree commits more tokens per step than
the chain on a pair whose draft is informative (the focused hybrid pair). The tree scan itself is
checked exactly, in float32, against chain scans in tests/core/test_gdn_tree.py.

Seeded sampling (temperature 0.8) through trees is compared with steps without speculation (the same
sampling rule). A scripted run cycles the step shapes (no speculation, trees of 4, 8, 16 and 32 nodes,
the chain), so windows of every width, zero-draft decodes and steps after each other shape meet the
same GDN layout.
Engines run one after another (reference runs first), each built and shut down before the next.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import CHUNK, KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, Run, model_runner, prompts, run_engine
from tests.e2e.hybrid_pairs import build_hybrid_pair
from tests.e2e.scripted_budget import ScriptedBudget
from vllm_ddtree.core import OFF, TreeShape, candidate_shapes

BUDGET = 32
CHAIN = 7  # the draft's block of 8 drafts at most 7 tokens
PROMPTS = prompts((3, 7, 12, 20, 45, 70, 100))  # the longest two are prefilled in chunks beside decoding trees
SCRIPT = [OFF, TreeShape(4), TreeShape(8), TreeShape(CHAIN, topk=1), TreeShape(16), TreeShape(BUDGET)]
ENGINE = {"dtype": "bfloat16", "max_num_batched_tokens": CHUNK}
SHORT_PROMPTS = PROMPTS[:4]  # prefilled whole: seeded requests stay away from chunked prefills


def _seeded(count: int):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=100 + i) for i in range(count)]


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory) -> tuple[str, str]:
    return build_hybrid_pair(str(tmp_path_factory.mktemp("hybrid")), focused=True)


@pytest.fixture(scope="module")
def runs(hybrid_pair) -> dict[str, Run]:
    """Greedy, bf16: plain decoding, vLLM's DFlash chain, a fixed ddtree budget and the scripted shapes;
    seeded sampling with trees and without speculation. vLLM's own runs need prefix caching off on CPU;
    the ddtree runs leave it at vLLM's default, which ddtree forces off."""
    from vllm import SamplingParams

    target, draft = hybrid_pair
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = _seeded(len(SHORT_PROMPTS))
    return {
        "plain": run_engine(target, None, PROMPTS, params, enable_prefix_caching=False, **ENGINE),
        "chain": run_engine(target, {"method": "dflash", "model": draft, "num_speculative_tokens": CHAIN}, PROMPTS, params,
                            enable_prefix_caching=False, **ENGINE),
        "tree": run_engine(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET, "ddtree_adaptive": False},
                           PROMPTS, params, **ENGINE),
        "scripted": scripted_shapes_run(target, draft, SCRIPT, PROMPTS, params),
        "sampled off": scripted_shapes_run(target, draft, [OFF], SHORT_PROMPTS, seeded),
        "sampled trees": scripted_shapes_run(target, draft, [TreeShape(BUDGET)], SHORT_PROMPTS, seeded),
    }


def scripted_shapes_run(target: str, draft: str, script: list[TreeShape], requests, params) -> Run:
    """A ddtree engine whose step shapes follow `script` (cycled), whatever the timings."""
    from vllm import LLM

    llm = LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, seed=0,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET}, **ENGINE)
    runner = model_runner(llm)
    runner.use_budget_policy(ScriptedBudget(candidate_shapes(BUDGET, runner.drafter.max_depth), script))
    try:
        outputs = llm.generate(requests, params, use_tqdm=False)
        return Run([list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].finish_reason for o in outputs], {})
    finally:
        llm.llm_engine.engine_core.shutdown()


def agreed_prefix(token_ids: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens equal the reference's."""
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(token_ids, reference)]


@pytest.mark.parametrize("run", ["tree", "scripted"])
def test_ddtree_agrees_with_plain_decoding_at_least_as_far_as_the_chain(runs, run):
    ours, chain = (agreed_prefix(runs[name].token_ids, runs["plain"].token_ids) for name in (run, "chain"))
    assert sum(ours) >= sum(chain), (ours, chain)


def test_seeded_sampling_through_trees_draws_what_single_token_steps_draw(runs):
    """Temperature 0.8, seeded: every token is the draw keyed by (seed, position) from its node's
    distribution (`core.sampling`), so trees and steps without speculation draw the same tokens wherever
    bf16 leaves the distributions alike; held to the greedy bar (the chain's agreement with plain)."""
    sampled = agreed_prefix(runs["sampled trees"].token_ids, runs["sampled off"].token_ids)
    chain = agreed_prefix(runs["chain"].token_ids, runs["plain"].token_ids)[: len(SHORT_PROMPTS)]
    assert sum(sampled) >= sum(chain), (sampled, chain)


def test_tree_commits_more_tokens_per_step_than_the_chain(runs):
    assert runs["tree"].tokens_per_step > runs["chain"].tokens_per_step


def test_off_chain_paths_were_accepted_and_compacted(runs):
    """The comparison above covers the state compaction: some accepted paths left the tree's first chain
    (node k != k), whose GDN states and conv inputs had to move for the next step."""
    moved = [bool(((s.acceptance.accepted_nodes >= 0) & (s.acceptance.accepted_nodes != s.acceptance.accepted_nodes.new_tensor(
        range(s.acceptance.accepted_nodes.shape[1])))).any()) for s in runs["tree"].steps]
    assert sum(moved) >= 5


def test_prefix_caching_is_forced_off_for_gdn_hybrids(hybrid_pair):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.vllm.config import rewrite_engine_args

    target, draft = hybrid_pair
    args = EngineArgs(model=target, speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 4},
                      enable_prefix_caching=True)
    rewrite_engine_args(args)
    assert args.enable_prefix_caching is False
