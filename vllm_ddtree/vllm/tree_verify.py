"""The tree-verify rows of a batch laid out for the Triton tree-attention kernel, in persistent buffers.

`tree_attention` (vllm_ddtree.kernels) takes R requests x N nodes: queries [R, N, Hq, D], packed
ancestor masks [R, N, W], per-request seq_lens (prefix + N) and block tables, and reads K/V straight
from vLLM's paged cache. A batch reaches it in one of two layouts:

- uniform: every request of the batch has exactly N query rows (a pure verify batch, the shape of
  vLLM's FULL decode CUDA graphs). Node i of request t is batch row t * N + i, so the kernel reads
  the batch's query rows and writes the batch's output rows in place, with vLLM's own seq_lens
  (start + N; 0 for the padded requests of a graph) and block table. Chains (and a prefill chunk
  that happens to have N rows) get the causal mask, so the tree kernel computes every row of the
  batch and vLLM's kernel need not run; only the masks are ours.
- gather: anything else (prefills, requests with fewer drafts). Only the branching trees are taken:
  their nodes' query rows are gathered into a workspace, the kernel writes a workspace, and the real
  nodes' rows are copied back. Padded nodes (a tree with fewer than N nodes) repeat the root's query,
  are never written back, and no real node's mask bit points at them; their K/V reads stay inside the
  cache (the block ids carry null-block columns past the table) and vLLM zero-fills its cache, so the
  masked-out values are finite and contribute exactly nothing.

All tensors the kernel reads live in `TreeVerifyBuffers`, allocated once for the largest batch
(max_num_seqs requests x (1 + num_speculative_tokens) nodes), so their addresses never change: a CUDA
graph captured over a uniform batch replays against whatever the runner writes there next. Host data
(masks, lengths, row indices; `TreeRows` are host tensors) is staged through pinned host buffers and
copied without blocking: the host never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.kernels.tree_attention import tree_attention
from vllm_ddtree.kernels.tree_mask import mask_words, pack_tree_mask
from vllm_ddtree.vllm.tree_step import TreeRows


@dataclass(frozen=True)
class TreeVerify:
    """One batch's tree-verify rows as the kernel reads them: R requests x N nodes, node i of request t
    at flat index t * N + i.

    mask_bits [R, N, ceil(N / 32)] int32; seq_lens [R] int32 (prefix + N, 0 for a padded request);
    block_table [R, >= blocks per request] int32;
    query_rows [R * N] int64: batch row of each node (gather layout), or None: node t * N + i is batch
    row t * N + i and the kernel writes the output rows in place (uniform layout);
    write_nodes, write_rows [M] int64 (gather layout): the real nodes' flat indices and batch rows;
    query_workspace, out_workspace [R * N, Hq, D] (gather layout).
    """

    num_nodes: int
    mask_bits: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_rows: torch.Tensor | None = None
    write_nodes: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    query_workspace: torch.Tensor | None = None
    out_workspace: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return self.mask_bits.shape[0]

    @property
    def covers_batch(self) -> bool:
        """Uniform layout: every query row of the batch's requests is a tree node written here."""
        return self.query_rows is None

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor, scale: float) -> None:
        """Overwrite the tree nodes' rows of `output` [T, Hq, D] with tree attention of `query`
        [T, Hq, D] over the paged cache views key_cache / value_cache [blocks, block_size, Hkv, D]."""
        shape = (self.num_requests, self.num_nodes)
        if self.query_rows is None:
            flat = self.num_requests * self.num_nodes
            tree_attention(query[:flat].unflatten(0, shape), key_cache, value_cache, self.block_table, self.seq_lens,
                           self.mask_bits, scale, out=output[:flat].unflatten(0, shape))  # fmt: skip
            return
        assert self.query_workspace is not None and self.out_workspace is not None
        assert self.write_nodes is not None and self.write_rows is not None
        torch.index_select(query, 0, self.query_rows, out=self.query_workspace)
        tree_attention(self.query_workspace.unflatten(0, shape), key_cache, value_cache, self.block_table, self.seq_lens,
                       self.mask_bits, scale, out=self.out_workspace.unflatten(0, shape))  # fmt: skip
        output.index_copy_(0, self.write_rows, self.out_workspace.index_select(0, self.write_nodes))


class _Staged:
    """A device buffer with a pinned host twin: `put` writes host data into a leading block of both
    and copies it without blocking, returning the device view."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
        self.device = torch.zeros(shape, dtype=dtype, device=device)

    def put(self, values: torch.Tensor) -> torch.Tensor:
        block = tuple(slice(0, n) for n in values.shape)
        self.host[block] = values
        return self.device[block].copy_(self.host[block], non_blocking=True)


class TreeVerifyBuffers:
    """Persistent kernel inputs for up to `max_requests` requests of up to `max_nodes` nodes each.

    Device memory: the two gather workspaces, 2 x max_requests x max_nodes x Hq x D x dtype size, plus
    masks, lengths, block ids and indices (small). The block ids take the block table's width (fixed for
    an engine) at the first gather step, plus null-block columns for the padded nodes that reach up to
    max_nodes - 1 positions past a request's last token.
    """

    def __init__(
        self,
        max_requests: int,
        max_nodes: int,
        block_size: int,
        num_q_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.max_requests, self.max_nodes = max_requests, max_nodes
        words, rows = mask_words(max_nodes), max_requests * max_nodes
        self.mask_bits = _Staged((max_requests, max_nodes, words), torch.int32, device, pin_memory)
        self.seq_lens = _Staged((max_requests,), torch.int32, device, pin_memory)
        self.req_indices = _Staged((max_requests,), torch.int64, device, pin_memory)
        self.query_rows = _Staged((rows,), torch.int64, device, pin_memory)
        self.write_nodes = _Staged((rows,), torch.int64, device, pin_memory)
        self.write_rows = _Staged((rows,), torch.int64, device, pin_memory)
        self._overhang = -(-max_nodes // block_size)
        self.block_ids: torch.Tensor | None = None
        self.query_workspace = torch.zeros((rows, num_q_heads, head_size), dtype=dtype, device=device)
        self.out_workspace = torch.zeros_like(self.query_workspace)
        causal = torch.ones(max_nodes, max_nodes, dtype=torch.bool).tril().unsqueeze(0)
        self._causal_host = pack_tree_mask(causal)[0]
        self._causal = self._causal_host.to(device)

    def _block_ids(self, block_table: torch.Tensor) -> torch.Tensor:
        width = block_table.shape[1] + self._overhang
        if self.block_ids is None or self.block_ids.shape[1] < width:
            self.block_ids = torch.zeros((self.max_requests, width), dtype=torch.int32, device=block_table.device)
        return self.block_ids

    def uniform(self, seq_lens: torch.Tensor, block_table: torch.Tensor, num_nodes: int) -> TreeVerify:
        """Every request of the batch as a chain of `num_nodes` rows (causal masks, on the device): what
        a FULL CUDA graph of a uniform verify batch is captured with; the runner's masks replace the
        chains' for the branching trees of each step."""
        num_req = seq_lens.shape[0]
        words = mask_words(num_nodes)
        mask_bits = self.mask_bits.device[:num_req, :num_nodes, :words]
        mask_bits.copy_(self._causal[:num_nodes, :words].expand_as(mask_bits))
        return TreeVerify(num_nodes, mask_bits, seq_lens, block_table)

    def fill(self, rows: TreeRows, seq_lens: torch.Tensor, block_table: torch.Tensor, uniform: bool) -> TreeVerify:
        """This step's TreeVerify for the branching trees `rows` (host tensors); seq_lens [R_pad] and
        block_table [R_pad, blocks] are the batch's device tensors (vLLM's attention metadata).
        uniform: every request of the batch has exactly rows.valid.shape[1] query rows."""
        num_tree, num_nodes = rows.valid.shape
        if max(num_tree, seq_lens.shape[0] if uniform else 0) > self.max_requests or num_nodes > self.max_nodes:
            raise ValueError(f"tree-verify buffers hold {self.max_requests} requests x {self.max_nodes} nodes, "
                             f"got {seq_lens.shape[0] if uniform else num_tree} x {num_nodes}")  # fmt: skip
        words = mask_words(num_nodes)
        tree_bits = pack_tree_mask(rows.ancestor_mask)
        if uniform:
            num_req = seq_lens.shape[0]
            bits = self._causal_host[:num_nodes, :words].expand(num_req, num_nodes, words).clone()
            bits[rows.req_indices] = tree_bits
            return TreeVerify(num_nodes, self.mask_bits.put(bits), seq_lens, block_table)
        req_indices = self.req_indices.put(rows.req_indices)
        block_ids = self._block_ids(block_table)[:num_tree]
        block_ids[:, : block_table.shape[1]] = block_table.index_select(0, req_indices)
        query_rows = rows.node_rows.flatten()
        write_nodes = rows.valid.flatten().nonzero().squeeze(1)
        flat = num_tree * num_nodes
        return TreeVerify(
            num_nodes=num_nodes,
            mask_bits=self.mask_bits.put(tree_bits),
            seq_lens=self.seq_lens.put((rows.starts + num_nodes).to(torch.int32)),
            block_table=block_ids,
            query_rows=self.query_rows.put(query_rows),
            write_nodes=self.write_nodes.put(write_nodes),
            write_rows=self.write_rows.put(query_rows[write_nodes]),
            query_workspace=self.query_workspace[:flat],
            out_workspace=self.out_workspace[:flat],
        )


def is_uniform(query_start_loc: np.ndarray, num_nodes: int, num_padded_requests: int, num_padded_tokens: int) -> bool:
    """Whether a batch has the uniform layout: every real request (query_start_loc [R + 1], host) has
    exactly num_nodes query rows, and the batch's rows cover num_padded_requests x num_nodes."""
    return bool(np.all(np.diff(query_start_loc) == num_nodes)) and num_padded_tokens >= num_padded_requests * num_nodes
