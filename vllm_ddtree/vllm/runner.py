"""vLLM's CPU model runner with DDTree: tree drafts, tree-masked verify, tree walk, KV compaction.

One engine step, for the requests whose drafts are trees (all others, and all-greedy steps whose drafts
are chains, run exactly as stock DFlash):
1. `_prepare_inputs`: vLLM lays out each request's 1 + n rows with linear KV slots; we set node i's
   RoPE position to start + depth(i) and remember the batch's trees (`TreeVerifyBatch`).
2. `_build_attention_metadata`: the target's CPU attention metadata gets the tree masks of the
   branching trees (a chain's mask is the causal one vLLM's kernel already applies).
3. `_sample`: the target's token at every node (`sampling.sample_nodes`: argmax for greedy requests,
   the core's exact sampling rule otherwise), the core's acceptance walk, output in
   vLLM's "accepted drafts + bonus, padded -1" form (so EOS, stop tokens, max_tokens, detokenization
   and the spec-decode metrics need nothing new), then KV compaction of the accepted nodes in every
   target layer: the k-th node of the accepted path moves to row start + k.
4. `propose_draft_token_ids`: the drafter's context rows are put in path order with linear positions,
   which is exactly the stock "accepted prefix + rejected padding" layout, so vLLM's DFlash input
   preparation runs unchanged; the proposer returns trees, handed to the scheduler as flat lists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.attention import Attention
from vllm.v1.outputs import SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_ddtree.core import (
    KVCompactionPlan,
    TreeAcceptance,
    TreeShape,
    accept_tree,
    chain_accepted,
    compact_rows_,
    kv_compaction_plan,
    nested_shapes,
)
from vllm_ddtree.vllm.attention import (
    DDTreeCPUAttentionImpl,
    DDTreeCPUAttentionMetadata,
)
from vllm_ddtree.vllm.config import DDTreeConfig
from vllm_ddtree.vllm.paged_kv import move_rows, probe_layout, row_index
from vllm_ddtree.vllm.proposer import DDTreeProposer
from vllm_ddtree.vllm.sampling import sample_nodes, tree_sampling_params
from vllm_ddtree.vllm.stage_times import (
    ACCEPTANCE,
    KV_COMPACTION,
    STEP,
    TARGET_FORWARD,
    TREE_BUILD,
    StageTimes,
)
from vllm_ddtree.vllm.verify import (
    ProposedTree,
    ScheduledTree,
    TreeVerifyBatch,
    VerifiedStep,
)


@dataclass
class StepClock:
    """One engine step as the adaptive budget sees it: batch size, the tree shape it verifies, start
    time, seconds until sampling ended, tokens committed, and accepted draft tokens per nested shape
    (the used shape's included; empty when the step verified no trees of ours)."""

    requests: int
    shape: TreeShape
    start: float
    busy: float = -1.0
    tokens: int = 0
    accepted: dict[TreeShape, int] = field(default_factory=dict)


class DDTreeModelRunner(CPUModelRunner):
    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        ddtree = DDTreeConfig.from_vllm_config(vllm_config)
        if ddtree is None:
            raise ValueError("DDTreeModelRunner needs additional_config['ddtree'] (set by method 'ddtree')")
        self.stage_times = StageTimes.from_env(device)
        self.drafter = DDTreeProposer(vllm_config, device, self, ddtree, self.stage_times)
        self._proposed: dict[str, ProposedTree] = {}
        self._verify: TreeVerifyBatch | None = None
        self._node_slots: torch.Tensor | None = None
        self._verified: VerifiedStep | None = None
        self._step_clock: StepClock | None = None  # adaptive budget: the step being timed

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self.uses_mrope:
            raise NotImplementedError("method 'ddtree' does not support target models with M-RoPE")
        for layer in self._target_attention_layers():
            if not isinstance(layer.impl, DDTreeCPUAttentionImpl):
                raise NotImplementedError("method 'ddtree' needs vLLM's CPU_ATTN attention backend for the target")
            layer.impl.check_tree_support()

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError(
                "method 'ddtree' needs the target and draft in one KV cache group (no hybrid or sliding-window models)"
            )

    # ---- stage timing (benchmarks: VLLM_DDTREE_STAGE_TIMES=1) -------------------------------------
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self.drafter.budget_policy is not None:
            self._clock_step(scheduler_output)
        with self.stage_times.stage(STEP):
            return super().execute_model(scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        with self.stage_times.stage(STEP):
            output = super().sample_tokens(*args, **kwargs)
        self.stage_times.end_step()
        if self._step_clock is not None:
            self._step_clock.busy = time.perf_counter() - self._step_clock.start
        return output

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.stage_times.stage(TARGET_FORWARD):
            return super()._model_forward(*args, **kwargs)

    # ---- adaptive budget: what each step's tree shape achieved ------------------------------------
    def _clock_step(self, scheduler_output: Any) -> None:
        """Report the previous step (the tree shape it verified, the tokens it committed, the time from
        its start to this one: the runner's work plus the engine's per-step overhead) to the budget
        policy, unless the engine sat idle in between or the step also prefilled prompt tokens (its time
        says nothing about the shape); start timing this step."""
        now = time.perf_counter()
        last = self._step_clock
        if last is not None and last.tokens > 0 and 0 <= last.busy and now - last.start < 2 * last.busy + 0.02:
            used = last.accepted.get(last.shape, 0)
            tokens = {shape: last.tokens - used + gain for shape, gain in last.accepted.items()} or {last.shape: last.tokens}
            self.drafter.budget_policy.observe(last.requests, last.shape, now - last.start, tokens)
        scheduled, drafts = scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens
        decode_only = all(count == 1 + len(drafts.get(req_id, ())) for req_id, count in scheduled.items())
        self._step_clock = StepClock(len(scheduled), self.drafter.last_shape, now) if scheduled and decode_only else None

    # ---- 1. verify inputs -------------------------------------------------------------------------
    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        with self.stage_times.stage(TREE_BUILD):
            self._prepare_tree_inputs(scheduler_output)
        return result

    def _prepare_tree_inputs(self, scheduler_output: Any) -> None:
        """Trees of this step's verify requests (`TreeVerifyBatch`), their RoPE positions and KV slots."""
        proposed, self._proposed = self._proposed, {}
        self._verify = self._node_slots = self._verified = None
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        if not scheduled:
            return
        if self.input_batch.all_greedy and self.drafter.last_shape.topk == 1:
            return  # greedy chains: vLLM's own DFlash verification is exact, needs no tree step and is cheapest
        first_rows = self.query_start_loc.np
        trees = []
        for req_id, draft_token_ids in scheduled.items():
            req_index = self.input_batch.req_id_to_index[req_id]
            start = int(self.input_batch.num_computed_tokens_cpu[req_index])
            trees.append(
                ScheduledTree(
                    req_index=req_index,
                    first_row=int(first_rows[req_index]),
                    start=start,
                    root_token_id=int(self.input_batch.token_ids_cpu[req_index, start]),
                    draft_token_ids=list(draft_token_ids),
                    proposed=proposed.get(req_id),
                )
            )
        trees.sort(key=lambda t: t.req_index)
        verify = TreeVerifyBatch.build(trees)
        rows, positions = verify.node_positions()
        self.positions[rows] = positions
        self._node_slots = self._slot_mapping()[verify.node_rows()]
        self._verify = verify

    def _slot_mapping(self) -> torch.Tensor:
        """This step's per-row KV slots (computed by vLLM's `_prepare_inputs`; one KV cache group)."""
        return self.input_batch.block_table[0].slot_mapping.cpu

    # ---- 2. tree masks for the target's attention ------------------------------------------------
    def _build_attention_metadata(self, *args: Any, **kwargs: Any):
        attn_metadata, spec_metadata = super()._build_attention_metadata(*args, **kwargs)
        if self._verify is None:
            return attn_metadata, spec_metadata
        with self.stage_times.stage(TREE_BUILD):
            block_table = self.input_batch.block_table[0]
            tree = self._verify.attention(block_table.get_cpu_tensor(), block_table.block_size)
            for metadata in attn_metadata.values():
                assert isinstance(metadata, DDTreeCPUAttentionMetadata)
                metadata.tree = tree
        return attn_metadata, spec_metadata

    # ---- 3. tree walk + KV compaction ------------------------------------------------------------
    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> SamplerOutput:
        with self.stage_times.stage(ACCEPTANCE):
            output = self._sample_trees(logits, spec_decode_metadata)
        if self._step_clock is not None:
            discarded = int(self.discard_request_mask.np[: self.input_batch.num_reqs].sum())
            self._step_clock.tokens = int((output.sampled_token_ids >= 0).sum()) - discarded
        return output

    def _sample_trees(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> SamplerOutput:
        """Rows without a tree (prefills, requests without drafts) keep vLLM's sampler, which also
        draws (and discards) a token for every tree request; tree nodes are sampled by the core's rule.

        Under tensor parallelism every rank holds the same (all-gathered) logits and builds the same
        trees, and the sampled tokens are broadcast from TP rank 0, so every rank commits the same
        tokens and reaches the same accepted path (each then compacts its own KV shard)."""
        verify, self._verify = self._verify, None
        with self._discarded_draws_undone():
            if verify is None or spec_decode_metadata is None:
                output = super()._sample(logits, spec_decode_metadata)
                get_tp_group().broadcast(output.sampled_token_ids, src=0)
                return output
            assert logits is not None
            plain = self.sampler(logits.index_select(0, spec_decode_metadata.bonus_logits_indices), self.input_batch.sampling_metadata)
        num_sampled = torch.tensor(spec_decode_metadata.num_draft_tokens) + 1
        first_logit_row = spec_decode_metadata.cu_num_sampled_tokens.long() - num_sampled
        node_offsets = verify.node_rows() - verify.first_rows.unsqueeze(1)
        params = tree_sampling_params(self.input_batch.sampling_metadata, verify.req_indices)
        node_logit_rows = first_logit_row[verify.req_indices].unsqueeze(1) + node_offsets
        draw_positions = verify.starts.unsqueeze(1) + verify.tree.depths + 1
        target = sample_nodes(logits, node_logit_rows, draw_positions, params)
        get_tp_group().broadcast(target, src=0)
        acceptance = accept_tree(verify.tree, target, verify.ancestor_mask)
        if self._step_clock is not None:
            self._step_clock.accepted = self._accepted_by_nested_shape(self._step_clock.shape, verify, acceptance)

        output = torch.full((num_sampled.shape[0], int(num_sampled.max())), -1, dtype=torch.int32)
        output[:, 0] = get_tp_group().broadcast(plain.sampled_token_ids[:, 0].contiguous(), src=0)
        output[verify.req_indices] = -1
        output[verify.req_indices, : acceptance.output_token_ids.shape[1]] = acceptance.output_token_ids.int()
        with self.stage_times.stage(KV_COMPACTION):
            plan = kv_compaction_plan(acceptance)
            self._compact_target_kv(plan)
        self._verified = VerifiedStep(verify, acceptance, plan)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=None)

    def _accepted_by_nested_shape(
        self, used: TreeShape, verify: TreeVerifyBatch, acceptance: TreeAcceptance
    ) -> dict[TreeShape, int]:
        """Accepted draft tokens of this step, and those of each smaller candidate whose tree is a prefix
        of this one (path nodes of index <= its budget), and of the chain when this step's trees reach
        its depth (`chain_accepted`), for the budget policy. Shapes larger than the smallest scheduled
        tree are left out (the scheduler may have cut trees)."""
        shapes = self.drafter.budget_policy.shapes
        smallest = int(verify.tree.num_nodes.min()) - 1
        nested = [shape for shape in nested_shapes(shapes, used) if shape == used or shape.budget <= smallest]
        chain = next((shape for shape in shapes if shape.topk == 1 and shape.budget > 0), None)
        with_chain = chain is not None and used.topk is None and chain.budget <= smallest
        path = acceptance.accepted_nodes[:, 1:].unsqueeze(-1)
        budgets = torch.tensor([shape.budget for shape in nested])
        counts = ((path > 0) & (path <= budgets)).sum((0, 1))  # one host sync for all shapes
        if with_chain:
            counts = torch.cat([counts, chain_accepted(verify.tree, acceptance.accepted_nodes, chain.budget).sum().view(1)])
            nested.append(chain)
        return dict(zip(nested, counts.tolist()))

    def _discarded_generators(self) -> dict[int, torch.Generator]:
        """Generators of this step's requests whose sampled token vLLM discards (partial prefills)."""
        num_reqs = self.input_batch.num_reqs
        generators = self.input_batch.generators
        return {int(i): generators[int(i)] for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0] if int(i) in generators}

    @contextmanager
    def _discarded_draws_undone(self) -> Iterator[None]:
        """Restore the generators of discarded rows after sampling, so a seeded request's tokens do not
        depend on how its prompt was chunked. (vLLM rewinds them in `_bookkeeping_sync` with
        `Generator.set_offset`, which CPU generators lack: the stock CPU runner crashes there.)"""
        states = {i: g.get_state() for i, g in self._discarded_generators().items()}
        try:
            yield
        finally:
            for i, state in states.items():
                self.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's bookkeeping with the discarded rows' generators hidden from its offset rewind (already
        undone by `_discarded_draws_undone`)."""
        hidden = self._discarded_generators()
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    def _compact_target_kv(self, plan: KVCompactionPlan) -> None:
        """Move the accepted nodes' K/V to rows start + k in every target layer (the draft's layers
        are rewritten from the context on the next draft pass)."""
        if not bool(plan.is_move.any()):
            return
        assert self._node_slots is not None
        src = self._node_slots.gather(1, plan.src_offsets)[plan.is_move]
        dst = self._node_slots.gather(1, plan.dst_offsets)[plan.is_move]
        indices: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self._target_attention_layers():
            kv_cache = layer.kv_cache
            layout = probe_layout(layer.isa, kv_cache.shape[2], layer.head_size, kv_cache.dtype)
            key = (id(layout), layer.num_kv_heads)
            if key not in indices:
                indices[key] = (row_index(layout, src, layer.num_kv_heads), row_index(layout, dst, layer.num_kv_heads))
            move_rows(kv_cache, *indices[key])

    def _target_attention_layers(self) -> list[Attention]:
        draft_layers = self.drafter._draft_attn_layer_names
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        return [layer for name, layer in layers.items() if name not in draft_layers]

    # ---- 4. draft context in path order, then the DFlash draft ------------------------------------
    def propose_draft_token_ids(
        self,
        scheduler_output: Any,
        sampled_token_ids: Any,
        sampling_metadata: Any,
        hidden_states: torch.Tensor,
        sample_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        spec_decode_metadata: Any,
        common_attn_metadata: Any,
        slot_mappings: Any,
    ) -> list[list[int]]:
        verified, self._verified = self._verified, None
        if verified is not None:
            assert aux_hidden_states is not None
            with self.stage_times.stage(KV_COMPACTION):
                aux_hidden_states = self._path_first(verified.batch, verified.plan, aux_hidden_states)
        drafts = super().propose_draft_token_ids(
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            slot_mappings,
        )
        trees = self.drafter.last_trees
        if trees is not None:
            with self.stage_times.stage(TREE_BUILD):
                self._proposed = dict(zip(self.input_batch.req_ids, ProposedTree.unbatch(trees)))
        return drafts

    def _path_first(
        self, verify: TreeVerifyBatch, plan: KVCompactionPlan, aux_hidden_states: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Rewrite each verify window as root + accepted nodes (path order) then the rest, at linear
        positions: row first_row + k holds the k-th path node. The drafter then sees the layout of an
        accepted chain prefix followed by rejected padding, which vLLM's DFlash code already handles."""
        rows, positions = verify.linear_positions()
        self.positions[rows] = positions
        if not bool(plan.is_move.any()):  # every accepted path already sits in path order (chains)
            return aux_hidden_states
        src, dst = plan.rows(verify.first_rows)
        moves = plan.is_move.flatten()
        reordered = []
        for states in aux_hidden_states:
            states = states.clone()
            compact_rows_(states, src[moves], dst[moves])
            reordered.append(states)
        return reordered
