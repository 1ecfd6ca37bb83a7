"""The CPU worker of method 'ddtree' (selected through vLLM's `worker_cls`): vLLM's CPUWorker running
`DDTreeCPUModelRunner`."""

from __future__ import annotations

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
