"""The CUDA worker of method 'ddtree' (selected through vLLM's `worker_cls`): vLLM's GPU worker running
`DDTreeGPUModelRunner` through its runner factory hook, which times the budget policy's step costs once
vLLM's warm-up and graph capture are done."""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.v1.worker.gpu_worker import Worker

from vllm_ddtree.vllm.v1.gpu_runner import DDTreeGPUModelRunner


class DDTreeGPUWorker(Worker):
    @override
    def _make_model_runner(self) -> DDTreeGPUModelRunner:
        if self.use_v2_model_runner:  # config.py forces V1; vLLM may still choose V2 for other reasons
            raise ValueError("method 'ddtree' needs vLLM's V1 model runner, but vLLM chose V2; set VLLM_USE_V2_MODEL_RUNNER=0")
        return DDTreeGPUModelRunner(self.vllm_config, self.device)

    @override
    def compile_or_warm_up_model(self) -> Any:
        # the last start-up step vLLM runs on the worker: the KV cache is allocated, graphs captured
        times = super().compile_or_warm_up_model()
        self.model_runner.time_startup_costs()
        return times
