"""Hypothesis strategies for draft top-k tables."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def draft_tables(draw, max_requests: int = 3, max_depth: int = 4, max_topk: int = 4, vocab: int = 16):
    """(root_ids [R], top_logprobs [R, L, K], top_token_ids [R, L, K]).

    Log-probs are multiples of 1/8 (exact float sums, so ties are real ties), sorted descending, with
    optional -inf tails; token ids are distinct within each row.
    """
    num_req = draw(st.integers(1, max_requests))
    depth = draw(st.integers(1, max_depth))
    topk = draw(st.integers(1, max_topk))
    eighths = st.integers(-40, 0).map(lambda v: v / 8.0)
    values = draw(st.lists(eighths, min_size=num_req * depth * topk, max_size=num_req * depth * topk))
    logprobs = torch.tensor(values, dtype=torch.float32).view(num_req, depth, topk)
    num_neg_inf = draw(st.lists(st.integers(0, topk), min_size=num_req * depth, max_size=num_req * depth))
    logprobs = logprobs.sort(dim=-1, descending=True).values
    for row, count in enumerate(num_neg_inf):
        if count:
            logprobs.view(-1, topk)[row, topk - count :] = float("-inf")
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.stack([torch.randperm(vocab, generator=gen)[:topk] for _ in range(num_req * depth)])
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    return roots, logprobs, token_ids.view(num_req, depth, topk)
