"""vLLM general-plugin entry point (`vllm.general_plugins: ddtree`), run in every vLLM process.

It refuses a vLLM release this package does not support (`SUPPORTED_VLLM`) and any vLLM that lacks or
changed a member its runner path relies on (`surface.check_vllm_surface`); registers method 'ddtree' as a
custom speculative method where vLLM has the registry (0.34: `v2/speculator_config.py`); applies the
declared patches of the installed release (most act only for method 'ddtree';
the CPU kernel-scan fix and, in a process without torchvision, the import of vLLM's Qwen3.5/3.6 model
code with transformers' torchvision-free `smart_resize`, `text_only_imports`, act for every engine)
and registers the platform's tree-aware attention backend: CPU_ATTN on CPU, TRITON_ATTN on CUDA GPUs.
Each behaves exactly like vLLM's own backend for every batch that holds no tree-verify request.

The surface check runs on every platform. It imports the owners of the members it checks, which an
engine imports anyway, except on platforms other than CPU, where the entries owned by vLLM's CPU-platform
modules (its CPU worker, runner and attention, which run only there) are left out
(`VLLMMember.cpu_only`).
"""

from __future__ import annotations

from vllm_ddtree.vllm.config import METHOD
from vllm_ddtree.vllm.patching import check_vllm_version
from vllm_ddtree.vllm.surface import REGISTER_SPECULATIVE_METHOD, available, check_vllm_surface, installed_surface

ATTENTION_BACKEND = "vllm_ddtree.vllm.attention.DDTreeCPUAttentionBackend"
SPECULATOR_CONFIG = "vllm_ddtree.vllm.v2.speculator_config.DDTreeSpeculatorConfig"
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
    check_vllm_surface(installed_surface(cpu=on_cpu))
    register_speculative_method()
    apply_all()
    if on_cpu:
        register_backend(AttentionBackendEnum.CPU_ATTN, ATTENTION_BACKEND)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.TRITON_ATTN, GPU_ATTENTION_BACKEND)


def register_speculative_method() -> None:
    """Register method 'ddtree' with vLLM's speculator registry where the installed release has one (0.34),
    by qualified name: vLLM imports the config when an engine asks for the method."""
    if not available(REGISTER_SPECULATIVE_METHOD):
        return
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method as register_method

    register_method(METHOD, SPECULATOR_CONFIG)
