"""The compiled host kernels (`vllm_ddtree.vllm.host_tree`) return exactly what their references return:
the core's tree builder and ancestor mask, and the numpy formula of the verify windows' tree bias."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.strategies import draft_tables
from vllm_ddtree.core import (
    DraftTree,
    accept_tree,
    accepted_by_shape,
    build_draft_trees,
    candidate_shapes,
    chain_token_ids_of,
    kv_compaction_plan,
    tree_attention_mask,
)
from vllm_ddtree.vllm.host_tree import (
    accept_greedy_rows_on_host,
    accept_tree_on_host,
    accepted_by_shape_on_host,
    build_draft_trees_on_host,
    kv_moves_on_host,
    tree_attention_mask_on_host,
    tree_windows,
    verify_layout,
)

FIELDS = ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes")


def assert_same_trees(built: DraftTree, reference: DraftTree) -> None:
    for name in FIELDS:
        a, b = getattr(built, name), getattr(reference, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert built.max_depth == reference.max_depth


@given(st.one_of(draft_tables(), draft_tables(max_depth=7, max_topk=8, vocab=64), draft_tables(max_depth=16, max_topk=1)), st.integers(0, 48))
def test_compiled_builder_builds_the_cores_trees(table, budget):
    roots, logprobs, token_ids = table
    reference = build_draft_trees(roots, logprobs, token_ids, budget)
    assert_same_trees(build_draft_trees_on_host(roots, logprobs, token_ids, budget), reference)
    assert build_draft_trees_on_host(roots, logprobs, token_ids, budget).chain_token_ids is None
    kept = build_draft_trees_on_host(roots, logprobs, token_ids, budget, with_chain=True)
    assert_same_trees(kept, reference)
    chain = chain_token_ids_of(logprobs, token_ids)
    assert kept.chain_token_ids.dtype == chain.dtype and torch.equal(kept.chain_token_ids, chain)


@given(draft_tables(max_depth=7, max_topk=6), st.integers(1, 40), st.data())
def test_nan_log_probs_are_no_probability_in_every_builder(table, budget, data):
    """A NaN log-prob (a broken draft) is -inf to every builder: never built, no crash."""
    roots, logprobs, token_ids = table
    nan = torch.tensor(data.draw(st.lists(st.booleans(), min_size=logprobs.numel(), max_size=logprobs.numel()))).view_as(logprobs)
    with_nan = torch.where(nan, float("nan"), logprobs)
    reference = build_draft_trees(roots, torch.where(nan, float("-inf"), logprobs), token_ids, budget)
    assert_same_trees(build_draft_trees_on_host(roots, with_nan, token_ids, budget), reference)
    assert_same_trees(build_draft_trees(roots, with_nan, token_ids, budget), reference)
    chain = chain_token_ids_of(torch.where(nan, float("-inf"), logprobs), token_ids)
    assert torch.equal(build_draft_trees_on_host(roots, with_nan, token_ids, budget, with_chain=True).chain_token_ids, chain)
    assert torch.equal(chain_token_ids_of(with_nan, token_ids), chain)


@given(draft_tables(max_depth=7, max_topk=6), st.integers(1, 40))
def test_compiled_ancestor_mask_is_the_cores(table, budget):
    tree = build_draft_trees(*table, budget)
    mask = tree_attention_mask_on_host(tree)
    assert mask.dtype == torch.bool and torch.equal(mask, tree_attention_mask(tree))


@given(st.one_of(draft_tables(max_depth=7, max_topk=6), draft_tables(max_depth=7, max_topk=1)), st.integers(0, 40), st.data())
def test_verify_layout_is_the_numpy_formulas(table, budget, data):
    """The step's layout in one compiled pass equals its formulas: node i of request r at batch row
    root_rows[r] + i and logits row (sum of 1 + num_drafts[q] for q < r) + i (padded nodes: the root's),
    branching iff some valid node's parent is not i - 1, the core's ancestor mask, the branching trees'
    valid nodes in request-major order at start + depth and start + i, the deepest valid depth; with
    token ids, None iff some valid node's token is not the scheduled one."""
    tree = build_draft_trees(*table, budget)
    num_req, width = tree.token_ids.shape
    width = data.draw(st.integers(int(tree.num_nodes.max()), width), label="width")
    num_drafts = tree.num_nodes.numpy() - 1
    gaps = np.array(data.draw(st.lists(st.integers(0, 3), min_size=num_req, max_size=num_req), label="gaps"))
    root_rows = np.cumsum(gaps + 1 + num_drafts) - 1 - num_drafts
    starts = np.array(data.draw(st.lists(st.integers(0, 50), min_size=num_req, max_size=num_req), label="starts"))
    layout = verify_layout(tree, width, root_rows, starts, num_drafts)
    valid, parents, depths = tree.valid.numpy()[:, :width], tree.parents.numpy()[:, :width], tree.depths.numpy()[:, :width]
    offsets = np.where(valid, np.arange(width), 0)
    logit_starts = np.cumsum(1 + num_drafts) - 1 - num_drafts
    branching = ((parents != np.arange(-1, width - 1)) & valid).any(1)
    select = valid & branching[:, None]
    expected = {
        "node_rows": root_rows[:, None] + offsets, "node_logit_rows": logit_starts[:, None] + offsets, "branching": branching,
        "ancestor_mask": tree_attention_mask(tree).numpy()[:, :width, :width], "rows": (root_rows[:, None] + offsets)[select],
        "tree_positions": (starts[:, None] + depths)[select], "linear_positions": (starts[:, None] + np.arange(width))[select],
    }
    for name, value in expected.items():
        got = getattr(layout, name)
        assert got.dtype == value.dtype and np.array_equal(got, value), name
    assert layout.max_depth == int(depths[valid].max())
    dtype = data.draw(st.sampled_from([np.int32, np.int64]), label="token dtype")
    token_ids = np.full((num_req + 1, 100), -7, dtype=dtype)
    for r in range(num_req):
        token_ids[r, starts[r] : starts[r] + width] = np.where(valid[r], tree.token_ids.numpy()[r, :width], 12345)
    assert verify_layout(tree, width, root_rows, starts, num_drafts, token_ids) is not None
    r, i = data.draw(st.sampled_from(np.argwhere(valid).tolist()), label="changed node")
    token_ids[r, starts[r] + i] += 1
    assert verify_layout(tree, width, root_rows, starts, num_drafts, token_ids) is None


@given(st.one_of(draft_tables(max_depth=7, max_topk=6, vocab=8), draft_tables(max_depth=7, max_topk=1, vocab=4)), st.integers(0, 40),
       st.sampled_from([torch.int64, torch.int32]), st.data())
def test_compiled_walk_accepts_what_the_core_accepts(table, budget, dtype, data):
    """Targets drawn from a small vocabulary (so paths are often accepted deep), in the sampler's dtypes:
    the core's acceptance, with and without the ancestor mask, field by field and dtype by dtype."""
    tree = build_draft_trees(*table, budget)
    target = torch.tensor(data.draw(st.lists(st.integers(0, 7), min_size=tree.token_ids.numel(), max_size=tree.token_ids.numel())), dtype=dtype)
    target = target.view_as(tree.token_ids)
    walked = accept_tree_on_host(tree, target)
    for reference in (accept_tree(tree, target), accept_tree(tree, target, tree_attention_mask(tree))):
        for name in ("accepted_nodes", "num_accepted", "output_token_ids", "bonus_token_ids"):
            a, b = getattr(walked, name), getattr(reference, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


@given(draft_tables(max_depth=7, max_topk=6, vocab=8), st.integers(0, 40), st.data())
def test_greedy_walk_reads_each_nodes_row_then_walks(table, budget, data):
    """Trees cut to a drawn number of drafts each (the scheduler's cut: a tree's first nodes), one logits row
    per node in batch order and a row token drawn per row: the fused call's node tokens are the rows' tokens
    at `TreeStep.node_logit_rows` (a padded node: its root's), its acceptance the walk's, its output rows the
    acceptance's output padded with -1 to the step's width, as int32."""
    tree = build_draft_trees(*table, budget)
    cut = torch.tensor([data.draw(st.integers(0, int(n) - 1)) for n in tree.num_nodes])
    width = int(cut.max()) + 1
    valid = torch.arange(width) < (cut + 1).unsqueeze(1)
    tree = dataclasses.replace(
        tree, token_ids=tree.token_ids[:, :width], parents=torch.where(valid, tree.parents[:, :width], -1),
        depths=torch.where(valid, tree.depths[:, :width], 0), ranks=torch.where(valid, tree.ranks[:, :width], 0),
        valid=valid, num_nodes=cut + 1, max_depth=int(torch.where(valid, tree.depths[:, :width], 0).max()),
    )
    num_rows = int((cut + 1).sum())
    row_tokens = torch.tensor(data.draw(st.lists(st.integers(0, 7), min_size=num_rows, max_size=num_rows)), dtype=torch.long)
    node_rows = (torch.cumsum(cut + 1, 0) - (cut + 1)).unsqueeze(1) + torch.where(valid, torch.arange(width), 0)
    target, acceptance, output = accept_greedy_rows_on_host(tree, cut, row_tokens)
    assert target.dtype == torch.long and torch.equal(target, row_tokens[node_rows])
    reference = accept_tree(tree, target)
    for name in ("accepted_nodes", "num_accepted", "output_token_ids", "bonus_token_ids"):
        a, b = getattr(acceptance, name), getattr(reference, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    expected = torch.full((tree.num_requests, width), -1, dtype=torch.int32)
    expected[:, : reference.output_token_ids.shape[1]] = reference.output_token_ids
    assert output.dtype == torch.int32 and torch.equal(output, expected)


@settings(max_examples=200)
@given(draft_tables(max_depth=7, max_topk=4, vocab=4), st.integers(0, 40), st.data())
def test_host_kv_moves_are_the_plans_real_moves(table, budget, data):
    """Drafts and targets from a vocabulary of 4 (deep accepted paths, often off the first children): the moves are
    exactly the core plan's entries with is_move, in its row-major order."""
    tree = build_draft_trees(*table, budget)
    target = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=tree.token_ids.numel(), max_size=tree.token_ids.numel())))
    acceptance = accept_tree(tree, target.view_as(tree.token_ids))
    plan = kv_compaction_plan(acceptance)
    requests, src, dst = kv_moves_on_host(acceptance)
    expect_requests, expect_columns = plan.is_move.nonzero(as_tuple=True)
    assert all(a.dtype == np.int64 for a in (requests, src, dst))
    assert np.array_equal(requests, expect_requests.numpy())
    assert np.array_equal(src, plan.src_offsets[expect_requests, expect_columns].numpy())
    assert np.array_equal(dst, plan.dst_offsets[expect_requests, expect_columns].numpy())


@given(st.integers(0, 2**31 - 1))
def test_compiled_read_off_counts_what_the_core_counts(seed):
    """What every candidate shape would have accepted, read off a walked tree (`accepted_by_shape`):
    random tables over 4 tokens (-inf tails included), trees of any budget, targets that mostly follow
    the draft's rank-0 token one depth down (long rank-0 runs, trees that end below them: the read-off
    one depth further fires in about one case in ten), any used shape, any verified requests, with and
    without the draft's chain and the target's tokens."""
    gen = torch.Generator().manual_seed(seed)

    def draw(high: int) -> int:
        return int(torch.randint(1, high + 1, (), generator=gen))

    num_req, depth, topk = draw(3), draw(7), draw(4)
    logprobs = (-torch.randint(0, 40, (num_req, depth, topk), generator=gen) / 8).sort(-1, descending=True).values
    logprobs[torch.rand(num_req, depth, topk, generator=gen) < 0.1] = float("-inf")
    logprobs = logprobs.sort(-1, descending=True).values
    token_ids = torch.stack([torch.randperm(4, generator=gen)[:topk] for _ in range(num_req * depth)]).view(num_req, depth, topk)
    kept = build_draft_trees_on_host(torch.randint(0, 4, (num_req,), generator=gen), logprobs, token_ids, draw(32), with_chain=True)
    rank0_next = token_ids[:, :, 0].gather(1, kept.depths.clamp(max=depth - 1))
    follows = torch.rand(rank0_next.shape, generator=gen) < 0.8
    target = torch.where(follows, rank0_next, torch.randint(0, 4, rank0_next.shape, generator=gen)).to(torch.int32 if seed % 2 else torch.int64)
    accepted_nodes = accept_tree_on_host(kept, target).accepted_nodes
    verified = (torch.rand(num_req, generator=gen) < 0.8).numpy()
    shapes = candidate_shapes(32, depth)
    used = shapes[int(torch.randint(0, len(shapes), (), generator=gen))]
    for tree in (kept, dataclasses.replace(kept, chain_token_ids=None)):
        for given_target in (target, None):
            expected = accepted_by_shape(shapes, used, tree, accepted_nodes, torch.from_numpy(verified), given_target)
            assert accepted_by_shape_on_host(shapes, used, tree, accepted_nodes, verified, given_target) == expected


def windows_oracle(ancestor_mask, starts, num_nodes, valid, req_indices, block_table, block_size):
    """The windows' bias and runs in plain numpy and Python (the formula `tree_windows` states)."""
    ancestor_mask, starts, num_nodes, valid = (t.numpy() for t in (ancestor_mask, starts, num_nodes, valid))
    num_req, width = valid.shape
    window_blocks = (starts + num_nodes + block_size - 1) // block_size
    tail_first = starts // block_size
    pos = (tail_first * block_size)[:, None] + np.arange(int((window_blocks - tail_first).max()) * block_size)
    column = pos - starts[:, None]
    in_tree = (column >= 0) & (column < num_nodes[:, None])
    ancestors = ancestor_mask[np.arange(num_req)[:, None, None], np.arange(width)[:, None], column.clip(0, width - 1)[:, None]]
    mask = (column < 0)[:, None] | (ancestors & in_tree[:, None])
    mask = np.where(valid[:, :, None], mask, mask[:, :1])
    bias = np.where(mask, np.float32(0), np.float32("-inf"))
    bias = bias.reshape(num_req, width, -1, block_size).transpose(0, 2, 1, 3)[:, :, None, None]
    runs = []
    for t in range(num_req):
        ids = block_table.numpy()[int(req_indices[t]), : window_blocks[t]]
        bounds = [0, *(np.flatnonzero(np.diff(ids) != 1) + 1).tolist(), int(window_blocks[t])]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            masked = max(0, hi - max(int(tail_first[t]), lo))
            end = hi - int(tail_first[t])
            runs.append((t, int(ids[lo]), hi - lo, hi - lo - masked, bias[t, end - masked : end] if masked else bias[t, :0]))
    return bias, runs


@given(draft_tables(max_depth=7, max_topk=6), st.integers(1, 24), st.integers(1, 3), st.data())
def test_compiled_windows_are_the_numpy_formula(table, budget, block_power, data):
    """Random trees at random positions of random block tables (runs of consecutive blocks broken at
    random): the same bias, bit for bit, and the same runs."""
    tree = build_draft_trees(*table, budget)
    num_req = tree.num_requests
    block_size = 2**block_power
    starts = torch.tensor(data.draw(st.lists(st.integers(0, 40), min_size=num_req, max_size=num_req)), dtype=torch.long)
    max_blocks = (40 + budget + 1) // block_size + 1
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    block_table = torch.stack([torch.randperm(4 * max_blocks, generator=gen)[:max_blocks] for _ in range(num_req + 1)]).to(torch.int32)
    runs_of_consecutive = torch.arange(4 * max_blocks, dtype=torch.int32)[: max_blocks]
    block_table[data.draw(st.integers(0, num_req))] = runs_of_consecutive
    req_indices = torch.tensor(data.draw(st.permutations(range(num_req + 1)))[:num_req], dtype=torch.long)
    args = (tree_attention_mask(tree), starts, tree.num_nodes, tree.valid, req_indices, block_table, block_size)
    bias, runs = tree_windows(*args)
    expected_bias, expected_runs = windows_oracle(*args)
    assert bias.dtype == np.float32 and np.array_equal(bias, expected_bias)
    assert [tuple(run[:4]) for run in runs] == [run[:4] for run in expected_runs]
    for (t, *_, lo, hi), (*_, expected) in zip(runs, expected_runs):
        assert np.array_equal(bias[t, lo:hi], expected)
