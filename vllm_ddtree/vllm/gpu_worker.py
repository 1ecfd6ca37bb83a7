"""The CUDA worker of method 'ddtree' (selected through vLLM's `worker_cls`): vLLM's GPU worker running
our runner through its runner factory hook: `DDTreeV2GPUModelRunner` on runner path "v2"
(`patching.active_runner_path`), else `DDTreeGPUModelRunner` (V1), which times the budget policy's step
costs once vLLM's warm-up and graph capture are done (the V2 layer learns them online). Each layer is
imported only where it runs: a release without the V1 runner (0.34) cannot import the V1 layer."""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.v1.worker.gpu_worker import Worker

from vllm_ddtree.vllm.patching import active_runner_path


class DDTreeGPUWorker(Worker):
    @override
    def _make_model_runner(self) -> Any:
        if active_runner_path() == "v2":
            from vllm_ddtree.vllm.v2.gpu_runner import DDTreeV2GPUModelRunner

            return DDTreeV2GPUModelRunner(self.vllm_config, self.device)
        if self.use_v2_model_runner:  # the V1 path: config.py sets VLLM_USE_V2_MODEL_RUNNER=0; vLLM may still choose V2
            raise ValueError("method 'ddtree' needs vLLM's V1 model runner, but vLLM chose V2; set VLLM_USE_V2_MODEL_RUNNER=0")
        from vllm_ddtree.vllm.v1.gpu_runner import DDTreeGPUModelRunner

        return DDTreeGPUModelRunner(self.vllm_config, self.device)

    @override
    def compile_or_warm_up_model(self) -> Any:
        # the last start-up step vLLM runs on the worker: the KV cache is allocated, graphs captured
        times = super().compile_or_warm_up_model()
        if active_runner_path() != "v2":  # the start-up timing runs V1's `_dummy_run` layout
            self.model_runner.time_startup_costs()
        return times
