"""Our TRITON_ATTN subclass on vLLM batches equals the torch reference, in Triton's CPU interpreter.

vLLM's own `TritonAttentionImpl.forward` runs first (on CPU, thanks to the "cpu" stand-in registered
before vLLM is imported), then the tree kernel overwrites the tree nodes' rows straight from the paged
cache. Checked on uniform verify batches (with a padded request of seq_len 0, as a FULL CUDA graph
pads), mixed batches (a prefill, chains and trees of different sizes: the gather layout, with padded
nodes reaching past the block table), both physical KV stride orders (NHD, HND), GQA and MHA. Rows
the tree layout does not cover stay bit-identical to vLLM's.

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one). By
hand: TRITON_INTERPRET=1 python -m pytest tests/gpu/test_triton_attention_interpreted.py
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in its own TRITON_INTERPRET=1 process (tests/test_interpreter_process.py)", allow_module_level=True)

from tests.gpu.triton_cpu_backend import register_cpu_backend_stand_in

register_cpu_backend_stand_in()

from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl  # noqa: E402

from vllm_ddtree.kernels.tree_attention_reference import tree_attention_reference  # noqa: E402
from vllm_ddtree.vllm.tree_step import TreeRows  # noqa: E402
from vllm_ddtree.vllm.v1.gpu_runner import DDTreeGPUModelRunner  # noqa: E402
from vllm_ddtree.vllm.tree_verify import TreeVerifyBuffers  # noqa: E402
from vllm_ddtree.vllm.triton_attention import DDTreeTritonAttentionImpl, DDTreeTritonAttentionMetadata  # noqa: E402

HEAD_SIZE, BLOCK_SIZE, SEGMENTS = 32, 16, 16
LAYER = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0), _q_scale=torch.tensor(1.0))


@dataclass(frozen=True)
class Request:
    """context: tokens before the query rows; parents: a verify request's tree (root -1; a chain is
    [-1, 0, 1, ...]), or None for a prefill of `rows` causal rows."""

    context: int
    parents: tuple[int, ...] | None = None
    rows: int = 0

    @property
    def query_len(self) -> int:
        return len(self.parents) if self.parents is not None else self.rows

    @property
    def branching(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def mask(self) -> torch.Tensor:
        """[q, q] ancestor-or-self mask of the tree, causal for prefills and chains."""
        q = self.query_len
        if self.parents is None:
            return torch.ones(q, q, dtype=torch.bool).tril()
        mask = torch.eye(q, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask


@dataclass
class Batch:
    requests: list[Request]
    query: torch.Tensor  # [T_pad, Hq, D]
    kv_cache: torch.Tensor  # logical [blocks, Hkv, block_size, 2D]
    block_table: torch.Tensor  # [R_pad, width] int32
    seq_lens: torch.Tensor  # [R_pad] int32, 0 for padded requests
    query_start_loc: torch.Tensor  # [R_pad + 1] int32

    @property
    def key_value_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.transpose(1, 2).split(HEAD_SIZE, -1)


def make_batch(requests: list[Request], num_kv_heads: int, group: int, layout: str, padded_requests: int = 0, seed: int = 0) -> Batch:
    """Random finite cache (every slot, so stale rows are real numbers), each request on distinct
    shuffled blocks (block 0 stays the null block), a block table exactly as wide as the longest
    request needs. Padded requests get seq_len 0, null blocks and N query rows each."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [r.context + r.query_len for r in requests]
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = max(blocks)
    ids = (torch.randperm(sum(blocks) + 2, generator=gen) + 1).tolist()
    num_req = len(requests) + padded_requests
    block_table = torch.zeros(num_req, width, dtype=torch.int32)
    for row, count in enumerate(blocks):
        block_table[row, :count] = torch.tensor([ids.pop() for _ in range(count)], dtype=torch.int32)
    num_blocks = sum(blocks) + 3
    physical = (num_blocks, BLOCK_SIZE, num_kv_heads, 2 * HEAD_SIZE) if layout == "NHD" else (num_blocks, num_kv_heads, BLOCK_SIZE, 2 * HEAD_SIZE)
    kv_cache = torch.randn(physical, generator=gen)
    kv_cache = kv_cache.transpose(1, 2) if layout == "NHD" else kv_cache
    lens = [r.query_len for r in requests] + [max(r.query_len for r in requests)] * padded_requests
    query = torch.randn(sum(lens), num_kv_heads * group, HEAD_SIZE, generator=gen)
    starts = np.concatenate([[0], np.cumsum([r.query_len for r in requests])]).tolist()
    starts += [starts[-1]] * padded_requests
    return Batch(
        requests=requests,
        query=query,
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens + [0] * padded_requests, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    )


def tree_rows(batch: Batch, width: int) -> TreeRows:
    """The branching requests' TreeRows, as `TreeStep.attention_rows` gives them (width N: the step's
    widest verify window; padded nodes repeat the root's row and see only themselves)."""
    picked = [i for i, r in enumerate(batch.requests) if r.branching]
    num_nodes = torch.tensor([batch.requests[i].query_len for i in picked])
    valid = torch.arange(width).unsqueeze(0) < num_nodes.unsqueeze(1)
    mask = torch.eye(width, dtype=torch.bool).repeat(len(picked), 1, 1)
    for t, i in enumerate(picked):
        n = batch.requests[i].query_len
        mask[t, :n, :n] = batch.requests[i].mask()
    first_rows = batch.query_start_loc[picked].long().unsqueeze(1)
    return TreeRows(
        req_indices=torch.tensor(picked),
        starts=torch.tensor([batch.requests[i].context for i in picked]),
        num_nodes=num_nodes,
        valid=valid,
        ancestor_mask=mask,
        node_rows=first_rows + torch.where(valid, torch.arange(width), 0),
    )


def metadata(batch: Batch, buffers: TreeVerifyBuffers | None) -> DDTreeTritonAttentionMetadata:
    num_q_heads = batch.query.shape[1]
    threshold = 8
    return DDTreeTritonAttentionMetadata(
        num_actual_tokens=batch.query.shape[0],
        max_query_len=max(r.query_len for r in batch.requests),
        query_start_loc=batch.query_start_loc,
        max_seq_len=int(batch.seq_lens.max()),
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=torch.zeros(batch.query.shape[0], dtype=torch.int64),
        seq_threshold_3D=threshold,
        num_par_softmax_segments=SEGMENTS,
        softmax_segm_output=torch.empty(threshold, num_q_heads, SEGMENTS, HEAD_SIZE),
        softmax_segm_max=torch.empty(threshold, num_q_heads, SEGMENTS),
        softmax_segm_expsum=torch.empty(threshold, num_q_heads, SEGMENTS),
        causal=True,
        tree_buffers=buffers,
    )


def make_buffers(num_q_heads: int, max_requests: int = 6, max_nodes: int = 6) -> TreeVerifyBuffers:
    return TreeVerifyBuffers(max_requests, max_nodes, BLOCK_SIZE, num_q_heads, HEAD_SIZE, torch.float32, torch.device("cpu"), pin_memory=False)


def reference(batch: Batch) -> torch.Tensor:
    """Every real row: tree rows with their ancestor masks, prefills and chains causal."""
    key_cache, value_cache = batch.key_value_caches
    out = torch.zeros_like(batch.query)
    scale = HEAD_SIZE**-0.5
    for i, request in enumerate(batch.requests):
        lo, hi = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        rows = tree_attention_reference(
            batch.query[lo:hi].unsqueeze(0), key_cache, value_cache, batch.block_table[i : i + 1],
            batch.seq_lens[i : i + 1], request.mask().unsqueeze(0), scale,
        )  # fmt: skip
        out[lo:hi] = rows[0]
    return out


def run(impl_cls: type[TritonAttentionImpl], batch: Batch, attn_metadata: DDTreeTritonAttentionMetadata) -> torch.Tensor:
    num_q_heads, num_kv_heads = batch.query.shape[1], batch.kv_cache.shape[1]
    impl = impl_cls(num_q_heads, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads, None, None, "auto")
    output = torch.full_like(batch.query, float("nan"))
    impl.forward(LAYER, batch.query, None, None, batch.kv_cache, attn_metadata, output)
    return output


def attach(batch: Batch, buffers: TreeVerifyBuffers) -> DDTreeTritonAttentionMetadata:
    """The GPU runner's `_attach_tree_attention` on this batch's metadata (shared by two layers, as
    vLLM shares one metadata object across an attention group; a hybrid target's GDN layer beside them
    is left to `gdn.attach_gdn_trees`)."""
    attn_metadata = metadata(batch, buffers)
    width = max(r.query_len for r in batch.requests if r.parents is not None)
    runner = SimpleNamespace(
        query_start_loc=SimpleNamespace(np=batch.query_start_loc.numpy()),
        input_batch=SimpleNamespace(num_reqs=len(batch.requests)),
    )
    layers = {"layers.0.attn": attn_metadata, "layers.1.attn": attn_metadata, "layers.2.linear_attn": GDNAttentionMetadata.__new__(GDNAttentionMetadata)}
    DDTreeGPUModelRunner._attach_tree_attention(runner, layers, tree_rows(batch, width))
    return attn_metadata


HEADS = pytest.mark.parametrize("num_kv_heads, group", [(2, 2), (2, 1)], ids=["gqa", "mha"])
LAYOUTS = pytest.mark.parametrize("layout", ["NHD", "HND"])
UNIFORM = [Request(0, (-1, 0, 0, 1, 2)), Request(7, (-1, 0, 1, 2, 3)), Request(21, (-1, 0, 0, 0, 3))]
MIXED = [
    Request(5, rows=9),  # a prefill chunk
    Request(18, (-1, 0, 0, 1, 1)),  # a full tree
    Request(3, (-1, 0, 1, 2, 3)),  # a chain: vLLM's causal rows are right
    Request(45, (-1, 0, 0)),  # 3 of 5 nodes: padded nodes reach past the block table's 3 blocks
]


def real_rows(batch: Batch) -> int:
    return int(batch.query_start_loc[len(batch.requests)])


@HEADS
@LAYOUTS
def test_uniform_verify_batch_with_a_padded_request_matches_the_reference(num_kv_heads: int, group: int, layout: str):
    batch = make_batch(UNIFORM, num_kv_heads, group, layout, padded_requests=1)
    attn_metadata = attach(batch, make_buffers(num_kv_heads * group))
    assert attn_metadata.tree is not None and attn_metadata.tree.covers_batch  # uniform layout, in place
    assert attn_metadata.tree.num_requests == 4 and attn_metadata.tree.seq_lens is attn_metadata.seq_lens
    with mock.patch.object(TritonAttentionImpl, "forward", side_effect=AssertionError("every row is the tree's")):
        output = run(DDTreeTritonAttentionImpl, batch, attn_metadata)
    n = real_rows(batch)
    torch.testing.assert_close(output[:n], reference(batch)[:n], atol=2e-5, rtol=1e-5)


@HEADS
@LAYOUTS
def test_mixed_batch_matches_the_reference_and_leaves_other_rows_to_vllm(num_kv_heads: int, group: int, layout: str):
    batch = make_batch(MIXED, num_kv_heads, group, layout)
    attn_metadata = attach(batch, make_buffers(num_kv_heads * group))
    tree = attn_metadata.tree
    assert tree is not None and not tree.covers_batch  # gather layout
    assert tree.block_table.shape[1] > batch.block_table.shape[1]  # null-block columns for padded nodes
    output = run(DDTreeTritonAttentionImpl, batch, attn_metadata)
    torch.testing.assert_close(output, reference(batch), atol=2e-5, rtol=1e-5)
    vllm_only = run(TritonAttentionImpl, batch, metadata(batch, None))
    untouched = torch.ones(output.shape[0], dtype=torch.bool)
    untouched[tree.write_rows] = False
    assert untouched.sum() == 9 + 5 and torch.equal(output[untouched], vllm_only[untouched])
    assert not torch.allclose(output[~untouched], vllm_only[~untouched])  # the masks mattered


def test_metadata_without_a_tree_is_exactly_vllms_triton_attention():
    batch = make_batch(MIXED, 2, 2, "HND")
    plain = metadata(batch, make_buffers(4))
    assert torch.equal(run(DDTreeTritonAttentionImpl, batch, plain), run(TritonAttentionImpl, batch, plain))


def test_a_uniform_capture_tree_replays_the_masks_filled_later():
    """The capture path's tree (causal masks over the persistent buffers) reads what `fill` writes there
    next: running the captured record after a fill gives the filled trees' result."""
    batch = make_batch(UNIFORM, 2, 2, "NHD", padded_requests=1)
    buffers = make_buffers(4)
    captured = metadata(batch, buffers)
    captured.tree = buffers.uniform(captured.seq_lens, captured.block_table, 5)
    chains = run(DDTreeTritonAttentionImpl, batch, captured)
    n = real_rows(batch)
    chain_batch = [Request(r.context, (-1, 0, 1, 2, 3)) for r in UNIFORM]
    torch.testing.assert_close(chains[:n], reference(make_batch(chain_batch, 2, 2, "NHD", 1))[:n], atol=2e-5, rtol=1e-5)
    attach(batch, buffers)  # this step's trees, into the same buffers
    replayed = run(DDTreeTritonAttentionImpl, batch, captured)
    torch.testing.assert_close(replayed[:n], reference(batch)[:n], atol=2e-5, rtol=1e-5)

