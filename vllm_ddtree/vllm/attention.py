"""CPU attention with tree masks for the tree-verify requests of a batch (registered over CPU_ATTN).

A batch is first run through vLLM's CPU kernel unchanged. When the runner attached a `TreeAttention`
to the metadata (target forward of a step that verifies trees), the rows of the tree nodes are then
recomputed by masked SDPA over the request's K/V read back from the paged cache, and overwrite the
kernel's (causal, hence wrong) rows: node i attends to the whole committed prefix plus its ancestors and
itself. Everything else, including prefills, plain decodes and the DFlash draft's non-causal pass
(whose metadata never carries a tree), is exactly vLLM's CPU_ATTN.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.vllm.paged_kv import RegionLayout, probe_layout, read_rows, row_index


@dataclass(frozen=True)
class TreeAttention:
    """Tree-verify rows of one batch; T requests, N = max nodes, L = max window (prefix + nodes).

    query_rows [T, N]: batch row of node i (padded nodes repeat a valid row and are not written back);
    kv_slots [T, L]: cache slot of window position p (p < prefix + nodes; padding points at slot 0);
    bias [T, 1, N, L]: 0 where node i attends to position p, -inf elsewhere (never a whole row);
    valid [T, N]: real nodes, whose outputs are written back.
    Built once per step and shared by all target layers, as are the cache indices derived from it.
    """

    query_rows: torch.Tensor
    kv_slots: torch.Tensor
    bias: torch.Tensor
    valid: torch.Tensor
    _indices: dict = field(default_factory=dict, compare=False, repr=False)

    def kv_index(self, layout: RegionLayout, num_kv_heads: int) -> torch.Tensor:
        """`row_index` of the window positions, computed once per layout."""
        key = (id(layout), num_kv_heads)
        if key not in self._indices:
            self._indices[key] = row_index(layout, self.kv_slots.flatten(), num_kv_heads)
        return self._indices[key]


@dataclass
class DDTreeCPUAttentionMetadata(CPUAttentionMetadata):
    tree: TreeAttention | None = None


class DDTreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> DDTreeCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return DDTreeCPUAttentionMetadata(**{f.name: getattr(base, f.name) for f in fields(base)})


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        tree = getattr(attn_metadata, "tree", None)
        if tree is not None:
            self._tree_forward(layer, query, kv_cache, tree, output)
        return output

    def check_tree_support(self) -> None:
        """Raise unless this layer's options are ones the tree rows reproduce (called at model load)."""
        unsupported = {
            "non-decoder attention": self.attn_type != AttentionType.DECODER,
            "sliding-window attention": self.sliding_window != -1,
            "ALiBi": self.alibi_slopes is not None,
            "logit soft-capping": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "quantized KV cache": self.is_fp8_kv_cache,
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise NotImplementedError(f"method 'ddtree' does not support target models with {', '.join(found)}")

    def _tree_forward(
        self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, tree: TreeAttention, output: torch.Tensor
    ) -> None:
        num_req, window = tree.kv_slots.shape
        layout = probe_layout(layer.isa, kv_cache.shape[2], self.head_size, kv_cache.dtype)
        keys, values = read_rows(kv_cache, tree.kv_index(layout, self.num_kv_heads))
        keys = keys.view(num_req, window, self.num_kv_heads, -1).transpose(1, 2)
        values = values.view(num_req, window, self.num_kv_heads, -1).transpose(1, 2)
        queries = query[tree.query_rows].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            queries.float(), keys.float(), values.float(), attn_mask=tree.bias, scale=self.scale, enable_gqa=True
        )
        output[tree.query_rows[tree.valid]] = attended.transpose(1, 2)[tree.valid].to(output.dtype)


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder
