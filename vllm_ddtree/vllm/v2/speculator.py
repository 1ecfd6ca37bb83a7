"""The draft of method 'ddtree' on vLLM's V2 model runner: DFlash's V2 speculator at the tree's depth,
its per-position top-K turned into best-first trees (docs/v2_runner.md, D6-D8). `DDTreeDraft` is the
tree step over any speculator of DFlash's family; `DDTreeSpeculator` the one over `DFlashSpeculator`
(DFlash2's: `v2/dflash2.py`).

vLLM's speculator is built from a copy of the engine config whose num_speculative_tokens is depth =
min(budget, block_size - 1), so its block, buffers and input kernel have the draft's shape; the runner
verifies up to `budget` nodes per request. DFlash's `sample_draft` keeps the top-K log-probs of every
mask position (K fixed at start, persistent buffers a FULL draft graph replays into) and returns the
rank-0 tokens (DFlash's chain); after the pass the host builds the trees from the K columns the step's
shape keeps (`host_tree.build_draft_trees_on_host`, as V1). `_num_graph_context_tokens` is raised to the
verify width (D6). `propose` returns the trees' nodes in index order in this speculator's own
[max_num_reqs, budget] buffer, which the runner copies into the verify rows' device drafts, and keeps
the same nodes as host lists for the scheduler (`draft_lists`).

Under tensor parallelism the trees come from TP rank 0's candidates and the shape from its policy
(D15, `rank_zero`); each rank's pass stores its own shard of the draft's context K/V.

Before the pass the runner's `chain_view` puts each verify window's accepted path first at linear
positions, so DFlash's assumption holds that a window's accepted rows are its first ones and
`num_rejected` counts the rest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from typing_extensions import override
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.core import DraftTree, TreeShape
from vllm_ddtree.vllm.config import DDTreeConfig
from vllm_ddtree.vllm.drafting import budget_policy_for, candidates_for, draft_max_depth, draft_top_k, narrow_top_k
from vllm_ddtree.vllm.host_tree import build_draft_trees_on_host
from vllm_ddtree.vllm.rank_zero import from_rank_zero, shape_from_rank_zero


def _at_depth(vllm_config: Any, depth: int) -> Any:
    """A shallow copy of the engine config whose speculative config drafts `depth` positions."""
    config = copy.copy(vllm_config)
    speculative = copy.copy(vllm_config.speculative_config)
    speculative.num_speculative_tokens = depth
    config.speculative_config = speculative
    return config


class StepTrees(NamedTuple):
    """The trees a block pass's candidates give, and the per-position top-K they came from (host), which
    a tree filter rebuilds some requests' trees from."""

    trees: DraftTree
    """[num_reqs, budget + 1] (chain tokens kept)."""
    top_logprobs: torch.Tensor
    """[num_reqs, depth, K] each position's candidates' log-probs under the draft head, best first."""
    top_token_ids: torch.Tensor
    """[num_reqs, depth, K] the candidates."""


class DDTreeDraft:
    """The tree step over a speculator of DFlash's family (the next class in the MRO), which keeps the
    step's candidates for `_build_trees`.

    budget_policy: chooses each step's shape (None: every step a tree of `ddtree.budget` nodes);
    last_shape: the shape of this step's drafts (`choose_shape`, called by the runner first);
    last_trees / draft_lists: the trees the last `propose` built and their nodes as lists (None / []
    for a step whose shape is off); chain_view, tree_filter: set by the runner, see the module
    docstring and the attribute."""

    def __init__(self, vllm_config: Any, device: torch.device, ddtree: DDTreeConfig | None = None) -> None:
        """ddtree: the engine's settings (None: read from its config, as where vLLM 0.34 builds this class
        from the registered `speculator_config.DDTreeSpeculatorConfig` with (vllm_config, device))."""
        ddtree = ddtree or DDTreeConfig.from_vllm_config(vllm_config)
        if ddtree is None:
            raise ValueError(f"{type(self).__name__} needs additional_config['ddtree'] (set by method 'ddtree')")
        max_depth = draft_max_depth(vllm_config.speculative_config.draft_model_config.hf_config)
        depth = min(ddtree.budget, max_depth)
        self.ddtree = ddtree  # before vLLM's __init__, which sizes buffers by `_num_graph_context_tokens`
        super().__init__(_at_depth(vllm_config, depth), device)
        self.depth = depth
        self.tree_draft_tokens = torch.zeros(self.max_num_reqs, ddtree.budget, dtype=torch.int64, device=device)
        self.budget_policy = budget_policy_for(ddtree, max_depth)
        self.last_shape = TreeShape(ddtree.budget, ddtree.topk)
        self.last_trees: DraftTree | None = None
        self.draft_lists: list[list[int]] = []
        self.chain_view: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
        self.tree_filter: Callable[[DraftTree, torch.Tensor, torch.Tensor, int], DraftTree] | None = None
        """Set by the runner: rebuilds some requests' trees from the step's top-K (structured outputs: only
        grammar-admitted candidates, `NodeGrammars.filtered_trees`)."""
        self._candidates = 1
        self._context_only = False

    def choose_shape(self, num_requests: int, context_tokens: float) -> TreeShape:
        """This step's tree shape (`last_shape`): the budget policy's choice for a batch of `num_requests`
        holding `context_tokens` tokens each on average (TP rank 0's on every rank), or the fixed shape
        without a policy."""
        if self.budget_policy is not None:
            self.last_shape = shape_from_rank_zero(self.budget_policy.choose(num_requests, context_tokens))
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
        """The draft's pass over the context in path order; returns [num_reqs, budget] drafts: each
        request's tree nodes in index order, root excluded (the rest of a row is never scheduled). A step
        whose shape is off stores the step's context K/V (what later drafts read) and skips the block pass
        (`_generate_draft`); it proposes nothing."""
        num_reqs = input_batch.num_reqs
        if kwargs.get("dummy_run", False):  # profiling and warm-up: the draft's own pass at depth
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
        trees, top_logprobs, top_token_ids = self._build_trees(roots, shape.budget)
        if self.tree_filter is not None:
            trees = self.tree_filter(trees, top_logprobs, top_token_ids, shape.budget)
        nodes = trees.token_ids[:, 1:]
        self.tree_draft_tokens[:num_reqs, : nodes.shape[1]].copy_(nodes, non_blocking=True)
        self.last_trees = trees
        self.draft_lists = [row[:size] for row, size in zip(nodes.tolist(), (trees.num_nodes - 1).tolist())]
        return self.tree_draft_tokens[:num_reqs]

    @override
    def _generate_draft(self, num_reqs: int, *args: Any, **kwargs: Any) -> None:
        """The block pass, skipped in an eager context-only step: `propose` stores the context K/V before
        it. A FULL draft graph replays the pass anyway; `propose` then ignores its candidates."""
        if not self._context_only:
            super()._generate_draft(num_reqs, *args, **kwargs)

    @override
    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        """The context rows a FULL draft graph stores: a uniform verify step's whole context, num_reqs x
        (1 + budget) rows (the verify width; vLLM's 1 + depth would store the rest eagerly before every
        replay)."""
        return min(num_reqs * (1 + self.ddtree.budget), self.max_num_tokens)

    def _build_trees(self, roots: torch.Tensor, budget: int) -> StepTrees:
        """The step's trees on the host (the scheduler takes them as lists) from the candidates the block
        pass just kept (at most `_candidates` per depth), TP rank 0's on every rank (`rank_zero`);
        roots [num_reqs] host."""
        raise NotImplementedError


class DDTreeSpeculator(DDTreeDraft, DFlashSpeculator):
    """DDTree over DFlash: each mask position's top-K of the draft's logits, trees by the per-position
    marginals (`host_tree.build_draft_trees_on_host`). top_logprobs / top_token_ids [max_num_reqs x depth,
    K]: the top-K, K fixed at start (the widest any shape keeps), in persistent buffers: a FULL draft
    graph replays `sample_draft` into the same memory."""

    def __init__(self, vllm_config: Any, device: torch.device, ddtree: DDTreeConfig | None = None) -> None:
        super().__init__(vllm_config, device, ddtree)
        num_candidates = min(candidates_for(TreeShape(self.ddtree.budget, self.ddtree.topk), self.ddtree.topk),
                             vllm_config.speculative_config.draft_model_config.get_vocab_size())
        rows = self.max_num_reqs * self.depth
        self.top_logprobs = torch.zeros(rows, num_candidates, dtype=torch.float32, device=device)
        self.top_token_ids = torch.zeros(rows, num_candidates, dtype=torch.int64, device=device)

    @override
    def _build_trees(self, roots: torch.Tensor, budget: int) -> StepTrees:
        num_reqs = roots.shape[0]
        rows = num_reqs * self.depth
        top = narrow_top_k(self.top_logprobs[:rows], self.top_token_ids[:rows], self._candidates)
        top_logprobs, top_token_ids = (from_rank_zero(t).view(num_reqs, self.depth, -1).cpu() for t in top)  # one copy
        return StepTrees(build_draft_trees_on_host(roots, top_logprobs, top_token_ids, budget, with_chain=True), top_logprobs, top_token_ids)

    @override
    def sample_draft(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Write the top-K draft log-probs and tokens of every mask position (rows request-major,
        depth-minor, `drafting.draft_top_k` at the fixed K) into the persistent `top_logprobs` /
        `top_token_ids`, and return each position's rank-0 token (DFlash's chain). Graph-safe: fixed
        shapes, no host read."""
        values, indices = draft_top_k(self.compute_draft_logits(hidden_states, 0), self.top_logprobs.shape[1])
        rows = values.shape[0]
        self.top_logprobs[:rows].copy_(values)
        self.top_token_ids[:rows].copy_(indices)
        return indices[:, 0]
