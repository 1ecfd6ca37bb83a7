"""The GPU layer's attention inside a real CPU engine: our TRITON_ATTN subclass registered in CPU_ATTN's
place (vLLM's CPU platform always picks CPU_ATTN), and a CPU runner with the GPU runner's attention
hooks. Only for a process with TRITON_INTERPRET=1 and the Triton "cpu" stand-in registered before vLLM.
"""

from __future__ import annotations

from vllm_ddtree.vllm.v1.cpu_runner import DDTreeCPUModelRunner
from vllm_ddtree.vllm.v1.gpu_runner import DDTreeGPUModelRunner
from vllm_ddtree.vllm.triton_attention import DDTreeTritonAttentionBackend

BACKEND = "tests.gpu.triton_on_cpu.DDTreeTritonAttentionBackend"


class DDTreeTritonCPUModelRunner(DDTreeCPUModelRunner):
    """The CPU runner (CPU slot mapping, no CUDA) with the GPU runner's attention hooks: the tree masks
    go into the Triton backend's buffers and K/V rows move on the logical cache."""

    _attach_tree_attention = DDTreeGPUModelRunner._attach_tree_attention
    _move_kv_rows = DDTreeGPUModelRunner._move_kv_rows
    _check_target_attention = DDTreeGPUModelRunner._check_target_attention


__all__ = ["BACKEND", "DDTreeTritonAttentionBackend", "DDTreeTritonCPUModelRunner"]
