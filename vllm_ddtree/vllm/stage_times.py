"""Wall time of each stage of a DDTree engine step, for benchmarks (off unless asked for).

Enable with the environment variable VLLM_DDTREE_STAGE_TIMES=1 (read when the model runner starts).
Stages are exclusive: time spent in a nested stage counts for the nested stage only, and the whole
step is wrapped in STEP, so STEP's own time is everything not attributed elsewhere ("rest") and the
stages of a step add up to its wall time. On CUDA each boundary synchronizes the device (the numbers
then include the synchronizations; never enable it in production).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext

import torch

ENV_FLAG = "VLLM_DDTREE_STAGE_TIMES"

STEP = "rest"  # the whole step; its exclusive time is what no other stage claims
DRAFT_FORWARD = "draft forward"  # vLLM's DFlash pass, its LM head included
DRAFT_TOPK = "top-k"  # log-softmax + per-depth top-k of the draft logits
TREE_BUILD = "tree build + verify inputs"  # best-first trees from the draft top-k, flat drafts, verify batch, positions, KV slots, tree masks
TARGET_FORWARD = "target forward"  # the verify (or prefill) forward of the target
ACCEPTANCE = "acceptance"  # target tokens at every node, tree walk, output rows
KV_COMPACTION = "kv compaction"  # plan, KV row moves in every target layer, drafter context order

_NOT_TIMED = nullcontext()

STAGES = (DRAFT_FORWARD, DRAFT_TOPK, TREE_BUILD, TARGET_FORWARD, ACCEPTANCE, KV_COMPACTION, STEP)


class StageTimes:
    """Accumulated exclusive seconds per stage, and the number of engine steps (`end_step` calls)."""

    def __init__(self, enabled: bool, device: torch.device | None = None) -> None:
        self.enabled = enabled
        self._sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else None
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._children: list[float] = []  # per open stage: seconds spent in its nested stages

    @classmethod
    def from_env(cls, device: torch.device | None = None) -> StageTimes:
        return cls(os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true"), device)

    def stage(self, name: str) -> AbstractContextManager[None]:
        """Time the block as stage `name`; when disabled, one shared no-op context. (A plain class, not a
        generator-based context, which costs several microseconds per block once a forward has evicted
        the caches: the benchmarks time DDTree engines with stages on beside vLLM's engines without.)"""
        return _Stage(self, name) if self.enabled else _NOT_TIMED

    def end_step(self) -> None:
        if self.enabled:
            self.steps += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def snapshot(self) -> dict[str, float]:
        """Seconds per stage (every stage named, zero when unseen) and "steps"."""
        return {**{name: self.seconds.get(name, 0.0) for name in STAGES}, "steps": float(self.steps)}


class _Stage:
    """One timed block of `StageTimes.stage`: its exclusive seconds go to the stage, its whole seconds to
    the enclosing block's nested time."""

    __slots__ = ("_times", "_name", "_start")

    def __init__(self, times: StageTimes, name: str) -> None:
        self._times, self._name = times, name

    def __enter__(self) -> None:
        times = self._times
        if times._sync is not None:
            times._sync()
        times._children.append(0.0)
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        times = self._times
        if times._sync is not None:
            times._sync()
        elapsed = time.perf_counter() - self._start
        times.seconds[self._name] += elapsed - times._children.pop()
        if times._children:
            times._children[-1] += elapsed
