"""TRITON_ATTN with tree masks for the tree-verify rows of a batch (registered over TRITON_ATTN on CUDA).

A batch first runs through vLLM's `TritonAttentionImpl.forward` unchanged. When the runner attached a
`TreeVerify` to the metadata (the target forward of a step that verifies branching trees), the tree
nodes' rows are then recomputed by the Triton tree-attention kernel (`vllm_ddtree.kernels`) straight
from vLLM's paged cache (`kv_cache.transpose(1, 2).split(head_size, -1)`, any physical stride order)
and overwrite vLLM's causal, hence wrong, rows: node i attends to the committed prefix, its ancestors
and itself. A tree in the uniform layout covers every row of the batch (chains with causal masks), so
vLLM's kernel, whose every row would be overwritten, does not run then. Everything else, including
prefills, plain decodes and the DFlash draft's non-causal pass (whose metadata never carries a tree),
is exactly vLLM's TRITON_ATTN.

CUDA graphs (`tree_verify.py` has the layouts): the builder owns the persistent `TreeVerifyBuffers`.
A FULL graph is captured only for uniform verify batches (every request 1 + num_speculative_tokens
rows); such a capture carries a tree of causal masks over those buffers, so the tree kernel is part of
the graph, and every later build of a uniform verify batch resets those masks to causal on the device
(a step whose trees are all chains attaches nothing, yet its replay runs the kernel). Other batches run
attention eagerly (PIECEWISE graphs) and may use either layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from typing_extensions import override
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode

from vllm_ddtree.vllm.tree_verify import TreeVerify, TreeVerifyBuffers


@dataclass
class DDTreeTritonAttentionMetadata(TritonAttentionMetadata):
    """vLLM's metadata plus tree: this batch's tree-verify rows (None: plain TRITON_ATTN), and
    tree_buffers: the builder's persistent buffers, which the runner fills (`TreeVerifyBuffers.fill`)."""

    tree: TreeVerify | None = None
    tree_buffers: TreeVerifyBuffers | None = None


class DDTreeTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's builder plus persistent tree buffers for max_num_seqs requests x max_tree_nodes
    (1 + num_speculative_tokens) nodes."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        speculative = vllm_config.speculative_config
        self.max_tree_nodes = 1 + ((speculative.num_speculative_tokens or 0) if speculative is not None else 0)
        self.tree_buffers = TreeVerifyBuffers(
            max_requests=vllm_config.scheduler_config.max_num_seqs,
            max_nodes=self.max_tree_nodes,
            block_size=self.block_size,
            num_q_heads=self.num_heads_q,
            head_size=self.headdim,
            dtype=vllm_config.model_config.dtype,
            device=device,
            pin_memory=is_pin_memory_available(),
        )

    def _is_uniform_verify(self, common: CommonAttentionMetadata) -> bool:
        """A causal batch whose every request has max_tree_nodes (> 1) query rows: FULL-graph shaped."""
        nodes = self.max_tree_nodes
        return common.causal is True and nodes > 1 and common.max_query_len == nodes and common.num_actual_tokens == common.num_reqs * nodes

    @override
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False) -> DDTreeTritonAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata = DDTreeTritonAttentionMetadata(**{f.name: getattr(base, f.name) for f in fields(base)}, tree_buffers=self.tree_buffers)
        if self.decode_cudagraph_enabled and self._is_uniform_verify(common_attn_metadata):
            self.tree_buffers.uniform(metadata.seq_lens, metadata.block_table, self.max_tree_nodes)  # a replay's chains
        return metadata

    @override
    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> DDTreeTritonAttentionMetadata:
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        assert isinstance(metadata, DDTreeTritonAttentionMetadata)
        if self._is_uniform_verify(common_attn_metadata):
            metadata.tree = self.tree_buffers.uniform(metadata.seq_lens, metadata.block_table, self.max_tree_nodes)
        return metadata


class DDTreeTritonAttentionImpl(TritonAttentionImpl):
    @override
    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tree = getattr(attn_metadata, "tree", None)
        if tree is None or not tree.covers_batch:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if tree is not None:
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            tree.attend(query, key_cache, value_cache, output, self.scale)
        return output

    @override
    def fused_output_quant_supported(self, quant_key: QuantKey) -> bool:
        """Never: the tree rows are written in the output's dtype, after vLLM's kernel."""
        return False

    def check_tree_support(self) -> None:
        """Raise unless this layer's options are ones the tree rows reproduce (called at model load)."""
        unsupported = {
            "non-decoder attention": self.attn_type != AttentionType.DECODER,
            "sliding-window attention": self.sliding_window != (-1, -1),
            "ALiBi": self.alibi_slopes is not None,
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "quantized KV cache": self._kv_quant_mode != KVQuantMode.NONE,
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise NotImplementedError(f"method 'ddtree' does not support target models with {', '.join(found)}")


class DDTreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    @override
    def get_impl_cls() -> type[DDTreeTritonAttentionImpl]:
        return DDTreeTritonAttentionImpl

    @staticmethod
    @override
    def get_builder_cls() -> type[DDTreeTritonAttentionMetadataBuilder]:
        return DDTreeTritonAttentionMetadataBuilder


def check_tree_target(layer: Any, is_mm_prefix_lm: bool) -> None:
    """Raise unless the target layer runs our TRITON_ATTN subclass with tree support (both runner layers'
    CUDA platform check). Also refuses mm-prefix LMs: a uniform verify batch is recomputed with causal and
    tree masks only, which would drop a prefill chunk's bidirectional image ranges."""
    if not isinstance(layer.impl, DDTreeTritonAttentionImpl):
        raise NotImplementedError("method 'ddtree' needs vLLM's TRITON_ATTN attention backend for the target on CUDA")
    if is_mm_prefix_lm:
        raise NotImplementedError("method 'ddtree' does not support targets with bidirectional multimodal prefixes (mm-prefix LMs); use method 'dflash'")
    layer.impl.check_tree_support()
