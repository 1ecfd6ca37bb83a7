"""Many steps of build -> verify -> walk -> KV compaction equal plain greedy decoding of a fake target."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core import accept_tree, build_draft_trees, kv_compaction_plan

VOCAB = 12


def make_target(seed: int):
    """Deterministic fake target: the greedy next token is a random function of the last two tokens."""
    table = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(seed)).tolist()
    return lambda seq: table[seq[-2]][seq[-1]]


def greedy_continuation(target, seq: list[int], n: int) -> list[int]:
    seq = list(seq)
    for _ in range(n):
        seq.append(target(seq))
    return seq[-n:]


def noisy_draft(target, seq: list[int], depth: int, gen: torch.Generator, skill: float):
    """Per-depth log-probs that favour the target's true continuation, with noise (so the truth is
    sometimes rank 1, 2, ... and sometimes missing from the top-k)."""
    truth = greedy_continuation(target, seq, depth)
    logits = torch.randn(depth, VOCAB, generator=gen) * 1.5
    logits[torch.arange(depth), truth] += skill
    return torch.log_softmax(logits, dim=-1)


@given(st.integers(0, 10_000), st.integers(1, 24), st.integers(1, 5), st.integers(1, 6), st.floats(0.0, 4.0))
def test_tree_decoding_equals_plain_greedy(seed, budget, depth, topk, skill):
    target = make_target(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, VOCAB, (2 + i,), generator=gen).tolist() for i in range(3)]
    seqs = [list(p) for p in prompts]
    # Simulated KV cache: row p of a request holds the token prefix it was computed from.
    caches = [[tuple(p[: i + 1]) for i in range(len(p) - 1)] for p in prompts]
    num_new = 30
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < num_new:
        top = torch.stack([noisy_draft(target, s, depth, gen, skill) for s in seqs]).topk(topk, dim=-1)
        roots = torch.tensor([s[-1] for s in seqs])
        tree = build_draft_trees(roots, top.values, top.indices, budget)
        n_cols = tree.nodes_per_request
        target_tokens = torch.zeros(len(seqs), n_cols, dtype=torch.long)
        window = []
        for r, s in enumerate(seqs):
            rows = []
            for i in range(n_cols):  # verify: node i sees the prefix plus its ancestors
                path, cur = [], i
                while cur > 0:
                    path.append(int(tree.token_ids[r, cur]))
                    cur = int(tree.parents[r, cur])
                context = s + path[::-1]
                target_tokens[r, i] = target(context)
                rows.append(tuple(context))
            window.append(rows)
        acc = accept_tree(tree, target_tokens)
        plan = kv_compaction_plan(acc)
        for r, s in enumerate(seqs):
            start = len(s) - 1
            caches[r] = caches[r][:start] + window[r]
            moved = [caches[r][start + int(src)] for src in plan.src_offsets[r]]
            for dst, row in zip(plan.dst_offsets[r].tolist(), moved):
                caches[r][start + dst] = row
            n = int(acc.num_accepted[r])
            caches[r] = caches[r][: start + n]
            s.extend(acc.output_token_ids[r, :n].tolist())
    for s, p, cache in zip(seqs, prompts, caches):
        assert s[len(p) :] == greedy_continuation(target, p, len(s) - len(p))
        assert cache == [tuple(s[: i + 1]) for i in range(len(s) - 1)]


def test_skilled_draft_accepts_several_tokens_per_step_including_non_rank_zero():
    target = make_target(3)
    gen = torch.Generator().manual_seed(0)
    seq = [1, 2]
    steps, non_rank0 = 0, 0
    while len(seq) < 200:
        top = noisy_draft(target, seq, 5, gen, 2.0).unsqueeze(0).topk(4, dim=-1)
        tree = build_draft_trees(torch.tensor([seq[-1]]), top.values, top.indices, 16)
        tokens = torch.zeros(1, tree.nodes_per_request, dtype=torch.long)
        for i in range(tree.nodes_per_request):
            path, cur = [], i
            while cur > 0:
                path.append(int(tree.token_ids[0, cur]))
                cur = int(tree.parents[0, cur])
            tokens[0, i] = target(seq + path[::-1])
        acc = accept_tree(tree, tokens)
        n = int(acc.num_accepted[0])
        non_rank0 += int((tree.ranks[0, acc.accepted_nodes[0, 1:n]] > 0).sum())
        seq.extend(acc.output_token_ids[0, :n].tolist())
        steps += 1
    assert (len(seq) - 2) / steps > 2.0 and non_rank0 > 0
    assert seq[2:] == greedy_continuation(target, [1, 2], len(seq) - 2)
