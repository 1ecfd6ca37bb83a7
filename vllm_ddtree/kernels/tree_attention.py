"""Triton tree-verify attention over vLLM's paged KV cache (GPU backends TRITON_ATTN / FLASH_ATTN).

Problem. Request r verifies N tree nodes (root + budget nodes, padded nodes included) whose K/V are
already in the cache at positions P_r .. P_r + N - 1, where P_r = seq_lens[r] - N is its committed
prefix. Query node i attends to every prefix position and to tree node j iff bit j of its ancestor mask
is set (`vllm_ddtree.kernels.tree_mask`). Output = softmax(scale * q k^T) v with the online softmax
in float32; inputs bf16 / fp16 / fp32.

Cache layout. vLLM 0.32 hands each layer's cache to TRITON_ATTN / FLASH_ATTN as a logical
[num_blocks, num_kv_heads, block_size, 2 * head_size] tensor (physical strides NHD or HND) and both
backends take `kv_cache.transpose(1, 2).split(head_size, -1)`: key_cache and value_cache are
[num_blocks, block_size, num_kv_heads, head_size] strided views. This kernel reads exactly those
views through their strides (head dim contiguous), so no copy or layout assumption is needed.

Tiling. One program owns (request r, kv head h, split s, row tile t). The query rows of a kv group
are flattened node-major, row f = node * GROUP + g for q head h * GROUP + g, so a tile of BLOCK_M rows
holds BLOCK_M / GROUP nodes x all GROUP heads and every tl.dot is [BLOCK_M, D] x [D, BLOCK_KV]:
with 65 nodes x 4 heads the work is compute-bound and runs on tensor cores. Rows rarely divide into
powers of two (65 x 4 = 260), so the last program of a (r, h) also carries a small TAIL_M-row group
(260 = 2 x 128 + 4 -> tail of 16) that reuses the K/V tiles it already loaded: 272 padded rows
instead of 384, and no extra pass over the cache. The programs of one (r, h) are adjacent in launch
order, so their shared K/V stream should come from L2 after the first read.

Split-K. When R * num_kv_heads * tiles cannot fill the GPU (batch 1), the prefix is cut into
num_splits chunks handled by different programs; each writes a normalised partial output and its
log-sum-exp, and `_merge_splits_kernel` combines them. The tree keys go to the last split.

CUDA graphs. The grid and every constexpr depend only on static shapes (R, N, heads, head size,
block size, max blocks per request) and the device's SM count; lengths, block tables and masks are
read on the device and nothing syncs with the host. A decode batch of R tree requests has R * N =
R * (budget + 1) query tokens, so vLLM's cudagraph capture sizes for a fixed budget are multiples of
budget + 1 (see docs/scaling.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from vllm_ddtree.kernels.tree_mask import mask_words

NEG_INF = tl.constexpr(float("-inf"))
ROW_INIT_MAX = tl.constexpr(-1.0e30)
"""Finite start for the running max: a row whose keys are all masked so far keeps exp2(-inf - m) = 0
and alpha = 1 instead of NaN."""
LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(
    cache_ptr, block_table_row_ptr, positions, valid, head, stride_b, stride_s, stride_h,
    KV_BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BOUNDS_CHECK: tl.constexpr,
):  # fmt: skip
    """[BLOCK_KV, HEAD_PAD] cache rows of one kv head at token `positions` (through the block table).
    With BOUNDS_CHECK, positions where `valid` is False read as 0; without it all must be valid."""
    offs_d = tl.arange(0, HEAD_PAD)
    if BOUNDS_CHECK:
        block = tl.load(block_table_row_ptr + positions // KV_BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(block_table_row_ptr + positions // KV_BLOCK_SIZE).to(tl.int64)
    ptrs = cache_ptr + (block * stride_b + (positions % KV_BLOCK_SIZE) * stride_s + head * stride_h)[:, None] + offs_d[None, :]
    if BOUNDS_CHECK:
        tile = tl.load(ptrs, mask=valid[:, None] & (offs_d < HEAD_SIZE)[None, :], other=0.0)
    elif HEAD_PAD != HEAD_SIZE:
        tile = tl.load(ptrs, mask=(offs_d < HEAD_SIZE)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, scale_log2e, APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of flash attention for a row group: q [M, D], k and v [BLOCK_KV, D]; scores in
    log2 units, running max m_i, running denominator l_i, unnormalised accumulator acc [M, D] (fp32).
    With APPLY_MASK, scores where `allowed` is False are dropped (full prefix tiles skip that)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    if APPLY_MASK:
        s = tl.where(allowed, s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tree_bits(mask_row_ptr, nodes, row_valid, keys, key_valid, stride_mask_n):
    """[M, BLOCK_KV] bool: bit `keys` of the ancestor mask of `nodes` (see tree_mask.py)."""
    word = tl.load(
        mask_row_ptr + nodes[:, None] * stride_mask_n + (keys // 32)[None, :],
        mask=row_valid[:, None] & key_valid[None, :],
        other=0,
    )
    return ((word >> (keys % 32)[None, :]) & 1) != 0


@triton.jit
def _store_rows(
    acc,
    m_i,
    l_i,
    rows,
    row_valid,
    request,
    kv_head,
    split,
    out_ptr,
    o_part_ptr,
    lse_part_ptr,
    offs_d,
    d_valid,
    stride_o_r,
    stride_o_n,
    stride_o_h,
    NUM_NODES: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    num_splits,
    SPLIT_OUTPUT: tl.constexpr,
):
    """Write a row group: the final output, or with SPLIT_OUTPUT its normalised partial output and
    log2-sum-exp into the [R, N, Hq, num_splits] workspace."""
    nodes = rows // GROUP
    q_heads = kv_head * GROUP + rows % GROUP
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if not SPLIT_OUTPUT:
        ptrs = out_ptr + request * stride_o_r + nodes[:, None] * stride_o_n + q_heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = ((request * NUM_NODES + nodes) * NUM_Q_HEADS + q_heads) * num_splits + split
        tl.store(o_part_ptr + part[:, None].to(tl.int64) * HEAD_SIZE + offs_d[None, :], o, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), NEG_INF)
        tl.store(lse_part_ptr + part, lse, mask=row_valid)


@triton.jit
def _load_query_rows(q_ptr, request, kv_head, rows, row_valid, offs_d, d_valid, stride_q_r, stride_q_n, stride_q_h, GROUP: tl.constexpr):
    """[M, D] queries of flattened rows (row = node * GROUP + g -> node, q head kv_head * GROUP + g)."""
    nodes = rows // GROUP
    q_heads = kv_head * GROUP + rows % GROUP
    ptrs = q_ptr + request * stride_q_r + nodes[:, None] * stride_q_n + q_heads[:, None] * stride_q_h + offs_d[None, :]
    return tl.load(ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)


@triton.jit
def _attend(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    mask_bits_ptr,
    o_part_ptr,
    lse_part_ptr,
    scale_log2e,
    request,
    kv_head,
    split,
    row_start,
    stride_q_r,
    stride_q_n,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_o_r,
    stride_o_n,
    stride_o_h,
    stride_bt_r,
    stride_mask_r,
    stride_mask_n,
    NUM_NODES: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TAIL_M: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    num_splits,
    SPLIT_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Rows row_start .. row_start + BLOCK_M - 1 (and, if TAIL_M > 0, the TAIL_M rows after them)
    of one (request, kv head) over this split's share of the keys."""
    num_rows = NUM_NODES * GROUP
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    block_table_row_ptr = block_table_ptr + request * stride_bt_r
    mask_row_ptr = mask_bits_ptr + request * stride_mask_r

    rows_a = row_start + tl.arange(0, BLOCK_M)
    valid_a = rows_a < num_rows
    q_a = _load_query_rows(q_ptr, request, kv_head, rows_a, valid_a, offs_d, d_valid, stride_q_r, stride_q_n, stride_q_h, GROUP)
    m_a = tl.full([BLOCK_M], ROW_INIT_MAX, tl.float32)
    l_a = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    if TAIL_M > 0:
        rows_b = row_start + BLOCK_M + tl.arange(0, TAIL_M)
        valid_b = rows_b < num_rows
        q_b = _load_query_rows(q_ptr, request, kv_head, rows_b, valid_b, offs_d, d_valid, stride_q_r, stride_q_n, stride_q_h, GROUP)
        m_b = tl.full([TAIL_M], ROW_INIT_MAX, tl.float32)
        l_b = tl.zeros([TAIL_M], tl.float32)
        acc_b = tl.zeros([TAIL_M, HEAD_PAD], tl.float32)

    # Prefix keys: every row sees every position; this split owns [lo, hi): full tiles without masks,
    # then the partial last tile.
    prefix_len = tl.maximum(tl.load(seq_lens_ptr + request) - NUM_NODES, 0)
    chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_KV) * BLOCK_KV
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    span = tl.maximum(hi - lo, 0)
    full_hi = lo + span - span % BLOCK_KV
    for kv_start in range(lo, full_hi, BLOCK_KV):
        positions = kv_start + tl.arange(0, BLOCK_KV)
        k = _load_kv_tile(k_cache_ptr, block_table_row_ptr, positions, None, kv_head, stride_k_b, stride_k_s, stride_k_h, KV_BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, False)
        v = _load_kv_tile(v_cache_ptr, block_table_row_ptr, positions, None, kv_head, stride_v_b, stride_v_s, stride_v_h, KV_BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, False)
        m_a, l_a, acc_a = _online_softmax_step(q_a, k, v, None, m_a, l_a, acc_a, scale_log2e, False, DOT_PRECISION)
        if TAIL_M > 0:
            m_b, l_b, acc_b = _online_softmax_step(q_b, k, v, None, m_b, l_b, acc_b, scale_log2e, False, DOT_PRECISION)
    if full_hi < hi:
        positions = full_hi + tl.arange(0, BLOCK_KV)
        key_valid = positions < hi
        k = _load_kv_tile(k_cache_ptr, block_table_row_ptr, positions, key_valid, kv_head, stride_k_b, stride_k_s, stride_k_h, KV_BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, True)
        v = _load_kv_tile(v_cache_ptr, block_table_row_ptr, positions, key_valid, kv_head, stride_v_b, stride_v_s, stride_v_h, KV_BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, True)
        m_a, l_a, acc_a = _online_softmax_step(q_a, k, v, key_valid[None, :], m_a, l_a, acc_a, scale_log2e, True, DOT_PRECISION)
        if TAIL_M > 0:
            m_b, l_b, acc_b = _online_softmax_step(q_b, k, v, key_valid[None, :], m_b, l_b, acc_b, scale_log2e, True, DOT_PRECISION)

    # Tree keys (last split only): node j at position prefix_len + j, visible iff its mask bit is set.
    if split == num_splits - 1:
        for tree_start in range(0, NUM_NODES, BLOCK_KV):
            keys = tree_start + tl.arange(0, BLOCK_KV)
            key_valid = keys < NUM_NODES
            positions = prefix_len + keys
            k = _load_kv_tile(k_cache_ptr, block_table_row_ptr, positions, key_valid, kv_head, stride_k_b, stride_k_s, stride_k_h, KV_BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, True)
            v = _load_kv_tile(v_cache_ptr, block_table_row_ptr, positions, key_valid, kv_head, stride_v_b, stride_v_s, stride_v_h, KV_BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, True)
            allowed_a = _tree_bits(mask_row_ptr, rows_a // GROUP, valid_a, keys, key_valid, stride_mask_n)
            m_a, l_a, acc_a = _online_softmax_step(q_a, k, v, allowed_a, m_a, l_a, acc_a, scale_log2e, True, DOT_PRECISION)
            if TAIL_M > 0:
                allowed_b = _tree_bits(mask_row_ptr, rows_b // GROUP, valid_b, keys, key_valid, stride_mask_n)
                m_b, l_b, acc_b = _online_softmax_step(q_b, k, v, allowed_b, m_b, l_b, acc_b, scale_log2e, True, DOT_PRECISION)

    _store_rows(acc_a, m_a, l_a, rows_a, valid_a, request, kv_head, split, out_ptr, o_part_ptr, lse_part_ptr, offs_d, d_valid,
                stride_o_r, stride_o_n, stride_o_h, NUM_NODES, GROUP, NUM_Q_HEADS, HEAD_SIZE, num_splits, SPLIT_OUTPUT)  # fmt: skip
    if TAIL_M > 0:
        _store_rows(acc_b, m_b, l_b, rows_b, valid_b, request, kv_head, split, out_ptr, o_part_ptr, lse_part_ptr, offs_d, d_valid,
                    stride_o_r, stride_o_n, stride_o_h, NUM_NODES, GROUP, NUM_Q_HEADS, HEAD_SIZE, num_splits, SPLIT_OUTPUT)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _tree_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    mask_bits_ptr,
    o_part_ptr,
    lse_part_ptr,
    scale_log2e,
    stride_q_r,
    stride_q_n,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_o_r,
    stride_o_n,
    stride_o_h,
    stride_bt_r,
    stride_mask_r,
    stride_mask_n,
    num_splits,
    NUM_NODES: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_TILES: tl.constexpr,
    TAIL_M: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    SPLIT_OUTPUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (NUM_TILES, num_splits, R * NUM_KV_HEADS); tile varies fastest so that the programs
    sharing one (request, kv head, split) key stream run side by side."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    request = tl.program_id(2) // NUM_KV_HEADS
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    # Same body twice: the last tile's instance carries the TAIL_M extra rows (a constexpr).
    if tile == NUM_TILES - 1:
        _attend(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, mask_bits_ptr, o_part_ptr, lse_part_ptr,
                scale_log2e, request, kv_head, split, tile * BLOCK_M, stride_q_r, stride_q_n, stride_q_h,
                stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_o_r, stride_o_n, stride_o_h,
                stride_bt_r, stride_mask_r, stride_mask_n, NUM_NODES, GROUP, NUM_KV_HEADS * GROUP, HEAD_SIZE, HEAD_PAD,
                KV_BLOCK_SIZE, BLOCK_M, TAIL_M, BLOCK_KV, num_splits, SPLIT_OUTPUT, DOT_PRECISION)  # fmt: skip
    else:
        _attend(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, mask_bits_ptr, o_part_ptr, lse_part_ptr,
                scale_log2e, request, kv_head, split, tile * BLOCK_M, stride_q_r, stride_q_n, stride_q_h,
                stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h, stride_o_r, stride_o_n, stride_o_h,
                stride_bt_r, stride_mask_r, stride_mask_n, NUM_NODES, GROUP, NUM_KV_HEADS * GROUP, HEAD_SIZE, HEAD_PAD,
                KV_BLOCK_SIZE, BLOCK_M, 0, BLOCK_KV, num_splits, SPLIT_OUTPUT, DOT_PRECISION)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    stride_o_r,
    stride_o_n,
    stride_o_h,
    num_splits,
    NUM_NODES: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (request, node, q head): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse)."""
    row = tl.program_id(0)
    request = row // (NUM_NODES * NUM_Q_HEADS)
    node = (row // NUM_Q_HEADS) % NUM_NODES
    q_head = row % NUM_Q_HEADS
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_valid = offs_s < num_splits
    d_valid = offs_d < HEAD_SIZE
    lse = tl.load(lse_part_ptr + row * num_splits + offs_s, mask=s_valid, other=NEG_INF)
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = (row * num_splits + offs_s).to(tl.int64)
    o = tl.load(o_part_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :], mask=s_valid[:, None] & d_valid[None, :], other=0.0)
    merged = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    ptrs = out_ptr + request * stride_o_r + node * stride_o_n + q_head * stride_o_h + offs_d
    tl.store(ptrs, merged.to(out_ptr.dtype.element_ty), mask=d_valid)


@dataclass(frozen=True)
class TreeAttentionConfig:
    """Launch tuning. block_m: query rows ((node, q head) pairs of one kv group) per tile;
    block_kv: keys per inner step; num_splits: prefix partitions (None: fill the GPU)."""

    block_m: int
    block_kv: int
    num_warps: int
    num_stages: int
    num_splits: int | None = None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_row_tiles(num_rows: int, block_m: int) -> tuple[int, int, int]:
    """(block_m, num_tiles, tail_m) covering num_rows flattened query rows.

    Full tiles of block_m rows; a remainder of at most block_m / 4 rows (rounded up to a power of two,
    at least 16 for tl.dot) rides on the last tile as its tail, a larger one gets its own tile. Fewer
    rows than block_m shrink the tile to the next power of two instead.
    """
    if num_rows <= block_m:
        return max(16, _next_pow2(num_rows)), 1, 0
    num_tiles, remainder = divmod(num_rows, block_m)
    if remainder == 0:
        return block_m, num_tiles, 0
    tail_m = max(16, _next_pow2(remainder))
    if tail_m <= block_m // 4:
        return block_m, num_tiles, tail_m
    return block_m, num_tiles + 1, 0


def default_config(num_nodes: int, group: int, head_size: int, dtype: torch.dtype) -> TreeAttentionConfig:
    """Launch tuning from static shapes, checked for spills with ptxas for sm_90a (see
    tests/kernels/test_tree_attention_compiles.py); GPU timings in benchmarks/gpu_check.py.

    bf16/fp16 with D <= 128: the row tile (128 or 64) with the least padding, ties to 128 (fewer
    re-reads of K/V), 8 warps for 128 rows; 64-key steps, 3 stages. D > 128 or fp32 (exact "ieee"
    dot, a correctness path without tensor cores): 64 rows, 32-key steps, 8 warps, 2 stages.
    """
    if dtype == torch.float32 or head_size > 128:
        return TreeAttentionConfig(block_m=64, block_kv=32, num_warps=8, num_stages=2)
    num_rows = num_nodes * group

    def padded_rows(block_m: int) -> int:
        tile, tiles, tail = plan_row_tiles(num_rows, block_m)
        return tile * tiles + tail

    block_m = min((128, 64), key=padded_rows)
    tile, _, _ = plan_row_tiles(num_rows, block_m)
    return TreeAttentionConfig(block_m=block_m, block_kv=64, num_warps=8 if tile >= 128 else 4, num_stages=3)


def kernel_constants(
    num_nodes: int, num_kv_heads: int, group: int, head_size: int, kv_block_size: int, dtype: torch.dtype, config: TreeAttentionConfig, split_output: bool
) -> dict[str, int | bool | str]:
    """The constexpr arguments of `_tree_attention_kernel` for these static shapes."""
    block_m, num_tiles, tail_m = plan_row_tiles(num_nodes * group, config.block_m)
    return {
        "NUM_NODES": num_nodes,
        "NUM_KV_HEADS": num_kv_heads,
        "GROUP": group,
        "HEAD_SIZE": head_size,
        "HEAD_PAD": _next_pow2(head_size),
        "KV_BLOCK_SIZE": kv_block_size,
        "BLOCK_M": block_m,
        "NUM_TILES": num_tiles,
        "TAIL_M": tail_m,
        "BLOCK_KV": config.block_kv,
        "SPLIT_OUTPUT": split_output,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def default_num_splits(base_programs: int, max_context: int, device: torch.device, min_chunk: int = 256) -> int:
    """Prefix partitions so that the programs cover every SM at least once, keeping chunks of at
    least min_chunk tokens of the (static) maximum context. 1 on CPU. Static inputs only."""
    wanted = math.ceil(_num_sms(device) / max(base_programs, 1))
    return max(1, min(wanted, max_context // min_chunk))


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    mask_bits: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: TreeAttentionConfig | None = None,
) -> torch.Tensor:
    """Tree-verify attention over a paged KV cache (module docstring has the model).

    Args:
        query: [R, N, Hq, D] the N tree nodes per request (root first, padded nodes included); any
            strides with the last dim contiguous (a view of vLLM's [num_tokens, Hq, D] works).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] strided views, last dim contiguous;
            Hq % Hkv == 0. The tree's K/V are already written at positions seq_lens - N .. seq_lens - 1.
        block_table: [R, max_blocks] int32/int64 physical block ids, last dim contiguous.
        seq_lens: [R] int32 tokens in the cache per request including its N tree nodes (>= N;
            a smaller value is treated as an empty prefix).
        mask_bits: [R, N, ceil(N / 32)] int32 packed ancestor masks (`pack_tree_mask`); the
            diagonal must be set.
        scale: softmax scale.
        out: optional [R, N, Hq, D] output (last dim contiguous); allocated if None.
        config: launch tuning; `default_config` if None.

    Returns:
        out, [R, N, Hq, D] in query.dtype. The launch depends on shapes only: CUDA-graph capturable.
    """
    num_req, num_nodes, num_q_heads, head_size = query.shape
    _, kv_block_size, num_kv_heads, _ = key_cache.shape
    if num_q_heads % num_kv_heads or key_cache.shape != value_cache.shape or key_cache.shape[3] != head_size:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, key_cache {tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}")
    if mask_bits.shape != (num_req, num_nodes, mask_words(num_nodes)) or mask_bits.dtype != torch.int32:
        raise ValueError(f"mask_bits must be int32 [{num_req}, {num_nodes}, {mask_words(num_nodes)}], got {mask_bits.dtype} {tuple(mask_bits.shape)}")
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("block_table", block_table), ("mask_bits", mask_bits)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if out is None:
        out = torch.empty_like(query)
    group = num_q_heads // num_kv_heads
    config = config or default_config(num_nodes, group, head_size, query.dtype)
    _, num_tiles, _ = plan_row_tiles(num_nodes * group, config.block_m)
    base_programs = num_tiles * num_req * num_kv_heads
    num_splits = config.num_splits or default_num_splits(base_programs, block_table.shape[1] * kv_block_size, query.device)
    if num_splits > 1:
        o_part = torch.empty((num_req, num_nodes, num_q_heads, num_splits, head_size), dtype=torch.float32, device=query.device)
        lse_part = torch.empty((num_req, num_nodes, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        o_part = lse_part = out  # unused without SPLIT_OUTPUT
    constants = kernel_constants(num_nodes, num_kv_heads, group, head_size, kv_block_size, query.dtype, config, num_splits > 1)
    _tree_attention_kernel[(num_tiles, num_splits, num_req * num_kv_heads)](
        query, key_cache, value_cache, out, block_table, seq_lens, mask_bits, o_part, lse_part,
        scale * LOG2E, *query.stride()[:3], *key_cache.stride()[:3], *value_cache.stride()[:3], *out.stride()[:3],
        block_table.stride(0), mask_bits.stride(0), mask_bits.stride(1), num_splits,
        **constants, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_req * num_nodes * num_q_heads,)](
            o_part, lse_part, out, *out.stride()[:3], num_splits,
            NUM_NODES=num_nodes, NUM_Q_HEADS=num_q_heads, HEAD_SIZE=head_size, HEAD_PAD=constants["HEAD_PAD"],
            SPLITS_PAD=max(2, _next_pow2(num_splits)), num_warps=4,
        )  # fmt: skip
    return out
