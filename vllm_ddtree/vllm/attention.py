"""CPU attention with tree masks for the tree-verify requests of a batch (registered over CPU_ATTN).

A batch is first run through vLLM's CPU kernel unchanged. When the runner attached a `TreeAttention`
to the metadata (target forward of a step that verifies branching trees), the rows of those trees' nodes are then
recomputed by masked SDPA over the request's K/V read back from the paged cache, and overwrite the
kernel's (causal, hence wrong) rows: node i attends to the whole committed prefix plus its ancestors and
itself. Everything else, including prefills, plain decodes and the DFlash draft's non-causal pass
(whose metadata never carries a tree), is exactly vLLM's CPU_ATTN.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.vllm.paged_kv import probe_layout, read_blocks
from vllm_ddtree.vllm.tree_step import TreeRows


@dataclass(frozen=True)
class TreeAttention:
    """Tree-verify rows of one batch; T branching requests, N = max nodes, W blocks per window.

    query_rows [T * N]: batch row of node i of request t at t * N + i (padded nodes repeat a valid row
    and are not written back);
    block_ids [T, W]: the first W entries of the request's block table, covering prefix + nodes;
    bias [T, 1, N, L]: 0 where node i attends to position p, -inf elsewhere (never a whole row);
    L is the longest window (prefix + nodes), at most W * block_size;
    valid_nodes [M]: flat indices t * N + i of the real nodes, whose outputs are written back, and
    valid_rows [M]: their batch rows (query_rows[valid_nodes]).
    Built once per step and shared by all target layers. (Rows move by index_select / index_copy_:
    advanced indexing is ~10x slower on CPU.)
    """

    query_rows: torch.Tensor
    block_ids: torch.Tensor
    bias: torch.Tensor
    valid_nodes: torch.Tensor
    valid_rows: torch.Tensor

    @classmethod
    def build(cls, rows: TreeRows, block_table: torch.Tensor, block_size: int) -> TreeAttention:
        """The masks of a step's branching trees; block_table [num_reqs, max blocks] maps a request's
        positions to cache blocks (position p lives in block block_table[p // block_size], row
        p % block_size)."""
        num_req, width = rows.valid.shape
        window_len = rows.starts + rows.num_nodes
        longest = int(window_len.max())
        block_ids = block_table[rows.req_indices][:, : -(-longest // block_size)].long()
        pos = torch.arange(longest).unsqueeze(0)
        in_window = pos < window_len.unsqueeze(1)
        column = pos - rows.starts.unsqueeze(1)  # tree node index of a window position, < 0 in the prefix
        in_tree = (column >= 0) & in_window
        ancestors = rows.ancestor_mask.gather(2, column.clamp(0, width - 1).unsqueeze(1).expand(-1, width, -1))
        mask = (column < 0).unsqueeze(1) | (ancestors & in_tree.unsqueeze(1))
        mask = torch.where(rows.valid.unsqueeze(2), mask, mask[:, :1])
        bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")).unsqueeze(1)
        query_rows = rows.node_rows.flatten()
        valid_nodes = rows.valid.flatten().nonzero().squeeze(1)
        return cls(
            query_rows=query_rows,
            block_ids=block_ids,
            bias=bias,
            valid_nodes=valid_nodes,
            valid_rows=query_rows.index_select(0, valid_nodes),
        )


@dataclass
class DDTreeCPUAttentionMetadata(CPUAttentionMetadata):
    tree: TreeAttention | None = None


class DDTreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    @override
    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> DDTreeCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return DDTreeCPUAttentionMetadata(**{f.name: getattr(base, f.name) for f in fields(base)})


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    @override
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
        layout = probe_layout(layer.isa, kv_cache.shape[2], self.head_size, kv_cache.dtype)
        keys, values = read_blocks(kv_cache, tree.block_ids, layout)
        window = tree.bias.shape[-1]
        keys, values = keys[:, :, :window], values[:, :, :window]
        num_req, _, num_nodes, _ = tree.bias.shape
        queries = query.index_select(0, tree.query_rows).unflatten(0, (num_req, num_nodes)).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            queries.float(), keys.float(), values.float(), attn_mask=tree.bias, scale=self.scale, enable_gqa=True
        )
        attended = attended.transpose(1, 2).flatten(0, 1).index_select(0, tree.valid_nodes)
        output.index_copy_(0, tree.valid_rows, attended.to(output.dtype))


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    @override
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl

    @staticmethod
    @override
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder
