"""What both runner layers' drafts do with DFlash's logits: keep each mask position's top-K."""

from __future__ import annotations

import torch


def draft_top_k(logits: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, token ids) [rows, K] of the top K = min(candidates, vocab) tokens of every draft row.
    For the chain (K = 1), each row's first maximal token, and for its log-prob 0 where the maximum is
    finite, else -inf: a chain is cut at the first depth whose log-prob is -inf (or NaN: no finite
    maximum) and its log-probs say nothing else, so no log-sum-exp over the vocabulary is taken."""
    logits = logits.float()
    if candidates == 1:
        best = logits.max(dim=-1, keepdim=True)
        return torch.where(best.values.isfinite(), 0.0, float("-inf")), best.indices
    return logits.log_softmax(dim=-1).topk(min(candidates, logits.shape[-1]), dim=-1)
