"""Method 'ddtree' on a hybrid target (Qwen3-Next: Gated DeltaNet + full attention + MoE) in bf16.

vLLM 0.32 runs GDN layers on CPU in bf16 only, where even vLLM's own DFlash chain departs from plain
greedy decoding (different reduction orders, bf16 rounding), so the bar is: ddtree's greedy output agrees
with plain decoding at least as far as the chain's does, and the tree commits more tokens per step than
the chain on a pair whose draft is informative (the focused hybrid pair). The tree scan itself is
checked exactly, in float32, against chain scans in tests/core/test_gdn_tree.py.

Engines run one after another (reference runs first), each built and shut down by `run_engine`.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MAX_TOKENS, Run, prompts, run_engine
from tests.e2e.hybrid_pairs import build_hybrid_pair

BUDGET = 32
CHAIN = 7  # the draft's block of 8 drafts at most 7 tokens
PROMPTS = prompts((3, 7, 12, 20))


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory) -> tuple[str, str]:
    return build_hybrid_pair(str(tmp_path_factory.mktemp("hybrid")), focused=True)


@pytest.fixture(scope="module")
def runs(hybrid_pair) -> dict[str, Run]:
    """Plain decoding, vLLM's DFlash chain and a fixed ddtree budget, greedy, bf16. vLLM's own runs need
    prefix caching off on CPU; the ddtree run leaves it at vLLM's default, which ddtree forces off."""
    from vllm import SamplingParams

    target, draft = hybrid_pair
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = {"dtype": "bfloat16", "max_num_batched_tokens": 128}
    return {
        "plain": run_engine(target, None, PROMPTS, params, enable_prefix_caching=False, **engine),
        "chain": run_engine(target, {"method": "dflash", "model": draft, "num_speculative_tokens": CHAIN}, PROMPTS, params,
                            enable_prefix_caching=False, **engine),
        "tree": run_engine(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET, "ddtree_adaptive": False},
                           PROMPTS, params, **engine),
    }


def agreed_prefix(run: Run, reference: Run) -> list[int]:
    """Per prompt, how many leading tokens equal the reference's."""
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(run.token_ids, reference.token_ids)]


def test_tree_agrees_with_plain_decoding_at_least_as_far_as_the_chain(runs):
    tree, chain = agreed_prefix(runs["tree"], runs["plain"]), agreed_prefix(runs["chain"], runs["plain"])
    assert sum(tree) >= sum(chain), (tree, chain)


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
