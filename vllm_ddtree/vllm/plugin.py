"""vLLM general-plugin entry point (`vllm.general_plugins: ddtree`), run in every vLLM process.

It refuses any vLLM but `SUPPORTED_VLLM`, applies the declared patches (which act only on requests for
method 'ddtree') and, on the CPU platform, registers the tree-aware CPU attention backend, which
behaves exactly like vLLM's CPU_ATTN for every batch that holds no tree-verify request.
"""

from __future__ import annotations

from vllm_ddtree.vllm.patching import check_vllm_version

ATTENTION_BACKEND = "vllm_ddtree.vllm.attention.DDTreeCPUAttentionBackend"


def register() -> None:
    check_vllm_version()

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    from vllm_ddtree.vllm.patches import apply_all

    apply_all()
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, ATTENTION_BACKEND)
