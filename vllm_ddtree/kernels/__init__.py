"""Triton kernels with torch references beside them. Imports torch and triton only (never vLLM), so
the GPU check runs on machines without vLLM; on CPU the kernels run under TRITON_INTERPRET=1."""

from vllm_ddtree.kernels.tree_attention import TreeAttentionConfig, default_config, tree_attention
from vllm_ddtree.kernels.tree_attention_reference import tree_attention_reference
from vllm_ddtree.kernels.tree_mask import pack_tree_mask

__all__ = [
    "TreeAttentionConfig",
    "default_config",
    "pack_tree_mask",
    "tree_attention",
    "tree_attention_reference",
]
