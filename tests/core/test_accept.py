"""The acceptance walk equals the sequential child-map walk, and KV compaction is exact."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.oracles import walk_oracle
from tests.core.strategies import draft_tables
from vllm_ddtree.core import accept_tree, build_draft_trees, compact_rows_, kv_compaction_plan, max_path_length, tree_attention_mask


def target_tokens_that_often_agree(tree, seed: int, vocab: int = 16) -> torch.Tensor:
    """Per node: with prob. 3/4 the token of one of its children (so walks go deep), else random."""
    gen = torch.Generator().manual_seed(seed)
    num_req, n = tree.token_ids.shape
    target = torch.randint(0, vocab, (num_req, n), generator=gen)
    for r in range(num_req):
        for u in range(n):
            kids = [i for i in range(1, n) if tree.valid[r, i] and tree.parents[r, i] == u]
            if kids and torch.rand(1, generator=gen) < 0.75:
                target[r, u] = tree.token_ids[r, kids[int(torch.randint(len(kids), (1,), generator=gen))]]
    return target


@given(st.one_of(draft_tables(), draft_tables(max_depth=16, max_topk=2)), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_walk_equals_sequential_child_map_walk(table, budget, seed):
    """Trees, deep chains and deep binary trees; with the ancestor mask given or computed."""
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    target = target_tokens_that_often_agree(tree, seed)
    acc = accept_tree(tree, target)
    given_mask = accept_tree(tree, target, tree_attention_mask(tree))
    path_len = max_path_length(tree)
    assert acc.accepted_nodes.shape == acc.output_token_ids.shape == (roots.shape[0], path_len)
    for name in ("accepted_nodes", "num_accepted", "output_token_ids", "bonus_token_ids"):
        assert torch.equal(getattr(acc, name), getattr(given_mask, name)), name
    for r in range(roots.shape[0]):
        path, bonus = walk_oracle(tree.token_ids[r].tolist(), tree.parents[r].tolist(), tree.valid[r].tolist(), target[r].tolist())
        n = len(path)
        assert acc.accepted_nodes[r].tolist() == path + [-1] * (path_len - n)
        assert int(acc.num_accepted[r]) == n and int(acc.bonus_token_ids[r]) == bonus
        drafted = [int(tree.token_ids[r, i]) for i in path[1:]]
        assert acc.output_token_ids[r].tolist() == drafted + [bonus] + [-1] * (path_len - n)


@given(draft_tables(), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_kv_compaction_moves_accepted_rows_to_the_front(table, budget, seed):
    roots, logprobs, token_ids = table
    tree = build_draft_trees(roots, logprobs, token_ids, budget)
    acc = accept_tree(tree, target_tokens_that_often_agree(tree, seed))
    plan = kv_compaction_plan(acc)
    num_req, n = tree.token_ids.shape
    gap = 3  # rows between windows belong to nobody and must stay untouched
    starts = torch.arange(num_req) * (n + gap) + gap
    cache = torch.randn(int(starts[-1]) + n + gap, 2)
    expected = cache.clone()
    for r in range(num_req):
        path = acc.accepted_nodes[r, : int(acc.num_accepted[r])]
        expected[starts[r] : starts[r] + len(path)] = cache[starts[r] + path]
    src, dst = (starts.view(-1, 1) + plan.src_offsets).flatten(), (starts.view(-1, 1) + plan.dst_offsets).flatten()
    assert bool((src >= dst).all())
    batched = cache.clone()
    compact_rows_(batched, src, dst)
    in_order = cache.clone()  # the in-place, increasing-order application is safe too
    for s, d in zip(src.tolist(), dst.tolist()):
        in_order[d] = in_order[s]
    for result in (batched, in_order):
        for r in range(num_req):
            k = int(acc.num_accepted[r])
            assert torch.equal(result[starts[r] : starts[r] + k], expected[starts[r] : starts[r] + k])
        outside = torch.ones(cache.shape[0], dtype=torch.bool)
        for r in range(num_req):
            outside[starts[r] : starts[r] + n] = False
        assert torch.equal(result[outside], cache[outside])


def test_root_only_tree_emits_the_bonus():
    tree = build_draft_trees(torch.tensor([5]), torch.zeros(1, 3, 1), torch.zeros(1, 3, 1, dtype=torch.long), 0)
    acc = accept_tree(tree, torch.tensor([[8]]))
    assert acc.output_token_ids.tolist() == [[8]] and acc.num_accepted.tolist() == [1]
