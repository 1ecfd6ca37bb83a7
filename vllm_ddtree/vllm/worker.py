"""The CPU worker of method 'ddtree' (selected through vLLM's `worker_cls`): vLLM's CPUWorker running
`DDTreeModelRunner`."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ddtree.vllm.runner import DDTreeModelRunner


class DDTreeCPUWorker(CPUWorker):
    def init_device(self) -> None:
        # CPUWorker.init_device builds its model runner inline (no factory hook in vLLM 0.32). The stock
        # runner it builds holds no model or KV cache yet; replace it before anything is loaded.
        super().init_device()
        self.model_runner = DDTreeModelRunner(self.vllm_config, self.device)
