"""Exact enumeration: the tree procedure's output law equals autoregressive sampling (and the biased
min(1, p/q) rule on top-k drafts does not).

A small fake target p(. | prefix) over VOCAB tokens and a prefix-dependent draft are enumerated
exhaustively: every step builds a DDTree from the draft, and the probability of every emitted
sequence (first NUM_TOKENS tokens) is summed over all target draws.
"""

from __future__ import annotations

import functools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core import TreeSamplingParams, build_draft_trees, process_logits

VOCAB = 4
NUM_TOKENS = 3


def _prefix_seed(seed: int, prefix: tuple[int, ...]) -> int:
    return (seed * 1_000_003 + hash(prefix)) % 2**31


def make_target(seed: int, params: TreeSamplingParams):
    """p(. | prefix) after vLLM-style processing (temperature/top-k/top-p/min-p), as a float64 list."""

    @functools.cache
    def p(prefix: tuple[int, ...]) -> tuple[float, ...]:
        logits = torch.randn(1, 1, VOCAB, generator=torch.Generator().manual_seed(_prefix_seed(seed, prefix))) * 2
        return tuple(process_logits(logits, params).double().softmax(-1).flatten().tolist())

    return p


def make_draft(seed: int, depth: int):
    """Full per-depth draft distributions q_1..q_depth for a prefix (rows sum to 1)."""

    @functools.cache
    def q(prefix: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_prefix_seed(seed + 7, prefix))
        return torch.softmax(torch.randn(depth, VOCAB, generator=gen) * 2, dim=-1).double()

    return q


def tree_children(prefix, q, budget, topk):
    top = torch.log(q(prefix)).unsqueeze(0).topk(topk, dim=-1)
    tree = build_draft_trees(torch.tensor([prefix[-1]]), top.values, top.indices, budget)
    children: dict[int, dict[int, int]] = {}
    for i in range(1, int(tree.num_nodes[0])):
        children.setdefault(int(tree.parents[0, i]), {})[int(tree.token_ids[0, i])] = i
    return tree, children


def tree_rule_step(prefix, p, q, budget, topk):
    """{emitted tokens: probability} for one step of the DDTree rule (one draw per node, descend iff child)."""
    _, children = tree_children(prefix, q, budget, topk)
    out: dict[tuple[int, ...], float] = {}

    def walk(node, emitted, prob):
        for x, px in enumerate(p(prefix + emitted)):
            if px == 0:
                continue
            child = children.get(node, {}).get(x)
            if child is not None:
                walk(child, emitted + (x,), prob * px)
            else:
                out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + prob * px

    walk(0, (), 1.0)
    return out


def biased_rule_step(prefix, p, q, budget, topk):
    """The WRONG rule: Leviathan's min(1, p/q) on top-k children with residual max(0, r - q)."""
    _, children = tree_children(prefix, q, budget, topk)
    out: dict[tuple[int, ...], float] = {}

    def walk(node, emitted, prob):
        residual = list(p(prefix + emitted))
        depth = len(emitted)
        q_row = q(prefix)[depth].tolist() if depth < q(prefix).shape[0] else None
        for token, child in children.get(node, {}).items():
            accept = min(1.0, residual[token] / q_row[token])
            if accept > 0:
                walk(child, emitted + (token,), prob * accept)
            prob *= 1 - accept
            if prob == 0:
                return
            residual = [max(0.0, r - qq) for r, qq in zip(residual, q_row)]
            total = sum(residual)
            residual = [r / total for r in residual]
        for x, px in enumerate(residual):
            if px > 0:
                out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + prob * px

    walk(0, (), 1.0)
    return out


def sequence_law(step, prompt, p, q, budget, topk):
    """Law of the first NUM_TOKENS emitted tokens when steps repeat until enough are emitted."""
    law: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    while frontier:
        emitted, prob = frontier.pop()
        for more, pm in step(prompt + emitted, p, q, budget, topk).items():
            seq = emitted + more
            if len(seq) >= NUM_TOKENS:
                law[seq[:NUM_TOKENS]] = law.get(seq[:NUM_TOKENS], 0.0) + prob * pm
            else:
                frontier.append((seq, prob * pm))
    return law


def autoregressive_law(prompt, p):
    law = {(): 1.0}
    for _ in range(NUM_TOKENS):
        law = {s + (x,): ps * px for s, ps in law.items() for x, px in enumerate(p(prompt + s)) if px > 0}
    return law


def sampling_params(temperature, top_k, top_p, min_p):
    return TreeSamplingParams(
        temperature=torch.tensor([temperature]),
        top_k=torch.tensor([top_k]),
        top_p=torch.tensor([top_p]),
        min_p=torch.tensor([min_p]),
    )


@given(
    st.integers(0, 10_000),
    st.integers(1, 12),
    st.integers(1, 3),
    st.integers(1, VOCAB),
    st.sampled_from([(1.0, 0, 1.0, 0.0), (0.7, 3, 0.9, 0.0), (1.3, 0, 0.8, 0.1), (0.5, 2, 1.0, 0.2)]),
)
def test_tree_rule_law_equals_autoregressive_sampling(seed, budget, depth, topk, processing):
    p = make_target(seed, sampling_params(*processing))
    q = make_draft(seed, depth)
    prompt = (seed % VOCAB, (seed // VOCAB) % VOCAB)
    tree_law = sequence_law(tree_rule_step, prompt, p, q, budget, topk)
    ar_law = autoregressive_law(prompt, p)
    assert set(tree_law) <= set(ar_law)
    for seq, prob in ar_law.items():
        assert math.isclose(tree_law.get(seq, 0.0), prob, rel_tol=0, abs_tol=1e-9)


def test_biased_min_p_over_q_rule_fails_the_same_check():
    p = make_target(1, sampling_params(1.0, 0, 1.0, 0.0))
    q = make_draft(1, 3)
    prompt = (1, 2)
    ar_law = autoregressive_law(prompt, p)
    biased = sequence_law(biased_rule_step, prompt, p, q, 8, 3)
    exact = sequence_law(tree_rule_step, prompt, p, q, 8, 3)
    total_variation = 0.5 * sum(abs(biased.get(s, 0.0) - pr) for s, pr in ar_law.items())
    assert total_variation > 1e-2
    assert all(math.isclose(exact.get(s, 0.0), pr, abs_tol=1e-9) for s, pr in ar_law.items())
