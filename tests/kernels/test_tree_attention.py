"""The Triton tree-attention kernel equals the torch reference, which equals a per-query loop oracle.

The kernels run in Triton's CPU interpreter, which needs TRITON_INTERPRET=1 from before triton is first
imported (triton's own library functions are decorated at that import). So this module runs only in a
process started with it: tests/test_interpreter_process.py starts one; in any other process it skips itself.
By hand: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_tree_attention.py
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in its own TRITON_INTERPRET=1 process (tests/test_interpreter_process.py)", allow_module_level=True)

import contextlib
import math
import subprocess
import sys
from collections.abc import Iterator
from unittest import mock

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ddtree.kernels.problems import TreeVerifyProblem, make_problem
from vllm_ddtree.kernels.tree_attention import TreeAttentionConfig, default_config, plan_row_tiles, tree_attention
from vllm_ddtree.kernels.tree_attention_reference import tree_attention_reference
from vllm_ddtree.kernels.tree_mask import BITS_PER_WORD, pack_tree_mask

SMALL_CONFIGS = [TreeAttentionConfig(16, 16, 4, 1, splits) for splits in (1, 2, 3)] + [TreeAttentionConfig(64, 32, 4, 1, splits) for splits in (1, 2)]


def run_kernel(problem: TreeVerifyProblem, config: TreeAttentionConfig | None, out: torch.Tensor | None = None) -> torch.Tensor:
    return tree_attention(
        problem.query, problem.key_cache, problem.value_cache, problem.block_table, problem.seq_lens, problem.mask_bits, problem.scale, out=out, config=config
    )


def run_reference(problem: TreeVerifyProblem, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return tree_attention_reference(
        problem.query.to(dtype), problem.key_cache.to(dtype), problem.value_cache.to(dtype), problem.block_table, problem.seq_lens, problem.tree_mask, problem.scale
    )


def loop_oracle(problem: TreeVerifyProblem) -> torch.Tensor:
    """float64, one query and one key at a time, positions resolved through the block table by hand."""
    query, keys, values = problem.query.double(), problem.key_cache.double(), problem.value_cache.double()
    num_req, num_nodes, num_q_heads, _ = query.shape
    block_size, num_kv_heads = keys.shape[1], keys.shape[2]
    out = torch.zeros_like(query)
    for r in range(num_req):
        prefix = int(problem.seq_lens[r]) - num_nodes
        visible = list(range(prefix))
        for i in range(num_nodes):
            row_visible = visible + [prefix + j for j in range(num_nodes) if problem.tree_mask[r, i, j]]
            for hq in range(num_q_heads):
                hk = hq // (num_q_heads // num_kv_heads)
                rows = [(int(problem.block_table[r, p // block_size]), p % block_size) for p in row_visible]
                logits = [float(query[r, i, hq] @ keys[b, s, hk]) * problem.scale for b, s in rows]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for w, (b, s) in zip(weights, rows):
                    out[r, i, hq] += (w / total) * values[b, s, hk]
    return out


@st.composite
def problems(draw, dtype: torch.dtype = torch.float32, head_sizes=(16, 24, 32)) -> TreeVerifyProblem:
    """Small problems: 1-3 requests, budgets 0-20 (padded nodes when the top-k runs dry), prefixes of
    0 or any length (not block aligned), block sizes 1-32, GQA groups 1-5, NHD or HND caches."""
    num_req = draw(st.integers(1, 3))
    return make_problem(
        prefix_lens=draw(st.lists(st.integers(0, 40), min_size=num_req, max_size=num_req)),
        budget=draw(st.integers(0, 20)),
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3, 4, 5])),
        head_size=draw(st.sampled_from(head_sizes)),
        kv_block_size=draw(st.sampled_from([1, 4, 8, 16, 32])),
        dtype=dtype,
        layout=draw(st.sampled_from(["NHD", "HND"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        max_depth=draw(st.integers(1, 6)),
        topk=draw(st.integers(1, 4)),
        dead_fraction=draw(st.sampled_from([0.0, 0.5])),
    )


@settings(max_examples=30)
@given(problems())
def test_reference_equals_per_query_loop_oracle(problem):
    torch.testing.assert_close(run_reference(problem).double(), loop_oracle(problem), atol=1e-5, rtol=1e-5)


@settings(max_examples=30)
@given(problems(), st.sampled_from(SMALL_CONFIGS))
def test_kernel_equals_reference_fp32(problem, config):
    torch.testing.assert_close(run_kernel(problem, config), run_reference(problem), atol=2e-5, rtol=2e-5)


@contextlib.contextmanager
def interpreter_bf16_dot() -> Iterator[None]:
    """Triton's interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bit patterns
    (triton-lang/triton#11584; bf16 is unsupported there). Decode bf16 dot operands to float32 first,
    as the GPU's tensor cores do, so the kernel's bf16 path (bf16 loads, P cast to bf16) is testable."""
    from triton import language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot = InterpreterBuilder.create_dot

    def decode(handle: TensorHandle) -> TensorHandle:
        if handle.dtype != tl.bfloat16:
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    with mock.patch.object(InterpreterBuilder, "create_dot", lambda self, a, b, *args: create_dot(self, decode(a), decode(b), *args)):
        yield


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@settings(max_examples=8)
@given(data=st.data())
def test_kernel_half_precision_within_dtype_tolerance_of_fp32_reference(dtype, atol, data):
    problem = data.draw(problems(dtype=dtype))
    config = data.draw(st.sampled_from(SMALL_CONFIGS))
    with interpreter_bf16_dot():
        out = run_kernel(problem, config)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), run_reference(problem), atol=atol, rtol=atol)


def test_head_size_128_with_default_config_and_row_tail():
    """Qwen3-like group of 4 with budget 16: 68 rows = one 64-row tile + a 16-row tail on it."""
    problem = make_problem([45, 0], budget=16, num_kv_heads=1, group=4, head_size=128, kv_block_size=16, dtype=torch.float32, seed=3)
    assert plan_row_tiles(17 * 4, default_config(17, 4, 128, torch.bfloat16).block_m) == (64, 1, 16)
    torch.testing.assert_close(run_kernel(problem, None), run_reference(problem), atol=2e-5, rtol=2e-5)


def test_split_prefix_merge_with_splits_owning_no_keys():
    """More splits than prefix tiles: empty splits must drop out of the merge."""
    problem = make_problem([3, 70], budget=5, num_kv_heads=2, group=2, head_size=16, kv_block_size=8, dtype=torch.float32, seed=5)
    out = run_kernel(problem, TreeAttentionConfig(16, 16, 4, 1, num_splits=6))
    torch.testing.assert_close(out, run_reference(problem), atol=2e-5, rtol=2e-5)


def test_writes_into_a_strided_output_view_of_token_rows():
    """vLLM hands attention [num_tokens, Hq, D] buffers: the tree rows of R requests are a view."""
    problem = make_problem([20, 9], budget=6, num_kv_heads=2, group=2, head_size=16, kv_block_size=16, dtype=torch.float32, seed=7)
    num_req, num_nodes, num_q_heads, head_size = problem.query.shape
    tokens = torch.full((num_req * num_nodes + 2, num_q_heads, head_size), float("nan"))
    out = tokens[1 : 1 + num_req * num_nodes].view(num_req, num_nodes, num_q_heads, head_size)
    run_kernel(problem, None, out=out)
    torch.testing.assert_close(out, run_reference(problem), atol=2e-5, rtol=2e-5)
    assert tokens[0].isnan().all() and tokens[-1].isnan().all()


@given(st.integers(1, 700), st.sampled_from([16, 64, 128]))
def test_row_tiles_cover_every_row_with_small_tails(num_rows, block_m):
    tile, tiles, tail = plan_row_tiles(num_rows, block_m)
    assert tile & (tile - 1) == 0 and tile >= 16 and (tail == 0 or (tail >= 16 and tail & (tail - 1) == 0))
    assert (tiles - 1) * tile < num_rows <= tiles * tile + tail
    assert tail <= tile // 4


def test_qwen3_8b_budget_64_pads_260_rows_to_272():
    config = default_config(65, 4, 128, torch.bfloat16)
    assert plan_row_tiles(260, config.block_m) == (128, 2, 16) and config.num_warps == 8


def unpack_tree_mask(mask_bits: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Inverse of `pack_tree_mask`: [R, N, W] int32 words -> [R, N, num_nodes] bool."""
    shifts = torch.arange(BITS_PER_WORD, device=mask_bits.device, dtype=torch.int32)
    bits = torch.bitwise_right_shift(mask_bits.unsqueeze(-1), shifts).bitwise_and(1).bool()
    return bits.flatten(2)[:, :, :num_nodes]


@given(st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_pack_tree_mask_round_trips_every_bit(num_req, num_nodes, seed):
    mask = torch.rand((num_req, num_nodes, num_nodes), generator=torch.Generator().manual_seed(seed)) < 0.5
    bits = pack_tree_mask(mask)
    assert bits.dtype == torch.int32 and bits.shape == (num_req, num_nodes, (num_nodes + 31) // 32)
    assert torch.equal(unpack_tree_mask(bits, num_nodes), mask)


def test_pack_tree_mask_bit_order():
    mask = torch.zeros((1, 33, 33), dtype=torch.bool)
    mask[0, 0, 0] = mask[0, 1, 31] = mask[0, 2, 32] = True
    bits = pack_tree_mask(mask)
    assert bits[0, 0].tolist() == [1, 0] and bits[0, 1].tolist() == [-(2**31), 0] and bits[0, 2].tolist() == [0, 1]


def test_importing_kernels_does_not_import_vllm():
    code = "import sys, vllm_ddtree.kernels; assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
