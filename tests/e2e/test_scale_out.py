"""Scaling method 'ddtree' out beyond one engine (docs/scaling.md, "Scaling out").

- Data parallelism, dense target: vLLM runs each DP rank of a dense model as an independent engine core
  (its own scheduler, runner, KV cache and adaptive budget) behind one front-end that balances requests,
  the engine `vllm serve --data-parallel-size N` runs. Two replicas (one core each, multiprocess
  executor) must give greedy outputs identical to plain decoding and seeded sampled outputs identical
  to one engine's, and both must have verified trees.
  (`LLM(data_parallel_size=2)` is refused by vLLM 0.32 itself for every method: offline data
  parallelism of a dense model is N independent `LLM`s.)
- Refused at start, with the reason and the alternative in the message: pipeline parallelism (vLLM's
  DFlash itself fails under it on the V1 runner), Ray (vLLM's CPU platform refuses Ray), data
  parallelism of a MoE target (its DP ranks are coupled; on CPU even plain decoding fails).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, prompts
from tests.e2e.pairs import HIDDEN, VOCAB

STATS_DEADLINE_S = 60


async def _generate_dp(
    target: str, draft: str, requests: list[dict], params: list[Any], data_parallel_size: int
) -> tuple[list[list[int]], dict]:
    """Token ids from an AsyncLLM (the `vllm serve` engine) with data_parallel_size replicas, and the
    per-replica counters {metric: {engine index: value}} of its Prometheus metrics."""
    from prometheus_client import REGISTRY
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
        distributed_executor_backend="mp", data_parallel_size=data_parallel_size,
        kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=16,
        speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 16},
    )  # fmt: skip
    llm = AsyncLLM.from_engine_args(args)

    async def one(i: int, request: dict) -> list[int]:
        final: Any = None
        async for out in llm.generate(request, params[i], request_id=f"dp-{i}"):
            final = out
        return list(final.outputs[0].token_ids)

    try:
        token_ids = await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in enumerate(requests))), timeout=180)
        # A request's last output can reach its caller before the front-end's loggers record the stats
        # that came with it (the step's drafts among them): wait until every request is counted.
        deadline = time.monotonic() + STATS_DEADLINE_S
        while (finished := sum(_counters(REGISTRY).get("vllm:request_success_total", {}).values())) < len(requests):
            if time.monotonic() > deadline:
                pytest.fail(f"the front-end's metrics counted {finished} of {len(requests)} finished requests "
                            f"{STATS_DEADLINE_S} s after the last output: {_counters(REGISTRY)}")  # fmt: skip
            await asyncio.sleep(0.05)
        return token_ids, _counters(REGISTRY)
    finally:
        llm.shutdown()


def _counters(registry: Any) -> dict[str, dict[str, float]]:
    """{metric: {engine index: value}} of the request and draft counters in a Prometheus registry."""
    counters: dict[str, dict[str, float]] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name in ("vllm:request_success_total", "vllm:spec_decode_num_drafts_total"):
                per_engine = counters.setdefault(sample.name, {})
                per_engine[sample.labels["engine"]] = per_engine.get(sample.labels["engine"], 0.0) + sample.value
    return counters


def test_dp2_greedy_equals_plain_and_seeded_equal_one_engine_on_both_replicas(pair_dirs, engine_runs, monkeypatch):
    """Greedy requests equal plain decoding; seeded sampled ones equal the same requests on one ddtree
    engine (a seeded draw is keyed by (seed, position), whichever replica serves it)."""
    from vllm import SamplingParams, envs

    from tests.e2e.conftest import run_engine

    target, draft = pair_dirs["focused"]
    greedy = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * len(prompts())
    seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(prompts()))]
    expected = engine_runs("focused", None).token_ids  # in-process engines first, before the env changes below
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16}
    expected_seeded = run_engine(target, spec, prompts(), seeded).token_ids
    envs.disable_envs_cache()  # an in-process engine may have frozen vLLM's env reads; the next two must be seen
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per replica (sliced by DP rank)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    token_ids, counters = asyncio.run(_generate_dp(target, draft, prompts() * 2, greedy + seeded, data_parallel_size=2))
    assert token_ids[: len(prompts())] == expected
    assert token_ids[len(prompts()) :] == expected_seeded
    served = counters["vllm:request_success_total"]
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) == 2 * len(prompts())
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    assert all(drafts.get(engine, 0) > 0 for engine in ("0", "1")), drafts  # trees verified on both replicas


def _llm(target: str, draft: str, **kwargs: Any) -> None:
    from vllm import LLM

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**26,
              max_model_len=256, speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 8}, **kwargs)
    llm.llm_engine.engine_core.shutdown()  # only reached if the refusal failed to fire


def test_pipeline_parallelism_is_refused_with_the_reason(pair_dirs):
    target, draft = pair_dirs["random"]
    with pytest.raises(ValueError, match=r"does not support pipeline parallelism \(pipeline_parallel_size=2\)") as info:
        _llm(target, draft, pipeline_parallel_size=2, distributed_executor_backend="mp")
    assert "vLLM 0.32's DFlash" in str(info.value) and "Missing aux_hidden_states_0" in str(info.value)
    assert "tensor parallelism (tensor_parallel_size)" in str(info.value)


def _serve_engine_config(target: str, draft: str, **kwargs: Any) -> Any:
    """What `vllm serve` builds first, in its front-end process: the engine config (no engine starts)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return AsyncEngineArgs(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
                           speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 8}, **kwargs
                           ).create_engine_config()  # fmt: skip


def test_ray_executor_is_refused_with_the_reason(pair_dirs):
    target, draft = pair_dirs["random"]
    with pytest.raises(ValueError, match=r"does not run on Ray") as info:
        _llm(target, draft, distributed_executor_backend="ray", tensor_parallel_size=2)
    assert "current platform cpu does not support ray." in str(info.value) and "'mp'" in str(info.value)


def test_ray_data_parallel_backend_is_refused_with_the_reason(pair_dirs):
    target, draft = pair_dirs["random"]
    with pytest.raises(ValueError, match=r"does not run on Ray"):
        _serve_engine_config(target, draft, data_parallel_size=2, data_parallel_backend="ray")


def test_dp_of_a_moe_target_is_refused_and_dense_dp_builds(pair_dirs, tmp_path):
    from transformers import Qwen3MoeConfig

    dense, draft = pair_dirs["random"]
    moe = tmp_path / "moe"
    moe.mkdir()
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                            num_experts_per_tok=2).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (moe / "config.json").write_text(json.dumps(config))

    with pytest.raises(ValueError, match=r"does not support data parallelism \(data_parallel_size=2\) for mixture-of-experts"):
        _serve_engine_config(os.fspath(moe), draft, data_parallel_size=2)
    built = _serve_engine_config(dense, draft, data_parallel_size=2)
    assert built.parallel_config.data_parallel_size == 2 and built.speculative_config.method == "dflash"
