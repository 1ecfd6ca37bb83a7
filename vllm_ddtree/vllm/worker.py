"""The CPU worker of method 'ddtree' (selected through vLLM's `worker_cls`): vLLM's CPUWorker running
`DDTreeCPUModelRunner`, which times the budget policy's step costs once vLLM's warm-up is done."""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ddtree.vllm.cpu_runner import DDTreeCPUModelRunner


class DDTreeCPUWorker(CPUWorker):
    @override
    def init_device(self) -> None:
        # CPUWorker.init_device builds its model runner inline (no factory hook in vLLM 0.32). The stock
        # runner it builds holds no model or KV cache yet; replace it before anything is loaded.
        super().init_device()
        self.model_runner = DDTreeCPUModelRunner(self.vllm_config, self.device)

    @override
    def compile_or_warm_up_model(self) -> Any:
        # the last start-up step vLLM runs on the worker: the KV cache is allocated, the model warmed up
        times = super().compile_or_warm_up_model()
        self.model_runner.time_startup_costs()
        return times
