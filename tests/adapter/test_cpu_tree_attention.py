"""The CPU tree attention (`attention.tree_attention`, runs of paged-cache views merged by log-sum-exp)
equals a slow reference: masked SDPA in float64 over each request's window read back densely from the
cache (the path it replaced). Random trees, both CPU KV layouts the probe knows (affine "vec", and
"amx", whose layout is a permutation read by selection), GQA and MHA, prefixes ending anywhere in a
block, and block tables whose windows are one run of consecutive blocks or several.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.adapter.paged_rows import row_index
from vllm_ddtree.core import DraftTree, tree_attention_mask
from vllm_ddtree.vllm.tree_step import TreeRows


def random_rows(num_nodes: list[int], starts: list[int], gen: torch.Generator) -> TreeRows:
    """T requests (batch indices 0..T-1, rows laid out one after the other), trees with random parents."""
    num_req, width = len(num_nodes), max(num_nodes)
    parents = torch.full((num_req, width), -1, dtype=torch.long)
    depths = torch.zeros(num_req, width, dtype=torch.long)
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(num_nodes).unsqueeze(1)
    for t, n in enumerate(num_nodes):
        for i in range(1, n):
            parents[t, i] = int(torch.randint(0, i, (1,), generator=gen))
            depths[t, i] = depths[t, parents[t, i]] + 1
    tree = DraftTree(torch.zeros_like(parents), parents, depths, torch.zeros_like(parents), valid, valid.sum(1), int(depths.max()) or 1)
    first_row = torch.cumsum(torch.tensor([0, *num_nodes[:-1]]), 0)
    node_rows = first_row.unsqueeze(1) + torch.where(valid, torch.arange(width).unsqueeze(0), 0)
    return TreeRows(torch.arange(num_req), torch.tensor(starts), torch.tensor(num_nodes), valid, tree_attention_mask(tree), node_rows)


def reference(query, kv_cache, rows: TreeRows, block_table, layout, num_kv_heads, scale) -> torch.Tensor:
    """[M, H, D] float64, real nodes in (request, node) order: node i of request t attends to positions
    0 .. start - 1 and its ancestors and itself, read position by position through the block table."""
    block_size = layout.block_size
    out = []
    for t in range(rows.req_indices.numel()):
        start, n = int(rows.starts[t]), int(rows.num_nodes[t])
        positions = torch.arange(start + n)
        slots = block_table[int(rows.req_indices[t]), positions // block_size] * block_size + positions % block_size
        keys, values = kv_cache.view(-1)[row_index(layout, slots, num_kv_heads)].double()  # [L, KV, D] each
        visible = torch.ones(n, start + n, dtype=torch.bool)
        visible[:, start:] = rows.ancestor_mask[t, :n, :n]
        q = query[rows.node_rows[t, :n]].double()  # [n, H, D]
        group = q.shape[1] // num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        logits = torch.einsum("nhd,lhd->hnl", q, keys) * scale
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hnl,lhd->nhd", probs, values))
    return torch.cat(out)


@st.composite
def problems(draw):
    num_req = draw(st.integers(1, 3))
    return dict(
        num_nodes=draw(st.lists(st.integers(1, 12), min_size=num_req, max_size=num_req)),
        starts=draw(st.lists(st.integers(0, 80), min_size=num_req, max_size=num_req)),
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 3])),
        head_size=draw(st.sampled_from([32, 64])),
        layout_isa=(isa := draw(st.sampled_from(["vec", "amx"]))),
        block_size=draw(st.sampled_from([16, 32] if isa == "vec" else [32, 64])),  # amx tiles need multiples of 32
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        consecutive=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=60)
@given(problems())
def test_tree_attention_equals_masked_sdpa_reference(problem):
    from vllm import _custom_ops as ops

    from vllm_ddtree.vllm.attention import TreeAttention, _kernel_serves, tree_attention
    from vllm_ddtree.vllm.cpu_tree_kernel import attend_tree_rows, layer_cache, vec_layout
    from vllm_ddtree.vllm.paged_kv import probe_layout

    gen = torch.Generator().manual_seed(problem["seed"])
    block_size, head_size, dtype = problem["block_size"], problem["head_size"], problem["dtype"]
    num_kv_heads, num_heads = problem["num_kv_heads"], problem["num_kv_heads"] * problem["group"]
    rows = random_rows(problem["num_nodes"], problem["starts"], gen)
    max_blocks = -(-(max(problem["starts"]) + max(problem["num_nodes"])) // block_size)
    num_req = len(problem["num_nodes"])
    num_blocks = num_req * max_blocks + 3
    if problem["consecutive"]:  # each request's blocks one run, requests side by side
        block_table = 1 + torch.arange(num_req * max_blocks).view(num_req, max_blocks)
    else:  # shuffled: runs of any length, some of one block
        block_table = torch.randperm(num_blocks, generator=gen)[: num_req * max_blocks].view(num_req, max_blocks)
    isa = problem["layout_isa"]
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = (block_table.unsqueeze(2) * block_size + torch.arange(block_size)).flatten()
    keys = torch.randn(slots.numel(), num_kv_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(slots.numel(), num_kv_heads, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    num_rows = sum(problem["num_nodes"])
    query = torch.randn(num_rows, num_heads, head_size, generator=gen).to(dtype)
    layout = probe_layout(isa, block_size, head_size, dtype)
    scale = head_size**-0.5

    tree = TreeAttention.build(rows, block_table.int(), block_size)
    got = tree_attention(query, cache, tree, layout, num_kv_heads, scale)
    expected = reference(query, cache, rows, block_table, layout, num_kv_heads, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(tree.valid_rows, rows.node_rows[rows.valid])

    if isa == "vec":  # the layout the kernel's warm-up and tests describe is the one vLLM writes
        described = vec_layout(block_size, head_size)
        assert torch.equal(layout.key_offsets, described.key_offsets) and torch.equal(layout.value_offsets, described.value_offsets)
    # the compiled kernel serves every layout vLLM writes: the same rows, written in place; no other row touched
    output = torch.full_like(query, float("nan"))
    assert _kernel_serves(query, cache, output, layout)
    fused = torch.randn(num_rows, 3 * num_heads, head_size, generator=gen).to(dtype)  # a view of a fused projection
    fused[:, :num_heads] = query
    for q in (query, fused[:, :num_heads]):
        output.fill_(float("nan"))
        attend_tree_rows(output, q, layer_cache(cache, layout), *tree.host_arrays, scale)
        if dtype == torch.float32:
            torch.testing.assert_close(output[tree.valid_rows].double(), expected, atol=2e-5, rtol=2e-5)
        else:  # computed in float32, rounded to bfloat16 (half an ulp: 2^-9 relative)
            torch.testing.assert_close(output[tree.valid_rows].double(), expected, atol=1e-4, rtol=4e-3)
        untouched = torch.ones(num_rows, dtype=torch.bool)
        untouched[tree.valid_rows] = False
        assert bool(output[untouched].isnan().all())


def test_windows_split_into_runs_of_consecutive_blocks():
    """A window over blocks [7, 8, 3, 4, 5] is two runs; the tree mask sits on the blocks holding nodes
    (prefix 40, 5 nodes, block size 16: window blocks 2 and 3, the second run's last two)."""
    from vllm_ddtree.vllm.attention import TreeAttention

    rows = random_rows([5], [40], torch.Generator().manual_seed(0))
    tree = TreeAttention.build(rows, torch.tensor([[7, 8, 3, 4, 5, 9]], dtype=torch.int32), 16)
    (first, second), = tree.runs
    assert (first.first_block, first.num_blocks, first.bias_from, first.bias.shape[0]) == (7, 2, 2, 0)
    assert (second.first_block, second.num_blocks, second.bias_from, second.bias.shape[0]) == (3, 1, 0, 1)
    assert second.bias.shape == (1, 1, 1, 5, 16)
    assert bool((second.bias[0, 0, 0, :, :8] == 0).all())  # positions 32..39: prefix, seen by all
    assert bool((second.bias[0, 0, 0, :, 13:] == float("-inf")).all())  # past the window


def metadata(query_lens: list[int], seq_lens: list[int]):
    from vllm_ddtree.vllm.attention import DDTreeCPUAttentionMetadata

    start_loc = torch.tensor([0, *torch.cumsum(torch.tensor(query_lens), 0).tolist()], dtype=torch.int32)
    calls = []
    md = DDTreeCPUAttentionMetadata(
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        query_start_loc=start_loc,
        max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.zeros(len(seq_lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
        scheduler_metadata=None,
        reschedule=lambda seq_lens: calls.append(seq_lens.clone()) or torch.ones(1),
    )
    return md, calls


@pytest.mark.parametrize(
    ("query_lens", "tree_requests", "tree_nodes", "run_kernel", "kernel_seq_lens"),
    [
        ([5], [0], [5], False, None),  # batch 1: the tree rows are the batch, the kernel is skipped
        ([5, 9], [0, 1], [5, 9], False, None),
        ([5, 1, 4], [0], [5], True, [5, 30, 40]),  # a plain decode and a chain beside it: tree request cut to its rows
        ([7, 3], [1], [3], True, [20, 3]),
        ([7, 3], [0], [5], True, None),  # rows besides the nodes (not expected): the kernel runs as vLLM's
    ],
)
def test_kernel_kept_off_the_tree_rows(query_lens, tree_requests, tree_nodes, run_kernel, kernel_seq_lens):
    md, calls = metadata(query_lens, [20, 30, 40][: len(query_lens)])
    rows = types.SimpleNamespace(req_indices=torch.tensor(tree_requests), num_nodes=torch.tensor(tree_nodes))
    md.attach_tree(types.SimpleNamespace(), rows)
    assert md.run_kernel is run_kernel
    if kernel_seq_lens is None:
        assert calls == [] and md.seq_lens.tolist() == [20, 30, 40][: len(query_lens)]
    else:
        assert [c.tolist() for c in calls] == [kernel_seq_lens] and md.seq_lens.tolist() == kernel_seq_lens


def test_tree_rows_fall_back_to_torch_when_the_kernel_did_not_compile(monkeypatch):
    """Without the compiled kernel (numba's np.dot needs scipy) every layer takes the torch formulation."""
    from vllm_ddtree.vllm import cpu_tree_kernel
    from vllm_ddtree.vllm.attention import _kernel_serves

    block_size, head_size = 4, 2
    layout = cpu_tree_kernel.vec_layout(block_size, head_size)
    query, cache = torch.zeros(3, 2, head_size), torch.zeros(2, 1, block_size, 2 * head_size)
    assert _kernel_serves(query, cache, torch.zeros_like(query), layout)
    monkeypatch.setattr(cpu_tree_kernel, "_compiled_ok", False)
    assert not _kernel_serves(query, cache, torch.zeros_like(query), layout)
