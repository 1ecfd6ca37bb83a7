"""On a CUDA platform, method 'ddtree' rewrites an engine into what the GPU layer runs (our GPU worker,
vLLM's V1 runner unless the user asks for V2 where the release has the V2 layer, TRITON_ATTN for target
and draft, no async scheduling), and refuses clearly what it cannot run there. GPU vLLM cannot run on this machine: the platform is a stand-in object with the
`current_platform` methods the rewrite asks, and the rewrite runs on an EngineArgs (no engine).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_ddtree.demo import demo_pair_paths  # noqa: E402
from vllm_ddtree.vllm.config import GPU_WORKER_CLS, rewrite_engine_args  # noqa: E402

CUDA = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True, device_name="cuda")
TPU = SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False, device_name="tpu")


def _args(**kwargs) -> EngineArgs:
    target, draft = demo_pair_paths()
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 8}
    return EngineArgs(model=target, speculative_config=spec, **kwargs)


def _rewrite_on(platform: SimpleNamespace, args: EngineArgs) -> None:
    with mock.patch("vllm.platforms._current_platform", platform):
        rewrite_engine_args(args)


@pytest.fixture
def clean_runner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


def test_cuda_engine_runs_our_gpu_worker_on_v1_with_triton_attention(clean_runner_env: None) -> None:
    args = _args()
    _rewrite_on(CUDA, args)
    assert args.worker_cls == GPU_WORKER_CLS
    assert args.async_scheduling is False
    assert args.scheduler_cls is None  # vLLM's scheduler: its padding keeps batches uniform for CUDA graphs
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert args.attention_backend == "TRITON_ATTN"
    assert args.speculative_config["attention_backend"] == "TRITON_ATTN"
    assert args.speculative_config["method"] == "dflash"


def test_cuda_engine_accepts_triton_attention_chosen_by_the_user(clean_runner_env: None) -> None:
    args = _args(attention_backend="TRITON_ATTN")
    _rewrite_on(CUDA, args)
    assert args.attention_backend == "TRITON_ATTN"


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_cuda_engine_refuses_another_attention_backend(clean_runner_env: None, backend: str) -> None:
    with pytest.raises(ValueError, match=rf"TRITON_ATTN .* but --attention-backend is '{backend}'; drop it"):
        _rewrite_on(CUDA, _args(attention_backend=backend))


def test_cuda_engine_runs_the_v2_layer_when_the_user_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    args = _args()
    _rewrite_on(CUDA, args)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # kept: the worker builds the V2 layer (`active_runner_path`)
    assert args.worker_cls == GPU_WORKER_CLS and args.async_scheduling is False
    assert args.attention_backend == "TRITON_ATTN" and args.speculative_config["attention_backend"] == "TRITON_ATTN"


def test_cuda_engine_refuses_the_v2_runner_where_the_release_has_no_v2_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with mock.patch("vllm_ddtree.vllm.config.v2_runner_available", return_value=False), pytest.raises(ValueError, match="no V2 model runner layer"):
        _rewrite_on(CUDA, _args())


def test_cuda_engine_refuses_the_cpu_worker(clean_runner_env: None) -> None:
    with pytest.raises(ValueError, match=rf"installs its own worker \({GPU_WORKER_CLS}\)"):
        _rewrite_on(CUDA, _args(worker_cls="vllm_ddtree.vllm.worker.DDTreeCPUWorker"))


def test_other_platforms_are_refused_with_the_alternative(clean_runner_env: None) -> None:
    with pytest.raises(ValueError, match="runs on vLLM's CPU and CUDA platforms, not on 'tpu'; use method 'dflash' there"):
        _rewrite_on(TPU, _args())


def test_gpu_worker_builds_our_runner_and_refuses_v2_on_the_v1_path() -> None:
    from vllm_ddtree.vllm import gpu_worker
    from vllm_ddtree.vllm.v1 import gpu_runner

    worker = SimpleNamespace(use_v2_model_runner=False, vllm_config="config", device="cuda:0")
    with (
        mock.patch.object(gpu_worker, "active_runner_path", return_value="v1"),
        mock.patch.object(gpu_runner, "DDTreeGPUModelRunner", side_effect=lambda config, device: (config, device)),
    ):
        assert gpu_worker.DDTreeGPUWorker._make_model_runner(worker) == ("config", "cuda:0")
        worker.use_v2_model_runner = True
        with pytest.raises(ValueError, match="V1 model runner"):
            gpu_worker.DDTreeGPUWorker._make_model_runner(worker)


def test_gpu_worker_builds_the_v2_layer_on_the_v2_path() -> None:
    from vllm_ddtree.vllm import gpu_worker
    from vllm_ddtree.vllm.v2 import gpu_runner

    worker = SimpleNamespace(vllm_config="config", device="cuda:0")
    with (
        mock.patch.object(gpu_worker, "active_runner_path", return_value="v2"),
        mock.patch.object(gpu_runner, "DDTreeV2GPUModelRunner", side_effect=lambda config, device: ("v2", config, device)),
    ):
        assert gpu_worker.DDTreeGPUWorker._make_model_runner(worker) == ("v2", "config", "cuda:0")


@pytest.mark.parametrize(("mode", "refused"), [("FULL", True), ("FULL_AND_PIECEWISE", False), ("FULL_DECODE_ONLY", False), ("PIECEWISE", False), ("NONE", False)])
def test_full_cuda_graphs_for_every_batch_are_refused(mode: str, refused: bool) -> None:
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.vllm.config import _full_graphs_for_mixed_batches

    config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]))
    assert _full_graphs_for_mixed_batches(config) is refused
