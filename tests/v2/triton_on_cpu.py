"""The V2 CUDA layer's hooks inside a V2 CPU engine: V2's CPU runner with `DDTreeV2TritonMixin` (the
platform hooks `DDTreeV2GPUModelRunner` runs on CUDA), beside our TRITON_ATTN subclass registered in
CPU_ATTN's place (`tests/gpu/triton_on_cpu.py`). Only for a process with TRITON_INTERPRET=1 and the
Triton "cpu" stand-in registered before vLLM.
"""

from __future__ import annotations

from vllm_ddtree.vllm.v2.cpu_runner import DDTreeV2CPUModelRunner
from vllm_ddtree.vllm.v2.gpu_runner import DDTreeV2TritonMixin


class DDTreeV2TritonCPUModelRunner(DDTreeV2TritonMixin, DDTreeV2CPUModelRunner):
    """V2's CPU runner (host tensors, no graphs) with the CUDA layer's hooks: the tree masks go into the
    Triton backend's persistent buffers, K/V rows move on the logical cache, the target must run our
    TRITON_ATTN subclass."""
