"""One in-process engine per speculative configuration, one after the other, and spec-decode counting.

`run_variant` gives a variant a fresh in-process vLLM engine, a warm-up generation, then one measured
generation (used by `check_pair_vllm`, which compares tokens and counters, not speed; the demo and the
benchmark time engines side by side with `vllm_ddtree.demo.engines`). Tokens per step comes from vLLM's
own spec-decode counters over the measured generation only (`tokens_per_decode_step`); 1 without
speculation.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from typing import Any

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
    "disable_log_stats": False,
    "seed": 0,
    # a fixed KV cache size: vLLM's CPU worker otherwise reserves 92% of free memory and refuses to
    # start when other processes use memory
    "kv_cache_memory_bytes": 256 * 2**20,
}


def configure_cpu_environment() -> None:
    """Settings an in-process CPU engine needs (must run before vLLM is imported).

    One OpenMP thread unless OMP_NUM_THREADS says otherwise: an in-process engine keeps vLLM's OpenMP
    kernels at one thread per core, and on 2 cores their spin-waits cost more than the second core wins.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))


@dataclass(frozen=True)
class Variant:
    name: str
    speculative_config: dict[str, Any] | None


@dataclass(frozen=True)
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + (0,) * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + (0,) * (width - len(other.accepted_per_position))
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            tuple(a - b for a, b in zip(mine, theirs)),
        )


@dataclass(frozen=True)
class RunStats:
    name: str
    token_ids: list[list[int]]
    seconds: float
    counters: SpecCounters

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_decode_step(self.counters, self.output_tokens, len(self.token_ids))


def decode_steps(counters: SpecCounters, output_tokens: int, requests: int) -> int:
    """Decode steps summed over requests.

    vLLM counts a "draft" (one request's proposal in one step) only when a step proposed tokens, so for
    a method that sometimes proposes none (n-gram without a match, the adaptive budget's steps without
    speculation) drafts miss steps. Every decode step commits its accepted drafts + 1 token, and the
    prefill each request's first, so decode steps = output tokens - requests - accepted. (An accepted
    draft past max_tokens is counted but not output; then this falls below drafts, which are exact for
    methods that draft at every step, and drafts are taken.)
    """
    return max(counters.drafts, output_tokens - requests - counters.accepted)


def tokens_per_decode_step(counters: SpecCounters, output_tokens: int, requests: int) -> float:
    """Committed tokens per decode step: 1 + accepted draft tokens / decode steps (`decode_steps`)."""
    steps = decode_steps(counters, output_tokens, requests)
    return 1.0 + counters.accepted / steps if steps > 0 else 1.0


def read_spec_counters(llm: Any) -> SpecCounters:
    values: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            values[metric.name] = metric.values if hasattr(metric, "values") else metric.value
    per_position = values.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    return SpecCounters(
        drafts=int(values.get("vllm:spec_decode_num_drafts", 0) or 0),
        draft_tokens=int(values.get("vllm:spec_decode_num_draft_tokens", 0) or 0),
        accepted=int(values.get("vllm:spec_decode_num_accepted_tokens", 0) or 0),
        accepted_per_position=tuple(int(v) for v in per_position),
    )


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_variant(
    target: str,
    variant: Variant,
    prompts: list[Any],
    sampling_params: Any,
    engine_kwargs: dict[str, Any] | None = None,
    warmup_prompts: list[Any] | None = None,
) -> RunStats:
    """One fresh engine: warm-up generation, then the timed generation of `prompts`."""
    from vllm import LLM

    llm = LLM(model=target, speculative_config=variant.speculative_config, **{**ENGINE_DEFAULTS, **(engine_kwargs or {})})
    try:
        llm.generate(warmup_prompts or prompts[:1], sampling_params, use_tqdm=False)
        before = read_spec_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counters = read_spec_counters(llm) - before
    finally:
        shutdown(llm)
    return RunStats(
        name=variant.name,
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        counters=counters,
    )
