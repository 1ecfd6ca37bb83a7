"""Wall-clock timers around named functions of a running engine, installed and read in its engine-core
process through `LLM.collective_rpc` (`benchmarks/step_functions.py`).

A target is "owner.attribute", the owner resolved from the worker: runner, model (the target),
drafter, draft_model, clock (the budget policy's step clock), runner_module (functions as the runner
module imported them), vllm_runner (vLLM's GPUModelRunner class: vLLM's own part of a method the DDTree
runner overrides), policy (the AdaptiveBudget class), tree_step (the TreeStep class), host_tree (the
module), scheduler (vLLM's Scheduler class, which the CPU's UnpaddedScheduler subclasses) or engine_core
(vLLM's EngineCore class: `step`, `post_step`, the engine's whole step). A timer wraps the attribute where it is found (an instance's method on the instance, a class's
or module's function on the class or module) and sums wall seconds and calls under the target's name;
nested timed functions count in both. Targets an engine lacks (no drafter without speculation) are
skipped. Each wrapper costs about a microsecond per call: time few functions per run to compare
engines, not to read absolute step times.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

_INSTANCE_OWNERS = ("runner", "model", "drafter", "draft_model", "clock")
_SECONDS: dict[str, float] = {}
_CALLS: dict[str, int] = {}


def _owners(worker: Any) -> dict[str, Callable[[], Any]]:
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    return {
        "runner": lambda: runner,
        "model": lambda: runner.model,
        "drafter": lambda: drafter,
        "draft_model": lambda: getattr(drafter, "model", None),
        "clock": lambda: getattr(runner, "clock", None),
        "vllm_runner": lambda: importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner,
        "policy": lambda: importlib.import_module("vllm_ddtree.core.budget").AdaptiveBudget,
        "tree_step": lambda: importlib.import_module("vllm_ddtree.vllm.tree_step").TreeStep,
        "host_tree": lambda: importlib.import_module("vllm_ddtree.vllm.host_tree"),
        "runner_module": lambda: importlib.import_module("vllm_ddtree.vllm.v1.runner"),
        "scheduler": lambda: importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler,
        "engine_core": lambda: importlib.import_module("vllm.v1.engine.core").EngineCore,
    }


def install(worker: Any, targets: Sequence[str]) -> list[str]:
    """Wrap every target the engine has (once: an attribute already timed as the target is left as it
    is); returns those.
    Class and module targets are wrapped first, so that an instance's timer wraps the class's timer:
    vllm_runner.X then counts vLLM's method wherever it runs (all of it in an engine without the
    DDTree runner, vLLM's part of the DDTree runner's override in one with)."""
    owners = _owners(worker)
    installed = []
    for target in sorted(targets, key=lambda target: target.partition(".")[0] in _INSTANCE_OWNERS):
        owner_name, _, attribute = target.partition(".")
        owner = owners[owner_name]()
        function = getattr(owner, attribute, None) if owner is not None else None
        if function is None or getattr(function, "_timed_as", None) == target:
            continue
        setattr(owner, attribute, _timed(function, target))
        installed.append(target)
    return installed


def read(worker: Any) -> dict[str, tuple[float, int]]:
    """(seconds, calls) per timed target so far."""
    return {name: (seconds, _CALLS[name]) for name, seconds in _SECONDS.items()}


def _timed(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _SECONDS[name] = _SECONDS.get(name, 0.0) + time.perf_counter() - start
            _CALLS[name] = _CALLS.get(name, 0) + 1

    timed._timed_as = name  # type: ignore[attr-defined]
    return timed
