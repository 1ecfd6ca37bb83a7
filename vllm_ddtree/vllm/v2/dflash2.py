"""The draft of method 'ddtree' over a DFlash2 draft on vLLM's V2 model runner: `DFlash2Speculator`
(its local convolutions and candidate selector) at the tree's depth, its candidates turned into
best-first trees by the tree step DFlash's shares (`speculator.DDTreeDraft`).

DFlash2's block pass gives every mask position K = selector_top_k candidate tokens (the draft head's
top-K, best first) and the selector's scores of each candidate after each candidate of the previous
position (the anchor, the last committed token, before the first): [R, L, K, K]. vLLM walks them into
one chain (`CandidateSampler`); here they become a tree under `ddtree.scoring` instead, and the walk does
not run (`TreeCandidates`):
- "marginal": as DFlash, a node's score is the sum of its tokens' per-position log-probabilities under
  the draft head (a log_softmax over the vocabulary, read at the candidates);
- "selector": a node's score is its path's log-probability under the selector's transitions
  (`core.transition_tree`): at each position, the head's probability that the token is among the K
  candidates times the selector's distribution over them given the previous candidate (a softmax over
  each row's K scores). Its rank-0 path is vLLM's greedy walk; a selector that adds nothing to the
  head's logits gives the marginals (softmax over K of the head's logits times their mass is the head's
  probability).
Either way each node keeps at most `_candidates` children (the step's shape and `ddtree_topk`), and
never more than K. The verify rule does not read the scores: any tree is exact.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from typing_extensions import override
from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import CandidateSampler, DFlash2Speculator

from vllm_ddtree.core.transition_tree import build_transition_trees
from vllm_ddtree.vllm.config import DFLASH2_ARCHITECTURE, DFLASH2_DEFAULT_SCORING, SELECTOR_SCORING, DDTreeConfig
from vllm_ddtree.vllm.host_tree import build_draft_trees_on_host
from vllm_ddtree.vllm.rank_zero import from_rank_zero
from vllm_ddtree.vllm.v2.speculator import DDTreeDraft, DDTreeSpeculator, StepTrees

logger = logging.getLogger("vllm.ddtree")


class TreeCandidates(CandidateSampler):
    """DFlash2's candidate sampler without its walk: the trees replace the chain it would draw (into
    draft tokens nobody reads here; the verify rule never reads draft probabilities either)."""

    @override
    def sample(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: `DDTreeDFlash2Speculator._score_candidates` kept the candidates for the trees."""


class DDTreeDFlash2Speculator(DDTreeDraft, DFlash2Speculator):
    """scoring: SELECTOR_SCORING or MARGINAL_SCORING (`ddtree.scoring`, else DFLASH2_DEFAULT_SCORING);
    _kept: the last block pass's (candidate ids [R, L, K], their per-position log-probs [R, L, K],
    transition log-probs [R, L, K, K] under selector scoring, else None), device tensors, until
    `_build_trees`."""

    _kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def __init__(self, vllm_config: Any, device: torch.device, ddtree: DDTreeConfig | None = None) -> None:
        super().__init__(vllm_config, device, ddtree)
        self.scoring = self.ddtree.scoring or DFLASH2_DEFAULT_SCORING
        self.candidate_sampler = TreeCandidates(self.max_num_reqs, self.num_speculative_steps, self.top_k, device)
        logger.info("vllm_ddtree: DFlash2 draft, %d candidates per position; trees scored by %s (ddtree_scoring)", self.top_k, self.scoring)

    @override
    def _score_candidates(self, candidate_ids: torch.Tensor, unary_logits: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's selector scores [R, L, K, K], returned as its block pass expects, with the trees' scores
        of the same candidates kept (`_kept`). hidden_states [R, L, hidden]: the mask positions' outputs."""
        scores = super()._score_candidates(candidate_ids, unary_logits, hidden_states)
        logits = self.model.candidate_logits_processor(self.model.lm_head, hidden_states.flatten(0, 1))
        logprobs = logits.float().log_softmax(-1).gather(1, candidate_ids.flatten(0, 1)).view_as(unary_logits)
        transitions = None
        if self.scoring == SELECTOR_SCORING:  # log(mass of the K candidates) + log_softmax over them
            transitions = scores.float().log_softmax(-1) + logprobs.logsumexp(-1)[:, :, None, None]
        self._kept = (candidate_ids, logprobs, transitions)
        return scores

    @override
    def _build_trees(self, roots: torch.Tensor, budget: int) -> StepTrees:
        assert self._kept is not None
        # TP rank 0's candidates and scores on every rank (`rank_zero`), one copy each
        candidate_ids, logprobs, transitions = (None if t is None else from_rank_zero(t).cpu() for t in self._kept)
        self._kept = None
        topk = min(self._candidates, self.top_k)
        # The head's top-K comes best first; its log-probs are a monotone image of the ranked values.
        top_logprobs, top_token_ids = logprobs[..., :topk].contiguous(), candidate_ids[..., :topk].contiguous()
        if transitions is not None:
            trees = build_transition_trees(roots, candidate_ids, transitions, budget, topk, with_chain=True)
        else:
            trees = build_draft_trees_on_host(roots, top_logprobs, top_token_ids, budget, with_chain=True)
        return StepTrees(trees, top_logprobs, top_token_ids)


def speculator_class(vllm_config: Any) -> type[DDTreeDraft]:
    """The tree step over the speculator vLLM's V2 runner chooses for the engine's draft
    (`spec_decode.init_speculator`: DFlash2's by the draft's architecture, else DFlash's)."""
    architectures = vllm_config.speculative_config.draft_model_config.architectures or []
    return DDTreeDFlash2Speculator if DFLASH2_ARCHITECTURE in architectures else DDTreeSpeculator
