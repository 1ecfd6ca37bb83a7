"""The tree-verify rows' attention on CPU in one compiled call per layer (numba, like `host_tree`).

What it computes is `attention.tree_attention`'s: node i of branching request t attends to its
request's committed prefix (positions 0 .. start - 1) and to the nodes j its row of the ancestor mask
admits (itself included), whose K/V sit at positions start + j; all of them are read in place from the
paged cache through the request's block table. Why compiled: at batch 1 the torch formulation is some
forty small tensor operations per layer, each costing its dispatch, which puts it several times above
vLLM's own kernel on as many chain rows; compiled, it costs about what vLLM's does
(`benchmarks/tree_attention_cpu.py` times the three).

How: per (request, KV head), the group's query rows (scaled) are copied once; then block by block of
the window: logits = q k^T and p v as BLAS products (numba's np.dot, scipy's BLAS: a block's keys as
[head_size, tokens] and values as [tokens, head_size] float32 matrices, see below), the tree
mask on the positions past the prefix, and an online softmax (running maximum and sum per row, rescaled
accumulator), so the window is read once whatever its length. exp is computed inline (2^e times a
degree-7 polynomial on |y| <= ln(2) / 2; within 1 ulp of float32, masked and underflowing terms exactly
0) so that the compiler vectorizes it. The rows of padded nodes (i >= num_nodes) are not written.

A block's keys and values are read in place when the cache is float32 in vLLM's "vec" layouts
(`in_place`); otherwise (bfloat16, or another layout: "amx", vLLM's choice for bfloat16 where the CPU
has AMX tiles, packs token pairs) they are gathered into float32 scratch through the layout's offset
tables (`paged_kv.probe_layout`), the window's positions only; widening bfloat16 is exact, so a
gathered block holds the same values in every layout.

Taken when the kernel compiled (`available`: numba's np.dot needs scipy) and query, cache and output
are all float32 or all bfloat16; otherwise the caller runs the torch formulation.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from numba import types
from numba.extending import overload

from vllm_ddtree.vllm import host_tree
from vllm_ddtree.vllm.paged_kv import RegionLayout

logger = logging.getLogger("vllm.ddtree")

_FASTMATH = {"contract", "reassoc"}
"""Fused multiply-adds and reordered sums and maxima (vectorized reductions); no finite-math
assumptions: masked logits are -inf."""


def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`host_tree._compiled` with `_FASTMATH`."""
    return host_tree._compiled(function, fastmath=_FASTMATH)


_compiled_ok: bool | None = None


def available() -> bool:
    """Whether the kernel compiled (once per process, `warm_up`); if not, the reason is logged once."""
    if _compiled_ok is None:
        warm_up()
    return bool(_compiled_ok)


def in_place(layout: RegionLayout) -> bool:
    """The keys of a (block, kv head) region are [head_size, block_size] and its values [block_size,
    head_size], both row-major (vLLM's "vec" CPU layouts): float32 blocks are read without a copy."""
    block_size, head_size = layout.key_offsets.shape
    keys, values = layout.key_strides, layout.value_strides
    return keys is not None and values is not None and keys[1:] == (1, block_size) and values[1:] == (head_size, 1)


def vec_layout(block_size: int, head_size: int) -> RegionLayout:
    """vLLM's "vec" region layout (keys [head_size, block_size] then values [block_size, head_size],
    row-major), as `paged_kv.probe_layout` reads it: for compiling and testing without a cache."""
    keys = torch.arange(head_size * block_size).view(head_size, block_size).t()
    return RegionLayout(keys, head_size * block_size + torch.arange(block_size * head_size).view(block_size, head_size))


class LayerCache(NamedTuple):
    """One layer's CPU_ATTN cache as the kernel reads it (`layer_cache`): regions [num_blocks,
    num_kv_heads, 2 * block_size * head_size] (bfloat16 as its bits); key_index [head_size, block_size]
    and value_index [block_size, head_size] (int32): where element (dim d, token t) of a block's keys and
    (token t, dim d) of its values sit in its region; whether float32 blocks are read in place
    (`in_place`); the block size. Built once per layer: the cache and its layout never change."""

    regions: np.ndarray
    key_index: np.ndarray
    value_index: np.ndarray
    read_in_place: bool
    block_size: int


def layer_cache(kv_cache: torch.Tensor, layout: RegionLayout) -> LayerCache:
    """kv_cache: one layer's cache [num_blocks, num_kv_heads, block_size, 2 * head_size], contiguous, in
    the layout `layout` describes (any of vLLM's CPU layouts), float32 or bfloat16."""
    num_blocks, num_kv_heads = kv_cache.shape[:2]
    regions = _host(kv_cache.view(num_blocks, num_kv_heads, -1))
    key_index = np.ascontiguousarray(layout.key_offsets.t().numpy(), dtype=np.int32)
    value_index = np.ascontiguousarray(layout.value_offsets.numpy(), dtype=np.int32)
    read_in_place = kv_cache.dtype == torch.float32 and in_place(layout)
    return LayerCache(regions, key_index, value_index, read_in_place, layout.block_size)


def attend_tree_rows(
    output: torch.Tensor,
    query: torch.Tensor,
    cache: LayerCache,
    block_table: np.ndarray,
    req_indices: np.ndarray,
    starts: np.ndarray,
    num_nodes: np.ndarray,
    ancestor_mask: np.ndarray,
    node_rows: np.ndarray,
    scale: float,
) -> None:
    """Overwrite output[node_rows[t, i]] ([rows, num_heads, head_size], contiguous) with the tree
    attention of node i < num_nodes[t] of every request t. query [rows, num_heads, head_size] (query head
    h reads KV head h // (num_heads / num_kv_heads)); cache: one layer's (`layer_cache`); all three of one
    dtype, float32 or bfloat16 (`DTYPES`; computed in float32, bfloat16 outputs rounded to nearest even);
    block_table [num_reqs, max blocks] int32; req_indices, starts, num_nodes [T] int64; ancestor_mask
    [T, N, N] bool; node_rows [T, N] int64 (host arrays, shared by every layer of a step)."""
    _tree_attention(_host(query), *cache, block_table, req_indices, starts, num_nodes, ancestor_mask, node_rows, scale, _host(output))


DTYPES = (torch.float32, torch.bfloat16)
"""What the kernel reads and writes: float32, and bfloat16 as its bits (numpy has no bfloat16)."""


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy() if tensor.dtype == torch.float32 else tensor.view(torch.uint16).numpy()


def _gather(region: np.ndarray, index: np.ndarray, tokens: int, token_axis: int, scratch: np.ndarray) -> np.ndarray:
    """region[index] as float32 (region float32, or bfloat16 bits: uint16) for the first `tokens`
    positions along token_axis (0 or 1) of index: [tokens, index.shape[1]] or [index.shape[0], tokens],
    a row-major view of the flat float32 scratch (at least index.size long)."""
    raise NotImplementedError("compiled only")


@overload(_gather, jit_options={"fastmath": _FASTMATH})
def _gather_compiled(region, index, tokens, token_axis, scratch):  # (unannotated: numba matches its signature to the implementations')
    if region.dtype == types.float32:
        def copy(region, index, tokens, token_axis, scratch):
            outer, inner = (index.shape[0], tokens) if token_axis == 1 else (tokens, index.shape[1])
            out = scratch[: outer * inner].reshape((outer, inner))
            for i in range(outer):
                positions, row = index[i], out[i]
                for j in range(inner):
                    row[j] = region[positions[j]]
            return out

        return copy

    def widen(region, index, tokens, token_axis, scratch):
        outer, inner = (index.shape[0], tokens) if token_axis == 1 else (tokens, index.shape[1])
        out = scratch[: outer * inner].reshape((outer, inner))
        bits = out.view(np.uint32)
        for i in range(outer):
            positions, row = index[i], bits[i]
            for j in range(inner):
                row[j] = np.uint32(region[positions[j]]) << np.uint32(16)
        return out

    return widen


def _as_float32(values: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """values (float32, or bfloat16 bits: uint16) as float32: values themselves, or widened into scratch
    (float32, as large) and returned from it."""
    raise NotImplementedError("compiled only")


@overload(_as_float32, jit_options={"fastmath": _FASTMATH})
def _as_float32_compiled(values, scratch):  # (unannotated, as `_gather_compiled`)
    if values.dtype == types.float32:
        return lambda values, scratch: values

    def widen(values, scratch):
        flat, bits = values.ravel(), scratch.ravel().view(np.uint32)
        for i in range(flat.size):
            bits[i] = np.uint32(flat[i]) << np.uint32(16)
        return scratch

    return widen


def _block(region: np.ndarray, index: np.ndarray, tokens: int, token_axis: int, read_in_place: bool,
           scratch: np.ndarray) -> np.ndarray:
    """One block's keys (token_axis 1) or values (token_axis 0) as float32: the whole block (index's
    shape), a view of a float32 region, when read_in_place (index is then one affine row-major range),
    else its first `tokens` positions (`_gather`), so that no product spans positions past the window."""
    raise NotImplementedError("compiled only")


@overload(_block, jit_options={"fastmath": _FASTMATH})
def _block_compiled(region, index, tokens, token_axis, read_in_place, scratch):  # (unannotated, as `_gather_compiled`)
    if region.dtype == types.float32:
        def block(region, index, tokens, token_axis, read_in_place, scratch):
            if read_in_place:
                base = index[0, 0]
                return region[base : base + index.size].reshape(index.shape)
            return _gather(region, index, tokens, token_axis, scratch)

        return block
    return lambda region, index, tokens, token_axis, read_in_place, scratch: _gather(region, index, tokens, token_axis, scratch)


def _store(target: np.ndarray, values: np.ndarray, factor: float) -> None:
    """target[:] = values * factor (float32 values; target float32, or bfloat16 bits rounded to nearest
    even)."""
    raise NotImplementedError("compiled only")


@overload(_store, jit_options={"fastmath": _FASTMATH})
def _store_compiled(target, values, factor):  # (unannotated, as `_as_float32_compiled`)
    if target.dtype == types.float32:
        def store(target, values, factor):
            for d in range(target.size):
                target[d] = values[d] * factor

        return store

    def round_to_bfloat16(target, values, factor):
        scaled = values * factor
        bits = scaled.view(np.uint32)
        for d in range(target.size):
            target[d] = np.uint16((bits[d] + np.uint32(0x7FFF) + ((bits[d] >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))

    return round_to_bfloat16


@_compiled
def _tree_attention(
    query: np.ndarray, cache: np.ndarray, key_index: np.ndarray, value_index: np.ndarray, read_in_place: bool, block_size: int,
    block_table: np.ndarray,
    req_indices: np.ndarray, starts: np.ndarray, num_nodes: np.ndarray, ancestor_mask: np.ndarray, node_rows: np.ndarray,
    scale: float, output: np.ndarray,
) -> None:
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = cache.shape[1]
    group = num_heads // num_kv_heads
    exponent_bits = np.empty(block_size, np.int32)  # scratch whose size no request changes
    query_row = np.empty(head_size, np.float32)
    keys_scratch = np.empty(head_size * block_size, np.float32)
    values_scratch = np.empty(block_size * head_size, np.float32)
    for t in range(starts.shape[0]):
        nodes, start, request = num_nodes[t], starts[t], req_indices[t]
        window = start + nodes
        rows = group * nodes  # row r: node r // group, query head h * group + r % group
        q = np.empty((rows, head_size), np.float32)
        logits_buffer = np.empty(rows * block_size, np.float32)
        probs = np.empty((rows, block_size), np.float32)
        acc = np.empty((rows, head_size), np.float32)
        partial = np.empty((rows, head_size), np.float32)
        maxima = np.empty(rows, np.float32)
        totals = np.empty(rows, np.float32)
        for h in range(num_kv_heads):
            for r in range(rows):
                source = _as_float32(query[node_rows[t, r // group], h * group + r % group], query_row)
                for d in range(head_size):
                    q[r, d] = source[d] * scale
            acc[:] = 0.0
            maxima[:] = -np.inf
            totals[:] = 0.0
            for b in range((window + block_size - 1) // block_size):
                region = cache[block_table[request, b], h]
                first = b * block_size
                tokens = min(block_size, window - first)
                keys_t = _block(region, key_index, tokens, 1, read_in_place, keys_scratch)
                values = _block(region, value_index, tokens, 0, read_in_place, values_scratch)
                logits = logits_buffer[: rows * keys_t.shape[1]].reshape((rows, keys_t.shape[1]))
                _attend_block(q, keys_t, values, tokens, first - start, ancestor_mask[t], group, logits, probs, partial, acc, maxima,
                              totals, exponent_bits)
            for r in range(rows):
                _store(output[node_rows[t, r // group], h * group + r % group], acc[r], np.float32(1.0) / totals[r])


@_compiled
def _attend_block(
    q: np.ndarray, keys_t: np.ndarray, values: np.ndarray, tokens: int, offset: int, mask: np.ndarray, group: int,
    logits: np.ndarray, probs: np.ndarray, partial: np.ndarray, acc: np.ndarray, maxima: np.ndarray, totals: np.ndarray,
    exponent_bits: np.ndarray,
) -> None:
    """Fold the block's first `tokens` positions into every row's online softmax; position k of the block
    is node k + offset when k + offset >= 0 (seen iff the row's node has it on its mask row), else prefix.
    Both products are BLAS calls (numba's np.dot): logits [rows, keys_t's columns] over the block's
    positions keys_t holds (the whole block or its first `tokens`; logits past `tokens` are never read),
    the probabilities [rows, tokens] (a contiguous prefix of `probs`) times the block's first `tokens`
    values, so no position past the window is read."""
    rows, head_size = q.shape
    np.dot(q, keys_t, logits)
    probs = probs.ravel()[: rows * tokens].reshape((rows, tokens))
    for r in range(rows):
        row = logits[r]
        if offset + tokens > 0:  # the block holds nodes
            seen = mask[r // group]
            for k in range(max(-offset, 0), tokens):
                if not seen[k + offset]:
                    row[k] = -np.inf
        largest = maxima[r]
        for k in range(tokens):
            largest = max(largest, row[k])
        out = probs[r]
        if largest == -np.inf:  # nothing seen yet: the row adds nothing
            out[:] = 0.0
            continue
        for k in range(tokens):  # exp(x), x = row[k] - largest <= 0: 2^e e^y, e = round(x / ln 2), |y| <= ln(2) / 2
            x = max(row[k] - largest, np.float32(-100.0))
            e = math.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
            y = x - np.float32(e) * np.float32(0.693145751953125) - np.float32(e) * np.float32(1.428606765330187e-06)
            p = np.float32(1.0 / 5040)
            p = p * y + np.float32(1.0 / 720)
            p = p * y + np.float32(1.0 / 120)
            p = p * y + np.float32(1.0 / 24)
            p = p * y + np.float32(1.0 / 6)
            p = p * y + np.float32(0.5)
            p = p * y + np.float32(1.0)
            out[k] = p * y + np.float32(1.0)
            exponent_bits[k] = max(np.int32(e) + np.int32(127), np.int32(0)) << np.int32(23)  # 2^e (0 below 2^-126)
        powers = exponent_bits.view(np.float32)
        total = np.float32(0.0)
        for k in range(tokens):
            out[k] *= powers[k]
            total += out[k]
        rescale = np.float32(math.exp(maxima[r] - largest))
        maxima[r] = largest
        totals[r] = totals[r] * rescale + total
        accumulated = acc[r]
        for d in range(head_size):
            accumulated[d] *= rescale
    np.dot(probs, values[:tokens], partial)
    acc += partial


def _one_blas_thread() -> None:
    """One thread for the BLAS that numba's np.dot calls (scipy's OpenBLAS, loaded by then): it starts a
    pool of a worker per core when it loads (seen here: one beside the caller on two cores) and would
    split the products above its size threshold over them, workers that spin between calls against
    vLLM's own threads. Best effort: a BLAS without the call is left as it is."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and line.rstrip().endswith(".so")}
    for path in paths:
        library = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            if hasattr(library, name):
                getattr(library, name)(1)
                break


def warm_up() -> None:
    """Compile the kernel (or load it from numba's cache) for a contiguous query and for a view of a
    fused qkv projection (strided rows), so that no step pays a compilation; on failure (numba's np.dot
    without scipy) log why, once, and leave the tree rows to the torch formulation."""
    global _compiled_ok
    if _compiled_ok is not None:
        return
    block_size, head_size, num_kv_heads = 4, 2, 1
    cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_size)
    layout = vec_layout(block_size, head_size)
    host = (np.zeros((1, 1), np.int32), np.zeros(1, np.int64), np.ones(1, np.int64), np.ones(1, np.int64),
            np.ones((1, 1, 1), np.bool_), np.zeros((1, 1), np.int64))
    fused = torch.zeros(2, 3, head_size)
    try:
        for dtype in DTYPES:
            for query in (torch.zeros(2, 1, head_size), fused[:, :1]):
                attend_tree_rows(torch.zeros(2, 1, head_size, dtype=dtype), query.to(dtype), layer_cache(cache.to(dtype), layout), *host, 1.0)
    except Exception as error:  # numba's typing and lowering errors have no common base besides Exception
        _compiled_ok = False
        logger.warning("method 'ddtree': the compiled CPU tree attention is unavailable (%s: %s); tree rows run "
                       "the torch formulation (slower at small batches; numba's np.dot needs scipy)",
                       type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return
    _compiled_ok = True
    try:
        _one_blas_thread()
    except OSError as error:  # no /proc (not Linux) or a library ctypes cannot open: BLAS threads as they are
        logger.debug("method 'ddtree': BLAS threads left as they are (%s)", error)
