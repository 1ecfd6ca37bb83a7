"""The GDN tree scan equals a float32 chain scan along every root-to-leaf path, and the state compaction
leaves exactly what a chain step of the accepted path would have left (vLLM's rolling layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tests.core.strategies import draft_tables
from tests.core.test_accept import target_tokens_that_often_agree
from vllm_ddtree.core import (
    DraftTree,
    accept_tree,
    build_draft_trees,
    compact_conv_windows_,
    compact_recurrent_states_,
    gdn_gating,
    read_conv_history,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    write_conv_window_,
)

WIDTH = 4


def deep_trees():
    """Best-first trees up to depth 7, deeper than the conv window, so windows cross the history boundary
    at every offset."""
    return st.tuples(draft_tables(max_depth=7, max_topk=3), st.integers(0, 24)).map(lambda t: build_draft_trees(*t[0], t[1]))


def root_to_leaf_paths(tree: DraftTree, r: int) -> list[list[int]]:
    n = int(tree.num_nodes[r])
    parents = tree.parents[r, :n].tolist()
    leaves = set(range(n)) - set(parents)
    paths = []
    for leaf in sorted(leaves):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def chain_conv(x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[T, C] float64 causal depthwise conv of a chain x [T, C] after history [C, W-1], then SiLU."""
    inputs = torch.cat([history.double(), x.double().T], dim=1).unsqueeze(0)
    return F.silu(F.conv1d(inputs, weight.double().unsqueeze(1), bias.double(), groups=x.shape[1])[0].T)


def chain_delta_rule(q, k, v, g, beta, state):
    """Token-by-token gated delta rule (the HF Qwen3-Next reference loop) on one chain, float64:
    q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state [Hv, dk, dv] -> (out [T, Hv, dv], states)."""
    group = v.shape[1] // q.shape[1]
    q = F.normalize(q.double(), dim=-1, eps=0).repeat_interleave(group, 1) / q.shape[-1] ** 0.5
    k = F.normalize(k.double(), dim=-1, eps=0).repeat_interleave(group, 1)
    state, outs, states = state.double(), [], []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        kv_mem = (state * k[t].unsqueeze(-1)).sum(-2)
        state = state + k[t].unsqueeze(-1) * ((v[t].double() - kv_mem) * beta[t].double().unsqueeze(-1)).unsqueeze(-2)
        outs.append((state * q[t].unsqueeze(-1)).sum(-2))
        states.append(state)
    return torch.stack(outs), torch.stack(states)


@given(deep_trees(), st.integers(0, 2**31 - 1))
def test_tree_conv_equals_chain_conv_on_every_path(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    num_req, n = tree.token_ids.shape
    channels = 3
    x = torch.randn(num_req, n, channels, generator=gen)
    history = torch.randn(num_req, channels, WIDTH - 1, generator=gen)
    weight, bias = torch.randn(channels, WIDTH, generator=gen), torch.randn(channels, generator=gen)
    out = tree_causal_conv1d(x, history, tree.parents, tree.depths, weight, bias, silu=True)
    for r in range(num_req):
        for path in root_to_leaf_paths(tree, r):
            expected = chain_conv(x[r, path], history[r], weight, bias)
            torch.testing.assert_close(out[r, path].double(), expected, atol=1e-5, rtol=1e-5)


@given(deep_trees(), st.sampled_from([(1, 1), (1, 2), (2, 4)]), st.integers(0, 2**31 - 1))
def test_tree_delta_rule_equals_chain_scan_on_every_path(tree, heads, seed):
    gen = torch.Generator().manual_seed(seed)
    num_req, n = tree.token_ids.shape
    k_heads, v_heads = heads
    k_dim, v_dim = 8, 6
    q, k = torch.randn(2, num_req, n, k_heads, k_dim, generator=gen)
    v = torch.randn(num_req, n, v_heads, v_dim, generator=gen)
    g, beta = gdn_gating(torch.randn(v_heads, generator=gen), torch.randn(num_req, n, v_heads, generator=gen),
                         torch.randn(num_req, n, v_heads, generator=gen), torch.randn(v_heads, generator=gen))
    initial = torch.randn(num_req, v_heads, k_dim, v_dim, generator=gen)
    out, states = tree_gated_delta_rule(q, k, v, g, beta, tree.parents, tree.depths, initial)
    assert out.dtype == states.dtype == torch.float32
    for r in range(num_req):
        for path in root_to_leaf_paths(tree, r):
            chain_out, chain_states = chain_delta_rule(q[r, path], k[r, path], v[r, path], g[r, path], beta[r, path], initial[r])
            torch.testing.assert_close(out[r, path].double(), chain_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(states[r, path].double(), chain_states, atol=1e-5, rtol=1e-5)


@given(deep_trees(), st.integers(0, 2**31 - 1))
def test_compaction_leaves_what_the_accepted_chain_would(tree, seed):
    """Two steps in vLLM's layout: a tree step (write, walk, compact), then the next step's reads (conv
    history at num_accepted - 1, state column num_accepted - 1) equal a chain scan of the accepted path."""
    gen = torch.Generator().manual_seed(seed)
    num_req, n = tree.token_ids.shape
    num_spec, channels, v_heads, dim = n - 1 + int(torch.randint(0, 3, (1,), generator=gen)), 2, 2, 4
    length = WIDTH - 1 + num_spec
    pool = num_req * (num_spec + 1) + 2  # two spare slots nobody owns
    slots = torch.randperm(pool, generator=gen)[: num_req * (num_spec + 1)].view(num_req, num_spec + 1)
    conv_buffer = torch.randn(pool, channels, length, generator=gen)
    state_pool = torch.randn(pool, v_heads, dim, dim, generator=gen)
    previous = torch.randint(1, num_spec + 2, (num_req,), generator=gen)  # last step's num_accepted
    history = read_conv_history(conv_buffer, slots[:, 0], previous, WIDTH)  # [R, C, W-1]

    x = torch.randn(num_req, n, channels, generator=gen)
    write_conv_window_(conv_buffer, slots[:, 0], previous, x, WIDTH)
    tree_states = torch.randn(num_req, n, v_heads, dim, dim, generator=gen)
    state_pool[slots[:, :n].flatten()] = tree_states.flatten(0, 1)
    untouched = state_pool.clone()
    acc = accept_tree(tree, target_tokens_that_often_agree(tree, seed))
    compact_conv_windows_(conv_buffer, slots[:, 0], acc, WIDTH)
    compact_recurrent_states_(state_pool, slots, acc)

    next_history = read_conv_history(conv_buffer, slots[:, 0], acc.num_accepted, WIDTH)
    for r in range(num_req):
        m = int(acc.num_accepted[r])
        path = acc.accepted_nodes[r, :m]
        chain_inputs = torch.cat([history[r], x[r, path].T], dim=1)
        assert torch.equal(next_history[r], chain_inputs[:, -(WIDTH - 1) :])
        assert torch.equal(state_pool[slots[r, m - 1]], tree_states[r, path[-1]])
    written = slots[:, :n].flatten()
    others = torch.ones(pool, dtype=torch.bool)
    others[written] = False
    assert torch.equal(state_pool[others], untouched[others])


@given(st.integers(1, 3), st.integers(0, 6), st.integers(0, 2**31 - 1))
def test_chain_acceptance_moves_nothing(num_req, budget, seed):
    """A chain tree accepted along its spine is the identity case: buffers and states stay as written."""
    gen = torch.Generator().manual_seed(seed)
    depth = max(budget, 1)
    tree = build_draft_trees(torch.zeros(num_req, dtype=torch.long), torch.zeros(num_req, depth, 1),
                             torch.randint(1, 9, (num_req, depth, 1), generator=gen), budget)
    target = torch.cat([tree.token_ids[:, 1:], torch.zeros(num_req, 1, dtype=torch.long)], dim=1)
    cut = torch.randint(0, budget + 1, (num_req,), generator=gen)
    target[torch.arange(num_req), cut] = 99  # the walk stops at node `cut`
    acc = accept_tree(tree, target)
    assert acc.num_accepted.tolist() == (cut + 1).tolist()
    slots = torch.arange(num_req * (budget + 1)).view(num_req, budget + 1)
    conv_buffer = torch.randn(slots.numel(), 2, WIDTH - 1 + budget, generator=gen)
    state_pool = torch.randn(slots.numel(), 2, 3, 3, generator=gen)
    before = conv_buffer.clone(), state_pool.clone()
    compact_conv_windows_(conv_buffer, slots[:, 0], acc, WIDTH)
    compact_recurrent_states_(state_pool, slots, acc)
    assert torch.equal(conv_buffer, before[0]) and torch.equal(state_pool, before[1])
