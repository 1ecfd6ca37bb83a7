"""The CPU worker of method 'ddtree' (selected through vLLM's `worker_cls`): vLLM's CPUWorker running
`DDTreeCPUModelRunner`, or `DDTreeV2CPUModelRunner` where vLLM chose its V2 model runner (the user's
`VLLM_USE_V2_MODEL_RUNNER=1`, admitted by `config.check_engine_config`). The V1 runner times the budget
policy's step costs once vLLM's warm-up is done; the V2 layer learns them online."""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.v1.worker.cpu_worker import CPUWorker


class DDTreeCPUWorker(CPUWorker):
    @override
    def init_device(self) -> None:
        # CPUWorker.init_device builds its model runner inline (no factory hook in vLLM 0.32). The stock
        # runner it builds holds no model or KV cache yet; replace it before anything is loaded.
        super().init_device()
        if self.use_v2_model_runner:
            # imported here: the V2 layer imports vLLM's V2 runner modules, which a V1 engine never needs
            from vllm_ddtree.vllm.v2.cpu_runner import DDTreeV2CPUModelRunner

            self.model_runner = DDTreeV2CPUModelRunner(self.vllm_config, self.device)
            return
        from vllm_ddtree.vllm.v1.cpu_runner import DDTreeCPUModelRunner  # here: only the V1 path imports V1 modules

        self.model_runner = DDTreeCPUModelRunner(self.vllm_config, self.device)

    @override
    def compile_or_warm_up_model(self) -> Any:
        # the last start-up step vLLM runs on the worker: the KV cache is allocated, the model warmed up
        times = super().compile_or_warm_up_model()
        if not self.use_v2_model_runner:  # the start-up timing runs V1's `_dummy_run` layout
            self.model_runner.time_startup_costs()
        return times
