"""CPU attention with tree masks for the tree-verify requests of a batch (registered over CPU_ATTN).

Every row that is not a branching tree's node is vLLM's CPU kernel unchanged: prefills, plain decodes,
chains, and the DFlash draft's non-causal pass (whose metadata never carries a tree). A branching tree's
node i attends to the request's whole committed prefix plus its ancestors and itself; its rows are
computed here, once:
- the kernel does not compute them: when the trees' nodes are the whole batch (batch 1) it is not
  called; otherwise each such request's kernel seq_len is cut to its own rows (`attach_tree`), so the
  kernel spends a few rows x rows on them, whatever the prefix length, and those rows are overwritten;
- the request's window (prefix + nodes, whose K/V the cache already holds) is read once, in place:
  by one compiled call per layer where it serves (`cpu_tree_kernel`: float32 or bfloat16, any of vLLM's
  CPU layouts, "amx" included; block by block, online softmax), else by the torch formulation (`tree_attention`): run of
  consecutive cache blocks by run, through views of the paged cache (`paged_kv.block_run`: no copy for
  the "vec" layouts). Per run: logits = q k^T, the tree mask added on the window's last blocks only
  (where the nodes are), the run's softmax and its log-sum-exp; runs merge by log-sum-exp. Either way
  the cost beyond the rows x rows part is one read of the window and one q k^T / p v over it.
vLLM's kernel returns no log-sum-exp (`cpu_attention_with_kv_cache` writes the normalized output only),
so its prefix attention cannot be merged with a node-to-node part; the prefix is read here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.vllm import cpu_tree_kernel
from vllm_ddtree.vllm.host_tree import tree_windows
from vllm_ddtree.vllm.paged_kv import RegionLayout, block_run, probe_layout

logger = logging.getLogger("vllm.ddtree")
from vllm_ddtree.vllm.tree_step import TreeRows


@dataclass(frozen=True)
class WindowRun:
    """Consecutive cache blocks first_block .. first_block + num_blocks - 1 of one request's window, in
    window order. bias [k, 1, 1, N, block_size]: the additive tree mask (0 / -inf) of the run's last k
    blocks, those holding nodes or positions past the window (k = 0: prefix blocks, seen by every node),
    from block `bias_from` = num_blocks - k of the run on."""

    first_block: int
    num_blocks: int
    bias_from: int
    bias: torch.Tensor


@dataclass(frozen=True)
class TreeAttention:
    """Tree-verify rows of one batch; T branching requests, N = max nodes. Built once per step and shared
    by all target layers.

    rows: the step's `TreeRows`; block_table [num_reqs, max blocks] int32, block_size: the paged cache's;
    host_arrays: what the compiled kernel reads (`cpu_tree_kernel.attend_tree_rows`: block table,
    req_indices, starts, num_nodes, ancestor mask, node rows), as contiguous numpy arrays.
    For the torch formulation (`tree_attention`), computed when first read:
    query_rows [T * N]: batch row of node i of request t at t * N + i (padded nodes repeat the root's row;
    their mask is the root's, never written back);
    runs[t]: request t's window (positions 0 .. start + num_nodes - 1, rounded up to whole blocks) as
    `WindowRun`s in window order;
    valid_nodes [M]: flat indices t * N + i of the real nodes, whose outputs are written back, and
    valid_rows [M]: their batch rows (query_rows[valid_nodes]);
    first_row: query_rows[0] when query_rows is first_row, first_row + 1, ... (read as a slice), else None;
    all_valid: no padded nodes (M = T * N).
    (Rows move by index_select / index_copy_: advanced indexing is many times slower on CPU.)
    """

    rows: TreeRows
    block_table: torch.Tensor
    block_size: int
    host_arrays: tuple[np.ndarray, ...]

    @classmethod
    def build(cls, rows: TreeRows, block_table: torch.Tensor, block_size: int) -> TreeAttention:
        """The masks of a step's branching trees; block_table [num_reqs, max blocks] maps a request's
        positions to cache blocks (position p lives in block block_table[p // block_size], row
        p % block_size)."""
        def int64(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.numpy(), dtype=np.int64)

        host_arrays = (
            np.ascontiguousarray(block_table.numpy()), int64(rows.req_indices), int64(rows.starts), int64(rows.num_nodes),
            np.ascontiguousarray(rows.ancestor_mask.numpy()), int64(rows.node_rows),
        )
        return cls(rows, block_table, block_size, host_arrays)

    @property
    def num_nodes(self) -> int:
        return self.rows.node_rows.shape[1]

    @functools.cached_property
    def runs(self) -> tuple[tuple[WindowRun, ...], ...]:
        rows = self.rows
        bias, window_runs = tree_windows(
            rows.ancestor_mask, rows.starts, rows.num_nodes, rows.valid, rows.req_indices, self.block_table, self.block_size
        )
        runs: list[list[WindowRun]] = [[] for _ in range(bias.shape[0])]
        for t, first_block, num_blocks, bias_from, lo, hi in window_runs:
            runs[t].append(WindowRun(first_block, num_blocks, bias_from, torch.from_numpy(bias[t, lo:hi])))
        return tuple(map(tuple, runs))

    @functools.cached_property
    def query_rows(self) -> torch.Tensor:
        return self.rows.node_rows.reshape(-1)

    @functools.cached_property
    def valid_nodes(self) -> torch.Tensor:
        return self.rows.valid.reshape(-1).nonzero().squeeze(1)

    @functools.cached_property
    def valid_rows(self) -> torch.Tensor:
        return self.query_rows.index_select(0, self.valid_nodes)

    @functools.cached_property
    def first_row(self) -> int | None:
        query_rows = self.query_rows.numpy()
        first_row = int(query_rows[0])
        return first_row if bool((query_rows == np.arange(first_row, first_row + query_rows.size)).all()) else None

    @property
    def all_valid(self) -> bool:
        return self.valid_nodes.numel() == self.query_rows.numel()


@dataclass
class DDTreeCPUAttentionMetadata(CPUAttentionMetadata):
    """CPU_ATTN's metadata, plus the step's tree (`attach_tree`), whether the kernel runs at all, and how
    to redo the kernel's schedule for other seq_lens (`reschedule(seq_lens=...)`)."""

    tree: TreeAttention | None = None
    run_kernel: bool = True
    reschedule: Callable[..., torch.Tensor] | None = None

    def attach_tree(self, tree: TreeAttention, rows: TreeRows) -> None:
        """Keep the kernel off the tree rows: a branching request whose rows are exactly its nodes gets
        kernel seq_len = its rows (a causal pass over its first positions; overwritten), and the kernel
        does not run when those requests are the whole batch."""
        self.tree = tree
        # host tensors, read in numpy (a few small operations at every tree step)
        query_lens = np.diff(self.query_start_loc.numpy())
        req_indices, num_nodes = rows.req_indices.numpy(), rows.num_nodes.numpy()
        own_rows = query_lens[req_indices] == num_nodes
        if int(num_nodes[own_rows].sum()) == self.num_actual_tokens:
            self.run_kernel = False
            return
        requests = req_indices[own_rows]
        if requests.size and self.reschedule is not None:
            seq_lens = self.seq_lens.clone()
            seq_lens[torch.from_numpy(requests)] = torch.from_numpy(query_lens[requests]).to(seq_lens.dtype)
            self.seq_lens = seq_lens
            self.scheduler_metadata = self.reschedule(seq_lens=seq_lens)


class DDTreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    @override
    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> DDTreeCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata = object.__new__(DDTreeCPUAttentionMetadata)  # CPU_ATTN's fields as built (no per-field copy)
        metadata.__dict__.update(vars(base))
        metadata.tree, metadata.run_kernel, metadata.reschedule = None, True, None
        if not self.is_encoder_only_attention and not self.is_cross_attention:
            metadata.reschedule = functools.partial(
                ops.cpu_attn_get_scheduler_metadata,
                num_reqs=common_attn_metadata.num_reqs,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                query_start_loc=base.query_start_loc,
                causal=base.causal,
                sliding_window_size=self.window_size,
                isa=self.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=base.dynamic_causal,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        return metadata


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    _tree_path: tuple[torch.Tensor, RegionLayout, cpu_tree_kernel.LayerCache | None] | None = None
    """The layer's cache, its layout, and the cache as the compiled kernel reads it when the kernel takes
    the layer's tree rows (`_kernel_serves`; else None: the torch formulation), decided at its first tree
    step: the layer's dtypes, cache and output buffers never change."""

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
        tree = getattr(attn_metadata, "tree", None)
        if tree is None or getattr(attn_metadata, "run_kernel", True):
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if tree is not None:
            if self._tree_path is None or self._tree_path[0] is not kv_cache:  # the layer's first tree step
                layout = probe_layout(layer.isa, kv_cache.shape[2], self.head_size, kv_cache.dtype)
                serves = _kernel_serves(query, kv_cache, output, layout)
                self._tree_path = (kv_cache, layout, cpu_tree_kernel.layer_cache(kv_cache, layout) if serves else None)
            _, layout, cache = self._tree_path
            if cache is not None:
                cpu_tree_kernel.attend_tree_rows(output.view(query.shape), query, cache, *tree.host_arrays, self.scale)
                return output
            attended = tree_attention(query, kv_cache, tree, layout, self.num_kv_heads, self.scale)
            output.index_copy_(0, tree.valid_rows, attended.reshape(-1, *output.shape[1:]).to(output.dtype))
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


def _kernel_serves(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, layout: Any) -> bool:
    """Whether the compiled kernel takes this layer's tree rows: it compiled, one dtype it reads
    throughout, an output it can write in place (it reads every layout `probe_layout` describes; `layout`
    is not consulted)."""
    return (query.dtype == kv_cache.dtype == output.dtype and query.dtype in cpu_tree_kernel.DTYPES and output.is_contiguous()
            and kv_cache.is_contiguous() and cpu_tree_kernel.available())


def tree_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, tree: TreeAttention, layout: Any, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """[M, num_heads, head_size] float32: the attention of the tree's real nodes (`tree.valid_nodes`
    order). query [rows, num_heads, head_size] (query head h reads KV head h // (num_heads / num_kv_heads),
    vLLM's grouping); kv_cache one layer's CPU_ATTN cache, holding every window's K/V (nodes included)."""
    num_req, num_nodes = len(tree.runs), tree.num_nodes
    _, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    if tree.first_row is not None:  # rows first_row .. first_row + T * N - 1, in node order
        queries = query.narrow(0, tree.first_row, num_req * num_nodes)
    else:
        queries = query.index_select(0, tree.query_rows)
    queries = queries.view(num_req, num_nodes, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    queries = queries.reshape(num_req, num_kv_heads, group * num_nodes, head_size).float() * scale  # (may be a view of query)
    outputs = []
    for t, runs in enumerate(tree.runs):
        parts = [_attend_run(queries[t], kv_cache, run, layout, group, num_nodes, masked_rows=len(runs) > 1) for run in runs]
        if len(parts) == 1:
            attended, _, total = parts[0]
            outputs.append(attended.div_(total.unsqueeze(-1)))
            continue
        maxima = torch.stack([m for _, m, _ in parts])  # [S, KV, G * N]
        weights = (maxima - maxima.amax(0)).exp_()
        total = (torch.stack([z for _, _, z in parts]) * weights).sum(0)
        attended = (torch.stack([o for o, _, _ in parts]) * weights.unsqueeze(-1)).sum(0)
        outputs.append(attended.div_(total.unsqueeze(-1)))
    attended = outputs[0].unsqueeze(0) if num_req == 1 else torch.stack(outputs)
    attended = attended.view(num_req, num_kv_heads, group, num_nodes, head_size).permute(0, 3, 1, 2, 4)
    attended = attended.reshape(num_req * num_nodes, num_heads, head_size)
    return attended if tree.all_valid else attended.index_select(0, tree.valid_nodes)


def _attend_run(
    queries: torch.Tensor, kv_cache: torch.Tensor, run: WindowRun, layout: Any, group: int, num_nodes: int, masked_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One run's share of the softmax, unnormalized: (sum_p e^(l_p - m) v_p [KV, G * N, head_size],
    m = the row's largest logit in the run [KV, G * N], sum_p e^(l_p - m) [KV, G * N]). queries
    [KV, G * N, head_size], already scaled. masked_rows: some row may see none of the run (its m is
    -inf); it then contributes zeros with a finite m."""
    keys_t, values = block_run(kv_cache, run.first_block, run.num_blocks, layout)
    logits = torch.matmul(queries, keys_t.float())  # [blocks, KV, G * N, block_size]
    if run.bias_from < run.num_blocks:
        logits.unflatten(2, (group, num_nodes))[run.bias_from :].add_(run.bias)
    maxima = logits.amax(dim=(0, 3), keepdim=True)
    if masked_rows:
        maxima.clamp_(min=torch.finfo(torch.float32).min)
    probs = logits.sub_(maxima).exp_()
    attended = torch.matmul(probs, values.float())  # [blocks, KV, G * N, head_size]
    attended = attended[0] if run.num_blocks == 1 else attended.sum(0)
    return attended, maxima.view(maxima.shape[1:3]), probs.sum(dim=(0, 3))


def warn_unless_float32(dtype: torch.dtype) -> None:
    """Log, for a target of another dtype, how the tree rows' attention rounds (called at model load)."""
    if dtype != torch.float32:
        logger.warning(
            "method 'ddtree' with a %s target on CPU: the tree rows' attention is computed in float32 and rounded "
            "once, vLLM's kernel rounds plain rows its own way, so greedy tokens can differ from plain decoding "
            "where two logits tie within %s rounding (chains and steps without speculation are vLLM's kernel); "
            "use dtype float32 for token-identical greedy output", dtype, dtype)


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    @override
    def get_impl_cls() -> type[DDTreeCPUAttentionImpl]:
        return DDTreeCPUAttentionImpl

    @staticmethod
    @override
    def get_builder_cls() -> type[DDTreeCPUAttentionMetadataBuilder]:
        return DDTreeCPUAttentionMetadataBuilder
