"""What both runner layers' drafts share: the DFlash draft's admission and tree depth, the budget policy
over its shapes, the candidates kept per depth, and each mask position's top-K of DFlash's logits."""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.core import BudgetPolicy, SamplingRegimes, TreeShape, candidate_shapes
from vllm_ddtree.vllm.config import DDTreeConfig


def draft_max_depth(hf_config: Any, reduced_vocab: bool = False) -> int:
    """The deepest tree the DFlash draft can propose (its block's mask positions, block_size - 1); raises
    for a draft method 'ddtree' cannot serve. reduced_vocab: the runner already knows the draft's
    vocabulary differs from the target's."""
    block_size = getattr(hf_config, "block_size", None)
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"method 'ddtree' needs a DFlash draft whose config has block_size >= 2, got {block_size!r}")
    if reduced_vocab or getattr(hf_config, "draft_vocab_size", None) not in (None, hf_config.vocab_size):
        raise NotImplementedError("method 'ddtree' does not support DFlash drafts with a reduced vocabulary")
    return block_size - 1


def budget_policy_for(ddtree: DDTreeConfig, max_depth: int) -> BudgetPolicy | None:
    """The adaptive policy over the shapes a budget of `ddtree.budget` allows at this depth (None: every
    step a tree of `ddtree.budget` nodes)."""
    return SamplingRegimes(candidate_shapes(ddtree.budget, min(ddtree.budget, max_depth))) if ddtree.adaptive else None


def candidates_for(shape: TreeShape, configured_topk: int | None) -> int:
    """Draft candidates kept per depth for trees of `shape`: no more than the tree's nodes, its shape's
    topk, or the configured topk."""
    return max(1, min(shape.budget, shape.topk or shape.budget, configured_topk or shape.budget))


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


def narrow_top_k(logprobs: torch.Tensor, token_ids: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `draft_top_k` gives for `candidates` from its result for a wider K ([rows, K], K >= candidates):
    the first columns (top-K is sorted; equal log-probs may rank otherwise), and for the chain the log-prob
    `draft_top_k` gives at K = 1: 0 where the maximum is finite, else -inf."""
    if candidates == 1 and logprobs.shape[1] > 1:
        first = logprobs[:, :1]
        return torch.where(first.isfinite(), 0.0, float("-inf")), token_ids[:, :1]
    return logprobs[:, :candidates], token_ids[:, :candidates]
