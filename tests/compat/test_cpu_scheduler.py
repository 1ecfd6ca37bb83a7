"""On the CPU platform, method 'ddtree' engines run `UnpaddedScheduler` (vLLM's scheduler without
placeholder drafts) unless the user names a scheduler class (CUDA engines keep vLLM's scheduler, whose
padding keeps batches uniform for CUDA graphs: `test_gpu_platform.py`). The rewrite runs on an EngineArgs (no engine); the
engine-level behaviour is `tests/e2e/test_hostile_requests.py`'s one-token-prompt test."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_ddtree.demo import demo_pair_paths  # noqa: E402
from vllm_ddtree.vllm.config import CPU_SCHEDULER_CLS, rewrite_engine_args  # noqa: E402

CPU = SimpleNamespace(is_cpu=lambda: True, is_cuda=lambda: False, device_name="cpu")


def _rewritten(platform: SimpleNamespace, **kwargs) -> EngineArgs:
    target, draft = demo_pair_paths()
    args = EngineArgs(model=target, speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 8}, **kwargs)
    with mock.patch("vllm.platforms._current_platform", platform):
        rewrite_engine_args(args)
    return args


def test_cpu_engines_run_the_unpadded_scheduler() -> None:
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ddtree.vllm.scheduler import UnpaddedScheduler

    args = _rewritten(CPU)
    assert args.scheduler_cls == CPU_SCHEDULER_CLS
    config = SchedulerConfig(scheduler_cls=args.scheduler_cls, max_model_len=64, is_encoder_decoder=False)
    assert config.get_scheduler_cls() is UnpaddedScheduler
    assert issubclass(UnpaddedScheduler, Scheduler)


def test_a_scheduler_class_the_user_names_is_kept() -> None:
    assert _rewritten(CPU, scheduler_cls="my.Scheduler").scheduler_cls == "my.Scheduler"

