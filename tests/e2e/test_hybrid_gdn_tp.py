"""Method 'ddtree' on a hybrid (Gated DeltaNet) target under tensor parallelism 2 on CPU (multiprocess
executor, one core per rank): each rank verifies the trees on its shard of the GDN heads and compacts its
own state shard after the walk, from the accepted paths all ranks share.

bf16 bar as in test_hybrid_gdn.py: greedy output agrees with plain decoding (TP=1) at least as far as
vLLM's DFlash chain under TP=2 does. The pair's GDN layers have 2 key / 4 value heads so they shard.
Engines run one after another, each shut down before the next starts.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, prompts
from tests.e2e.hybrid_pairs import build_hybrid_pair
from tests.e2e.test_hybrid_gdn import agreed_prefix

PROMPTS = prompts((3, 7, 12, 20))


def _generate(target: str, spec: dict | None, tensor_parallel_size: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, tensor_parallel_size=tensor_parallel_size,
              distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni", kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=16, seed=0, enable_prefix_caching=False,
              speculative_config=spec)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> dict[str, list[list[int]]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    target, draft = build_hybrid_pair(str(tmp_path_factory.mktemp("hybrid_tp")), focused=True, linear_heads=(2, 4))
    try:
        return {
            "plain": _generate(target, None, 1),
            "chain": _generate(target, {"method": "dflash", "model": draft, "num_speculative_tokens": 7}, 2),
            "tree": _generate(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}, 2),
        }
    finally:
        mp.undo()


def test_tp2_tree_agrees_with_plain_decoding_at_least_as_far_as_the_tp2_chain(tp_runs):
    tree, chain = (agreed_prefix(tp_runs[name], tp_runs["plain"]) for name in ("tree", "chain"))
    assert sum(tree) >= sum(chain), (tree, chain)
