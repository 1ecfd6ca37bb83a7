"""The draft of method 'ddtree' on vLLM's V2 model runner: DFlash's V2 speculator at the tree's depth,
its per-position top-K turned into best-first trees (docs/v2_runner.md, D6-D8). `DDTreeDraft` is the
tree step over any speculator of DFlash's family; `DDTreeSpeculator` the one over `DFlashSpeculator`
(DFlash2's: `v2/dflash2.py`).

vLLM's `DFlashSpeculator` is built from a copy of the engine config whose num_speculative_tokens is
depth = min(budget, block_size - 1), so its block, buffers and input kernel have the draft's shape; the
runner verifies up to `budget` nodes per request. `sample_draft` keeps the top-K log-probs of every
mask position and returns the rank-0 tokens (DFlash's chain); after the pass the host builds the trees
(`host_tree.build_draft_trees_on_host`, as V1). `propose` returns the trees' nodes in index order in
this speculator's own [max_num_reqs, budget] buffer, which the runner copies into the verify rows'
device drafts, and keeps the same nodes as host lists for the scheduler (`draft_lists`).

Before the pass the runner's `chain_view` puts each verify window's accepted path first at linear
positions, so DFlash's assumption holds that a window's accepted rows are its first ones and
`num_rejected` counts the rest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.core import DraftTree, TreeShape
from vllm_ddtree.vllm.config import DDTreeConfig
from vllm_ddtree.vllm.drafting import budget_policy_for, candidates_for, draft_max_depth, draft_top_k
from vllm_ddtree.vllm.host_tree import build_draft_trees_on_host


def _at_depth(vllm_config: Any, depth: int) -> Any:
    """A shallow copy of the engine config whose speculative config drafts `depth` positions."""
    config = copy.copy(vllm_config)
    speculative = copy.copy(vllm_config.speculative_config)
    speculative.num_speculative_tokens = depth
    config.speculative_config = speculative
    return config


class DDTreeDraft:
    """The tree step over a speculator of DFlash's family (the next class in the MRO), which keeps the
    step's candidates for `_build_trees`.

    budget_policy: chooses each step's shape (None: every step a tree of `ddtree.budget` nodes);
    last_shape: the shape of this step's drafts (`choose_shape`, called by the runner first);
    last_trees / draft_lists: the trees the last `propose` built and their nodes as lists (None / []
    for a step whose shape is off); chain_view: set by the runner, see the module docstring."""

    def __init__(self, vllm_config: Any, device: torch.device, ddtree: DDTreeConfig) -> None:
        max_depth = draft_max_depth(vllm_config.speculative_config.draft_model_config.hf_config)
        depth = min(ddtree.budget, max_depth)
        super().__init__(_at_depth(vllm_config, depth), device)
        self.ddtree = ddtree
        self.depth = depth
        self.tree_draft_tokens = torch.zeros(self.max_num_reqs, ddtree.budget, dtype=torch.int64, device=device)
        self.budget_policy = budget_policy_for(ddtree, max_depth)
        self.last_shape = TreeShape(ddtree.budget, ddtree.topk)
        self.last_trees: DraftTree | None = None
        self.draft_lists: list[list[int]] = []
        self.chain_view: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
        self._candidates = 1
        self._context_only = False

    def choose_shape(self, num_requests: int, context_tokens: float) -> TreeShape:
        """This step's tree shape (`last_shape`): the budget policy's choice for a batch of `num_requests`
        holding `context_tokens` tokens each on average, or the fixed shape without a policy."""
        if self.budget_policy is not None:
            self.last_shape = self.budget_policy.choose(num_requests, context_tokens)
        return self.last_shape

    @override
    def propose(
        self,
        input_batch: Any,
        attn_metadata: Any,
        slot_mappings: Any,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """DFlash's pass over the context in path order; returns [num_reqs, budget] drafts: each request's
        tree nodes in index order, root excluded (the rest of a row is never scheduled). A step whose
        shape is off stores the step's context K/V (what later drafts read) and skips the block pass
        (`_generate_draft`); it proposes nothing."""
        num_reqs = input_batch.num_reqs
        if kwargs.get("dummy_run", False):  # profiling and warm-up: DFlash's own pass at depth
            super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                            num_sampled, num_rejected, last_sampled, *args, **kwargs)
            return self.tree_draft_tokens[:num_reqs]
        if aux_hidden_states is not None and self.chain_view is not None:
            aux_hidden_states = self.chain_view(aux_hidden_states)
        shape = self.last_shape
        self._candidates = candidates_for(shape, self.ddtree.topk)
        self._context_only = shape.is_off
        try:
            super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                            num_sampled, num_rejected, last_sampled, *args, **kwargs)
        finally:
            self._context_only = False
        self.last_trees, self.draft_lists = None, [[] for _ in range(num_reqs)]
        if shape.is_off:
            return self.tree_draft_tokens[:num_reqs]
        roots = last_sampled[input_batch.idx_mapping].view(num_reqs).cpu()  # each request's last committed token
        trees = self._build_trees(roots, shape.budget)
        nodes = trees.token_ids[:, 1:]
        self.tree_draft_tokens[:num_reqs, : nodes.shape[1]].copy_(nodes, non_blocking=True)
        self.last_trees = trees
        self.draft_lists = [row[:size] for row, size in zip(nodes.tolist(), (trees.num_nodes - 1).tolist())]
        return self.tree_draft_tokens[:num_reqs]

    @override
    def _generate_draft(self, num_reqs: int, *args: Any, **kwargs: Any) -> None:
        """DFlash's block pass, skipped in a context-only step: `propose` stores the context K/V before
        it (eagerly on CPU; a FULL draft graph would replay the pass, which the CUDA layer must handle)."""
        if not self._context_only:
            super()._generate_draft(num_reqs, *args, **kwargs)

    def _build_trees(self, roots: torch.Tensor, budget: int) -> DraftTree:
        """The step's trees [num_reqs, budget + 1] on the host (the scheduler takes them as lists), chain
        tokens kept, from the candidates the block pass just kept (at most `_candidates` per depth);
        roots [num_reqs] host. Drops those candidates."""
        raise NotImplementedError


class DDTreeSpeculator(DDTreeDraft, DFlashSpeculator):
    """DDTree over DFlash: each mask position's top-K of the draft's logits, trees by the per-position
    marginals (`host_tree.build_draft_trees_on_host`)."""

    _top: tuple[torch.Tensor, torch.Tensor] | None = None

    @override
    def _build_trees(self, roots: torch.Tensor, budget: int) -> DraftTree:
        assert self._top is not None
        top_logprobs, top_token_ids = (t.view(roots.shape[0], self.depth, -1).cpu() for t in self._top)  # one copy
        self._top = None
        return build_draft_trees_on_host(roots, top_logprobs, top_token_ids, budget, with_chain=True)

    @override
    def sample_draft(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Keep the top-K draft log-probs of every mask position (rows request-major, depth-minor,
        `drafting.draft_top_k`) and return each position's rank-0 token (DFlash's chain)."""
        values, indices = draft_top_k(self.compute_draft_logits(hidden_states, 0), self._candidates)
        self._top = (values, indices)
        return indices[:, 0]
