"""DDTree proposer: vLLM's DFlash draft pass, kept as per-position top-k, turned into best-first trees.

The draft pass is vLLM's `DFlashProposer` unchanged (KV injection of the target's hidden states, one
non-causal pass over [anchor, MASK x depth]); only the sampling of its logits differs: instead of one
argmax per position we keep the top-K log-probabilities, and `vllm_ddtree.core.build_draft_trees`
(compiled for the host: `host_tree.build_draft_trees_on_host`) turns them into one tree per request
under the step's node budget. The draft runs depth = min(budget, block_size - 1) mask positions: the
deepest a tree of that budget can reach, and no more KV lookahead than vLLM reserves for DFlash with
the same num_speculative_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import override
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.core import DraftTree, TreeShape, unreadable_context_rows
from vllm_ddtree.vllm.config import DDTreeConfig
from vllm_ddtree.vllm.deferred_context import DeferredContext, rows_in_blocks
from vllm_ddtree.vllm.drafting import budget_policy_for, candidates_for, draft_max_depth, draft_top_k
from vllm_ddtree.vllm.host_tree import build_draft_trees_on_host
from vllm_ddtree.vllm.rank_zero import from_rank_zero, shape_from_rank_zero
from vllm_ddtree.vllm.stage_times import DRAFT_FORWARD, DRAFT_TOPK, TREE_BUILD, StageTimes


DEFERRED_BYTES = 8 * 2**20
"""Deferred context (the target's hidden states) held at most before a store pass (`DDTreeProposer.defer_context`):
4096 rows of the embedded pair, about 200 of an 8B target's 5 x 4096 bf16 features."""


class DDTreeProposer(DFlashProposer):
    def __init__(
        self, vllm_config: Any, device: torch.device, runner: Any, ddtree: DDTreeConfig, stage_times: StageTimes
    ) -> None:
        super().__init__(vllm_config, device, runner)
        self.max_depth = draft_max_depth(self.draft_model_config.hf_config, reduced_vocab=self.use_heterogeneous_vocab)
        self.ddtree = ddtree
        self.stage_times = stage_times
        self._top: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_trees: DraftTree | None = None
        self.tree_filter: Callable[[DraftTree, torch.Tensor, torch.Tensor, int], DraftTree] | None = None
        """Set by the runner: rebuilds some requests' trees from the same top-k (structured outputs:
        only grammar-admitted candidates, `NodeGrammars.filtered_trees`)."""
        self.budget_policy = budget_policy_for(ddtree, self.max_depth)
        self.last_shape = TreeShape(ddtree.budget, ddtree.topk)
        self._candidates = 1
        self._deferred = DeferredContext()
        """Context rows of steps without speculation not yet stored, written by `store_deferred_context`."""
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)

    def choose_shape(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        """This step's tree shape, `last_shape`: the budget policy's choice for a batch of `num_requests`
        holding `context_tokens` tokens each on average (TP rank 0's on every rank), or the fixed shape
        without a policy."""
        if self.budget_policy is not None:
            self.last_shape = shape_from_rank_zero(self.budget_policy.choose(num_requests, context_tokens))
        return self.last_shape

    def candidates_for(self, shape: TreeShape) -> int:
        """Draft candidates kept per depth for trees of `shape` (the top-k `_sample_draft_tokens` takes): no
        more than the tree's nodes, its shape's topk, or the configured topk."""
        return candidates_for(shape, self.ddtree.topk)

    @override
    def propose(self, num_speculative_tokens: int, *, next_token_ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
        """Run the draft and return each request's tree nodes in index order, root excluded.

        num_speculative_tokens is the configured tree budget (the cap); the trees have the step's
        `last_shape` (`choose_shape`, called by the runner first); next_token_ids [R] are the roots (each
        request's last committed token); the other arguments are DFlashProposer.propose's. `last_trees`
        keeps the trees built (None when the step's budget is 0).
        """
        depth = min(num_speculative_tokens, self.max_depth)
        shape = self.last_shape
        self._candidates = self.candidates_for(shape)
        self._top = None
        self.last_trees = None
        if shape.is_off:
            with self.stage_times.stage(DRAFT_FORWARD):
                self._store_context_only(depth, next_token_ids=next_token_ids, **kwargs)
            return [[] for _ in range(next_token_ids.shape[0])]
        with self.stage_times.stage(DRAFT_FORWARD):
            self.store_deferred_context()  # the draft pass reads the whole context
            super().propose(num_speculative_tokens=depth, next_token_ids=next_token_ids, **kwargs)
        assert self._top is not None
        with self.stage_times.stage(TREE_BUILD):
            # Trees are built and kept on the host (the scheduler takes them as lists anyway): one copy of
            # the top-k, a no-op on CPU.
            top_logprobs, top_token_ids = (from_rank_zero(t).view(next_token_ids.shape[0], depth, -1).cpu() for t in self._top)
            # the trees keep the draft's chain; a tree a grammar rebuilt does not (its chain is not the
            # draft's rank-0 tokens)
            trees = build_draft_trees_on_host(next_token_ids.long().cpu(), top_logprobs, top_token_ids, shape.budget, with_chain=True)
            if self.tree_filter is not None:
                trees = self.tree_filter(trees, top_logprobs, top_token_ids, shape.budget)
            self.last_trees = trees
            sizes = (trees.num_nodes - 1).tolist()
            return [nodes[:size] for nodes, size in zip(trees.token_ids[:, 1:].tolist(), sizes)]

    def _store_context_only(
        self,
        depth: int,
        *,
        next_token_ids: torch.Tensor,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        **_: Any,
    ) -> None:
        """A step without speculation after a verify step (the runner defers the context of one after a
        step without drafts itself, `defer_context`): only what the draft needs to resume. DFlash keeps
        the committed tokens' context as K/V computed from the target's hidden states (KV injection);
        store them for the tokens the target just computed, exactly as the first part of a full draft
        pass does, and skip the rest: no pass over the mask block, no draft LM head, no top-k.
        `set_inputs_first_pass` lays the verify rows out (rejected nodes get no slot), as in a full
        draft pass, and they are stored at once."""
        self.store_deferred_context()  # none held after a verify step; were there, they are older rows of the same blocks
        self.num_speculative_tokens = depth
        num_context = target_hidden_states.shape[0]
        hidden_states = self.model.combine_hidden_states(target_hidden_states)
        self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=hidden_states,
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        positions = self._context_positions_buffer[:num_context]
        slots = self._context_slot_mapping_buffer[:num_context]
        self.model.precompute_and_store_context_kv(hidden_states, positions, slots)

    @property
    def deferred_rows(self) -> int:
        """Context rows deferred and not yet stored."""
        return self._deferred.rows - self._deferred.removed

    def defer_context(self, parts: Sequence[torch.Tensor], count: int, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep the first `count` context rows of a step without drafts for `store_deferred_context`: the
        target's hidden states, given as feature-wise parts (the aux layers' outputs [>= count, hidden]),
        positions and KV slots [>= count] (copied: views of buffers the next step rewrites). Every row of
        such a step is context at its own position and KV slot (target and draft share one KV cache
        group, hence one block table), so the target's positions and slot mapping serve as they are;
        the rows are stored together with other steps' rows in one pass before the next draft pass,
        when their request finishes or is preempted (those in its blocks only, less the rows no request
        can read: `store_deferred_context`), or before more than DEFERRED_BYTES would wait (one pass over many steps' rows costs about what
        one step's pass did); a step's rows beyond that are stored at once."""
        row_bytes = DeferredContext.row_bytes(parts)
        if (self._deferred.rows + count) * row_bytes > DEFERRED_BYTES:
            self.store_deferred_context()
            if count * row_bytes > DEFERRED_BYTES:
                self._store_context(torch.cat([part[:count] for part in parts], dim=-1), positions[:count], slots[:count])
                return
        self._deferred.add(parts, count, positions, slots)

    def store_deferred_context(self, freed_blocks: Sequence[Sequence[int]] | None = None) -> None:
        """Store deferred context rows of steps without speculation in one pass (no-op if none): every row
        held (`freed_blocks` None), or only the rows in the KV blocks of `freed_blocks`, the block tables
        of the requests that finished or were preempted since the last step, less those no request can
        read (their last, partial block's rows; all their rows with prefix caching off:
        `unreadable_context_rows`), which are dropped; the other requests' rows stay held.

        Every row held must be stored before a draft pass reads the context (`propose` stores them all
        first) and stored or dropped before its KV block can be given to another request (the runner
        passes the freed requests' tables when requests finish or are preempted). Nothing else need
        wait: a block a request holds changes hands only after the request finishes or is preempted,
        so an arrival's new blocks hold no rows, and a prefix-cache hit reads a running request's full
        block only in a draft pass. So a block's rows held are always the last rows written to it,
        which `unreadable_context_rows` needs: rows are taken all at once or by whole blocks."""
        if not self.deferred_rows:
            return
        if freed_blocks is None:
            held = self._deferred.take()
            assert held is not None
            states, positions, slots = held
        else:
            positions, slots = self._deferred.indices()
            freed = rows_in_blocks(slots, freed_blocks, self.block_size)
            if not bool(freed.any()):
                return
            readable = freed & ~unreadable_context_rows(positions, slots, freed_blocks, self.block_size, self._prefix_caching)
            states, positions, slots = self._deferred.rows_where(readable)
            self._deferred.remove_where(freed)
        if positions.numel():
            self._store_context(states, positions, slots)

    def _store_context(self, target_hidden_states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the draft's context K/V for these rows (DFlash's KV injection)."""
        self.model.precompute_and_store_context_kv(self.model.combine_hidden_states(target_hidden_states), positions, slots)

    @override
    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> tuple[torch.Tensor, None]:
        """Keep the top-K draft log-probs of every mask position (rows request-major, depth-minor,
        `drafting.draft_top_k`)."""
        logits = self.model.compute_logits(hidden_states)
        with self.stage_times.stage(DRAFT_TOPK):
            values, indices = draft_top_k(logits, self._candidates)
        self._top = (values, indices)
        return indices[:, 0], None
