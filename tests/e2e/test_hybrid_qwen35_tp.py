"""Method 'ddtree' on a Qwen3.5-shaped multimodal target (Gated DeltaNet + full attention, M-RoPE, run as a
language model only) under tensor parallelism 2 on CPU (multiprocess executor, one core per rank).

The bf16 bar of test_hybrid_qwen35.py: ddtree's greedy output agrees with plain decoding's (TP=1) up to
plain decoding's first near-tie, or as far as vLLM's DFlash chain under TP=2 does; the tree commits more
tokens per verify step than that chain. The pair's GDN layers have 2 key / 4 value heads so they shard.
Engines run one after another, each shut down before the next starts.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, prompts
from tests.e2e.hybrid_pairs import build_qwen3_5_pair
from tests.e2e.test_hybrid_gdn import agreed_prefix
from tests.e2e.test_hybrid_qwen35 import before_first_near_tie

PROMPTS = prompts((3, 7, 12, 20))


def _generate(target: str, spec: dict | None, tensor_parallel_size: int) -> tuple[list[list[int]], list[list[float]], float | None]:
    """Greedy token ids, per token plain decoding's top-2 logprob margin, tokens per verify step (None without drafts)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, tensor_parallel_size=tensor_parallel_size,
              distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni", kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=16, seed=0, enable_prefix_caching=False,
              language_model_only=True, disable_log_stats=False, speculative_config=spec)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")}
    finally:
        llm.llm_engine.engine_core.shutdown()
    margins = [[float(a - b) for a, b, *_ in (sorted((lp.logprob for lp in step.values()), reverse=True) for step in o.logprobs)]
               for o in outputs]
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    per_step = 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else None
    return [list(o.token_ids) for o in outputs], margins, per_step


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> dict[str, tuple]:
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    target, draft = build_qwen3_5_pair(str(tmp_path_factory.mktemp("qwen3_5_tp")), focused=True, multimodal=True, linear_heads=(2, 4))
    try:
        return {
            "plain": _generate(target, None, 1),
            "chain": _generate(target, {"method": "dflash", "model": draft, "num_speculative_tokens": 7}, 2),
            "tree": _generate(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}, 2),
        }
    finally:
        mp.undo()


def test_tp2_tree_agrees_with_plain_decoding_to_its_first_near_tie_or_as_far_as_the_tp2_chain(tp_runs):
    plain, margins, _ = tp_runs["plain"]
    comparable = before_first_near_tie(margins)
    tree, chain = (agreed_prefix(tp_runs[name][0], plain) for name in ("tree", "chain"))
    assert all(t >= min(c, ch) for t, c, ch in zip(tree, comparable, chain)), (tree, comparable, chain)
    assert sum(comparable) >= len(PROMPTS) * MAX_TOKENS // 4  # the bar spans a good part of the output


def test_tp2_tree_commits_more_tokens_per_step_than_the_tp2_chain(tp_runs):
    assert tp_runs["tree"][2] > tp_runs["chain"][2], (tp_runs["tree"][2], tp_runs["chain"][2])
