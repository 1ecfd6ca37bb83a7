"""Method 'ddtree' on vLLM's V1 model runner, platform-neutral: one `TreeStep` per engine step.

A step reads as: build the step's trees (`_prepare_inputs`) -> the target's verify forward with tree
masks (`_build_attention_metadata`, the platform's attention) -> sample every node and walk the trees
(`_sample`) -> compact the accepted nodes' KV -> put the drafter's context in path order and draft the
next trees (`propose_draft_token_ids`). `tree_step.py` states the step object's lifecycle.

A plain step is vLLM's plain decoding step: a step without drafts, after which the budget policy runs
no speculation, whose batch needs no history-dependent option, grammar or logprobs
(`sampling.plain_layout_serves`). For that step the runner reports no speculative config to vLLM's
step code (`speculative_config`), so vLLM runs exactly its code without speculation (no spec-decode
metadata, no drafting path) and none of the tree hooks build anything; its one logits row per request
is drawn by vLLM's sampler where that serves (below), else by the core rule (`_sample_plain_rows`), and
the runner keeps the step's context rows for the draft (`DDTreeProposer.defer_context`). So a step
that may be plain chooses the shape of the next step's drafts when it starts (`_choose_next_shape`);
every other step chooses it when it drafts.

Every token of a step with drafts comes from the core's sampling rule (`vllm_ddtree.core.sampling`),
tree nodes and the bonus token alike; vLLM's rejection sampler never runs. A step without drafts
(prefill, a step the budget policy runs without speculation) is plain decoding: vLLM's own sampler
draws it when the batch has no request whose tokens must not depend on the policy (seeded: the core
rule keys a seeded request's token at position p by (seed, p), whatever the trees, the batch or the
policy did) or whose options only the core rule serves (`sampling.plain_sampler_serves`); the core
rule otherwise.

The platform layer (`cpu_runner.py`) supplies what differs per device: the KV slots of this step's
rows, the tree attention metadata, moving K/V rows in the paged cache, and the attention check.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from typing_extensions import override
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.outputs import DraftTokenIds, SamplerOutput
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_ddtree.core import (
    BudgetPolicy,
    SamplingRegimes,
    StepClock,
    TreeShape,
    kv_compaction_plan,
)
from vllm_ddtree.core.sampling import argmax_first
from vllm_ddtree.vllm import host_tree
from vllm_ddtree.vllm.config import DDTreeConfig
from vllm_ddtree.vllm.logprobs import emitted_logprobs
from vllm_ddtree.vllm.node_grammar import NodeGrammars
from vllm_ddtree.vllm.node_logits import process_node_logits
from vllm_ddtree.vllm.options import RequestOptions
from vllm_ddtree.vllm.rank_zero import from_rank_zero
from vllm_ddtree.vllm.sampling import gather_node_logits, plain_layout_serves, plain_sampler_serves, sample_nodes
from vllm_ddtree.vllm.stage_times import (
    ACCEPTANCE,
    KV_COMPACTION,
    STEP,
    TARGET_FORWARD,
    TREE_BUILD,
    StageTimes,
)
from vllm_ddtree.vllm.steps import accepted_by_shape, kv_slot_moves, path_first, verified_tokens, walk
from vllm_ddtree.vllm.tree_step import Proposals, TreeRows, TreeStep
from vllm_ddtree.vllm.v1.gdn import attach_gdn_trees, compact_gdn_states, kv_cache_group_kinds
from vllm_ddtree.vllm.v1.options import read_v1_options
from vllm_ddtree.vllm.v1.proposer import DDTreeProposer
from vllm_ddtree.vllm.v1.startup_costs import seed_budget_policy

logger = logging.getLogger("vllm.ddtree")


def _freed_req_ids(scheduler_output: Any) -> set[str]:
    """The requests whose KV blocks were freed since the last step (they finished or were preempted):
    their blocks may be given to other requests in this step, so the deferred draft context in them
    must be stored (or, where no request can read it, dropped) first. An arriving or resumed request
    gets only blocks that were free (settled when freed) or full cached blocks that nothing writes."""
    return scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())


class DDTreeRunnerMixin:
    """DDTree hooks over a vLLM V1 model runner (`GPUModelRunner` or its subclass `CPUModelRunner`).

    step: this step's `TreeStep` (replaced at the next `_prepare_inputs`); clock: feeds the budget
    policy (None for a fixed budget); num_chain_fallbacks: requests verified as a chain because their
    scheduled drafts were not their proposed tree (expected 0).
    """

    _plain_step = False
    """This step is vLLM's plain decoding step (module docstring). A class default: vLLM's __init__ reads
    `speculative_config` before ours runs."""

    options: RequestOptions
    """This step's request options, read from vLLM's batch when the step starts (`_prepare_inputs`)."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        ddtree = DDTreeConfig.from_vllm_config(vllm_config)
        if ddtree is None:
            raise ValueError("the DDTree model runner needs additional_config['ddtree'] (set by method 'ddtree')")
        self.stage_times = StageTimes.from_env(device)
        self.drafter = DDTreeProposer(vllm_config, device, self, ddtree, self.stage_times)
        self.step: TreeStep | None = None
        self._proposals = Proposals()
        self.node_grammars = NodeGrammars(vllm_config)
        self.drafter.tree_filter = self._grammar_filtered_trees
        self.clock: StepClock | None = None
        self._context_tokens = 0.0
        """Context tokens per request of the batch the last shape was chosen for (`_choose_next_shape`)."""
        self.num_chain_fallbacks = 0
        self._serve_min_p_and_logit_bias()
        self._drafted = False  # whether this step's drafter ran (vLLM skips it near max_model_len)
        self._next_shape_chosen = False  # this step already chose the next step's shape (`_choose_next_shape`)
        self._step_shape = self.drafter.last_shape  # the shape this step's drafts were drafted for
        self._vllm_samples = False  # this step has no drafts and vLLM's sampler serves its batch
        self._plain_draw_positions = torch.zeros(0, 1, dtype=torch.long)
        """[R, 1] the position each request of a seeded plain step draws (`_sample_plain_rows`)."""
        self._plain_rows: dict[int, torch.Tensor] = {}
        """[R, 1] row r of a plain step's logits is request r's, by batch size R (`_sample_plain_rows`)."""
        self._no_draft_indices: dict[int, tuple[torch.Tensor, ...]] = {}
        """The spec-decode metadata's index tensors of a step without drafts, by batch size."""
        if self.drafter.budget_policy is not None:
            self.use_budget_policy(self.drafter.budget_policy)

    def _serve_min_p_and_logit_bias(self) -> None:
        """Add vLLM's own min_p and logit_bias processors to the batch's: vLLM builds only min_tokens
        under speculative decoding (its rejection sampler applies no others), but every tree node's
        distribution here is processed as plain decoding's (`node_logits`, the core's min_p)."""
        logitsprocs = self.input_batch.logitsprocs
        built = (MinPLogitsProcessor(self.vllm_config, self.device, False), LogitBiasLogitsProcessor(self.vllm_config, self.device, False))
        self.input_batch.logitsprocs = LogitsProcessors([*logitsprocs.all, *built])

    @property
    def speculative_config(self) -> Any:
        """vLLM's speculative config, None during a plain step: vLLM's step code reads it to choose
        between its paths with and without speculation."""
        return None if self._plain_step else self._speculative_config

    @speculative_config.setter
    def speculative_config(self, value: Any) -> None:
        self._speculative_config = value

    startup_costs: dict[tuple[int, TreeShape], float] | None = None
    """Step costs timed when the engine started, seconds[(batch size, shape)] (`time_startup_costs`);
    None when not timed (no adaptive policy)."""
    startup_seconds = 0.0
    """How long that timing took."""

    def time_startup_costs(self) -> None:
        """Time the step costs of the budget policy's shapes and start the policy from them
        (`startup_costs.seed_budget_policy`). The worker calls it once the KV cache is allocated and vLLM's
        warm-up is done; without an adaptive policy it does nothing."""
        timed = seed_budget_policy(self)
        if timed is not None:
            self.startup_costs, self.startup_seconds = timed

    def use_budget_policy(self, policy: BudgetPolicy) -> None:
        """Let `policy` choose every step's tree shape from now on, fed with this runner's steps."""
        self.drafter.budget_policy = policy
        self.clock = StepClock(policy)

    # ---- platform layer ----------------------------------------------------------------------------
    _moves_kv_on_host = False
    """The platform's KV cache lives on the host: `_move_kv_rows` gets the real moves only (read on the
    host); else every plan entry, identity ones included (fixed shapes, nothing read back)."""

    def _step_slot_mapping(self) -> torch.Tensor:
        """This step's per-row KV slots (computed by vLLM's `_prepare_inputs`; one KV cache group)."""
        raise NotImplementedError

    def _attach_tree_attention(self, attn_metadata: dict[str, Any], rows: TreeRows) -> None:
        """Give the target's attention metadata the masks of this step's branching trees."""
        raise NotImplementedError

    def _move_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the K/V at `src_slots` to `dst_slots` [M] in every target attention layer."""
        raise NotImplementedError

    def _check_target_attention(self, layer: Attention) -> None:
        """Raise unless the target layer's attention can run tree masks."""
        raise NotImplementedError

    # ---- set-up ------------------------------------------------------------------------------------
    @override
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        for layer in self._target_attention_layers():
            self._check_target_attention(layer)
        host_tree.warm_up()  # compiled now, not in the first steps the budget policy times

    @override
    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self.attention_group, self.gdn_groups = kv_cache_group_kinds(kv_cache_config)

    def _target_attention_layers(self) -> list[Attention]:
        draft_layers = self.drafter._draft_attn_layer_names
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        return [layer for name, layer in layers.items() if name not in draft_layers]

    # ---- the step ----------------------------------------------------------------------------------
    @override
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._drafted = False
        self._plain_step = self._next_shape_chosen = False
        self._step_shape = self.drafter.last_shape
        freed = _freed_req_ids(scheduler_output)
        if freed and self.drafter.deferred_rows:  # before vLLM drops the finished requests' states
            gid = self.drafter.kv_cache_gid
            self.drafter.store_deferred_context([self.requests[r].block_ids[gid] for r in freed if r in self.requests])
        if self.clock is not None:
            if scheduler_output.scheduled_new_reqs:
                self.clock.policy.requests_arrived(len(scheduler_output.num_scheduled_tokens))
            # every request decodes (1 + its drafts): each is scheduled at least that many, so the sums tell
            num_reqs = len(scheduler_output.num_scheduled_tokens)
            num_drafts = sum(map(len, scheduler_output.scheduled_spec_decode_tokens.values()))
            decode_only = scheduler_output.total_num_scheduled_tokens == num_reqs + num_drafts
            self.clock.step_started(time.perf_counter(), num_reqs, self._step_shape, decode_only, self._context_tokens)
        with self.stage_times.stage(STEP):
            return super().execute_model(scheduler_output, *args, **kwargs)

    @override
    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        state = self.execute_model_state if self._plain_step else None
        try:
            with self.stage_times.stage(STEP):
                output = super().sample_tokens(*args, **kwargs)
                if state is not None:  # vLLM ran no drafting path: keep the step's context for the draft
                    count = state.scheduler_output.total_num_scheduled_tokens
                    self._defer_context(count, state.hidden_states, state.aux_hidden_states, self._step_slot_mapping())
        finally:
            self._plain_step = False
        self.stage_times.end_step()
        if self.clock is not None:
            self.clock.step_ended(time.perf_counter())
        return output

    @override
    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.stage_times.stage(TARGET_FORWARD):
            return super()._model_forward(*args, **kwargs)

    @override
    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        # vLLM's `_update_states` has brought the batch and its sampling metadata up to date
        self._proposals.drop(scheduler_output.finished_req_ids)
        self.node_grammars.drop(scheduler_output.finished_req_ids)
        self.node_grammars.note_new_requests(scheduler_output.scheduled_new_reqs)
        has_drafts = any(scheduler_output.scheduled_spec_decode_tokens.values())
        self.options = read_v1_options(
            self.input_batch.sampling_metadata, self.input_batch.num_reqs, self.device, self.vllm_config.model_config.get_vocab_size()
        )
        structured = scheduler_output.has_structured_output_requests
        self._vllm_samples = not has_drafts and plain_sampler_serves(self.options, structured)
        if not has_drafts and not self.gdn_groups and plain_layout_serves(self.options, structured):
            self._plain_step = self._choose_next_shape().is_off  # hybrid targets keep vLLM's speculative layout
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self._plain_step:
            self._proposals.drop(self.input_batch.req_ids)  # scheduled without drafts: proposed anew
            self.step = None
            if self.options.seeds:  # each request draws the token after its scheduled ones
                num_reqs = self.input_batch.num_reqs
                draws = self.input_batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens[:num_reqs]
                self._plain_draw_positions = torch.from_numpy(draws.astype(np.int64)).unsqueeze(1)
            return result
        with self.stage_times.stage(TREE_BUILD):
            self.step = self._build_step(scheduler_output, num_scheduled_tokens)
        return result

    def _choose_next_shape(self) -> TreeShape:
        """The shape of the drafts this step drafts for the next one (once per step)."""
        if not self._next_shape_chosen:
            batch = self.input_batch
            num_reqs = batch.num_reqs
            if (policy := self.drafter.budget_policy) is not None:  # a fixed shape needs neither
                if isinstance(policy, SamplingRegimes):  # this batch's regime
                    policy.use(bool(batch.sampling_metadata.all_greedy))
                # the policy times shapes apart by context length (attention grows with it)
                self._context_tokens = float(batch.num_computed_tokens_cpu[:num_reqs].sum()) / max(1, num_reqs)
            self.drafter.choose_shape(num_reqs, self._context_tokens)
            self._next_shape_chosen = True
        return self.drafter.last_shape

    def _build_step(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> TreeStep:
        """Every request's tree (its root alone without drafts), RoPE positions start + depth for the
        branching trees' rows, and the KV slot of every node."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_drafts = np.zeros(num_reqs, dtype=np.int64)
        for req_id, draft_token_ids in scheduler_output.scheduled_spec_decode_tokens.items():
            num_drafts[batch.req_id_to_index[req_id]] = len(draft_token_ids)
        root_rows = self.query_start_loc.np[1 : num_reqs + 1] - 1 - num_drafts
        starts = batch.num_computed_tokens_cpu[:num_reqs] + num_scheduled_tokens[:num_reqs] - 1 - num_drafts
        step = TreeStep.build(batch.req_ids, root_rows, starts, num_drafts, batch.token_ids_cpu, self._proposals)
        if step.num_chain_fallbacks:
            self.num_chain_fallbacks += step.num_chain_fallbacks
            logger.warning("method 'ddtree': %d request(s) verified as a chain (drafts were not their proposed tree; "
                           "exact, fewer tokens per step)", step.num_chain_fallbacks)
        if step.has_drafts:  # roots alone keep vLLM's positions, and none of their KV moves
            if step.has_branching:  # chains keep vLLM's linear positions
                self._set_positions(*step.tree_positions())
            slot_mapping = self._step_slot_mapping()
            if slot_mapping.device.type == "cpu":  # a few rows: numpy's indexing, several times cheaper than torch's
                step.node_slots = torch.from_numpy(slot_mapping.numpy()[step.layout.node_rows])
            else:
                step.node_slots = slot_mapping[step.node_rows().to(slot_mapping.device, non_blocking=True)]
        return step

    def _set_positions(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Overwrite the RoPE positions of batch `rows` in the runner's buffer: in place on the host (numpy's
        indexing), else by host-to-device copies without blocking (the host data is staged before the
        call returns, and a blocking copy would wait for the device, a host sync every step on a GPU).
        An M-RoPE target (`config.MROPE_ARCHITECTURES`, language model only) gets them in every section: a text
        token's M-RoPE position is its 1-D position in all three."""
        buffers = [self.positions] + ([self.mrope_positions.gpu.T] if self.uses_mrope else [])
        for buffer in buffers:  # [num_tokens] or, M-RoPE, [num_tokens, sections]
            if buffer.device.type == "cpu":
                buffer.numpy()[rows] = positions[:, None] if buffer.dim() == 2 else positions
                continue
            device = buffer.device
            values = torch.from_numpy(positions).to(device, buffer.dtype, non_blocking=True)
            buffer[torch.from_numpy(rows).to(device, non_blocking=True)] = values[:, None] if buffer.dim() == 2 else values

    @override
    def _calc_spec_decode_metadata(self, num_draft_tokens: np.ndarray, cu_num_scheduled_tokens: np.ndarray) -> SpecDecodeMetadata:
        """vLLM's metadata. A step without drafts that is no plain step (a prefill or step followed by a
        draft pass, a batch only the core rule serves) samples each request's last scheduled row and
        nothing else: built directly, the same values and dtypes as
        vLLM's general computation (`test_off_steps_spec_decode_metadata_equals_vllms`) without its
        gathers and host-to-device copies of index arrays."""
        if num_draft_tokens.any():
            return super()._calc_spec_decode_metadata(num_draft_tokens, cu_num_scheduled_tokens)
        num_reqs = len(num_draft_tokens)
        indices = self._no_draft_indices.get(num_reqs)
        if indices is None:  # read-only index tensors, the same at every step of this batch size
            requests = torch.arange(num_reqs, dtype=torch.int32)
            indices = self._no_draft_indices[num_reqs] = (
                torch.zeros_like(requests, device=self.device),
                (requests + 1).to(self.device),
                torch.zeros(0, dtype=torch.int32, device=self.device),
                requests.to(self.device),
            )
        cu_num_draft_tokens, cu_num_sampled_tokens, target_logits_indices, bonus_logits_indices = indices
        return SpecDecodeMetadata(
            draft_token_ids=self.input_ids.gpu[:0],
            num_draft_tokens=[0] * num_reqs,
            cu_num_draft_tokens=cu_num_draft_tokens,
            cu_num_sampled_tokens=cu_num_sampled_tokens,
            target_logits_indices=target_logits_indices,
            bonus_logits_indices=bonus_logits_indices,
            logits_indices=torch.from_numpy(cu_num_scheduled_tokens - 1).to(self.device, non_blocking=True),
        )

    @override
    def _build_attention_metadata(self, *args: Any, **kwargs: Any) -> Any:
        attn_metadata, spec_metadata = super()._build_attention_metadata(*args, **kwargs)
        step = self.step
        rows = step.attention_rows() if step is not None and step.has_drafts else None  # roots alone: no tree
        if rows is not None:
            with self.stage_times.stage(TREE_BUILD):
                self._attach_tree_attention(attn_metadata, rows)
        if self.gdn_groups and step is not None:
            attach_gdn_trees(attn_metadata, step.tree, self.input_batch.num_reqs)
        return attn_metadata, spec_metadata

    @override
    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> SamplerOutput:
        """The target's token at every node of every request (the core's rule; a structured request's
        node rows first masked in place by the grammar state after the node's path, `node_grammar`,
        as vLLM masks plain decoding's logits before sampling), the acceptance walk, and KV compaction.
        Output: vLLM's "accepted drafts + bonus, padded -1" rows, so EOS, stop tokens, max_tokens,
        detokenization and the spec-decode metrics need nothing new.

        Under tensor parallelism every rank builds its trees from TP rank 0's draft top-k (`proposer`)
        and the sampled tokens are broadcast from TP rank 0 (unseeded draws differ per rank), so every
        rank commits the same tokens and reaches the same accepted path (each then compacts its own KV
        shard)."""
        step = self.step
        assert logits is not None and (step is not None or self._plain_step)
        if self._vllm_samples or self._plain_step:  # no drafts: one token per request (a plain step has no `TreeStep`)
            with self.stage_times.stage(ACCEPTANCE):
                if self._vllm_samples:
                    sampled = from_rank_zero(super()._sample(logits, None).sampled_token_ids)
                else:  # options of each request's parameters alone: its one logits row, by the core rule
                    sampled = self._sample_plain_rows(logits)
            if self.clock is not None:
                self._clock_sampled(step, sampled)
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)
        with self.stage_times.stage(ACCEPTANCE):
            self.node_grammars.mask_(logits, step, self.input_batch.req_ids, self.requests)
            if self.options.all_greedy and not self.options.needs_node_processing:  # every node's token: its row's argmax
                processed, output = None, self._accept_greedy(logits, step)
            else:
                processed = self._sample_nodes(logits, step)
                output = walk(step)
            logprobs = emitted_logprobs(self.sampler, self.options, logits, processed, step, output)
        if step.has_drafts:  # roots alone: every token's KV already sits where it was computed
            with self.stage_times.stage(KV_COMPACTION):
                self._compact_target_kv(step)
        if self.clock is not None:
            self._clock_sampled(step, output)
        return SamplerOutput(sampled_token_ids=output.to(logits.device), logprobs_tensors=logprobs)

    def _sample_plain_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, 1] the core rule's token for every request of a plain step from its logits row [R, V]
        (vLLM's layout: row r is request r's), a seeded request's keyed at the position it draws, as a
        tree's root is (`TreeStep.draw_positions`); TP rank 0's on every rank."""
        num_reqs = logits.shape[0]
        params = self.options.sampling_params()
        rows = self._plain_rows.get(num_reqs)
        if rows is None:
            rows = self._plain_rows[num_reqs] = torch.arange(num_reqs, device=logits.device).unsqueeze(1)
        positions = self._plain_draw_positions if params.seeds else None
        return from_rank_zero(sample_nodes(logits, rows, positions, params))

    def _sample_nodes(self, logits: torch.Tensor, step: TreeStep) -> torch.Tensor | None:
        """Fill `step.target_token_ids`: the target's token at every node, TP rank 0's on every rank.
        Returns the nodes' logits after their history-dependent options (None when no request of the
        batch uses one), which logprobs may report."""
        device = logits.device
        params = self.options.sampling_params()
        rows = step.node_logit_rows().to(device)
        processed = None
        if self.options.needs_node_processing:
            processed = process_node_logits(gather_node_logits(logits, rows), step.tree, self.options)
        positions = step.draw_positions().to(device) if params.seeds else None  # only seeded draws are keyed
        target = sample_nodes(logits, rows, positions, params, processed)
        # The step's trees and the walk live on the host: one copy back, where vLLM reads the sampled
        # tokens back anyway (a no-op on CPU).
        step.target_token_ids = from_rank_zero(target).cpu()
        return processed

    def _accept_greedy(self, logits: torch.Tensor, step: TreeStep) -> torch.Tensor:
        """`_sample_nodes` then `steps.walk` for a greedy batch without history-dependent options: the argmax
        of every logits row (TP rank 0's on every rank), then one compiled call reads the nodes' tokens
        off their rows, walks the trees and pads vLLM's output rows (`accept_greedy_rows_on_host`)."""
        row_tokens = from_rank_zero(argmax_first(logits)).cpu()
        step.target_token_ids, step.acceptance, output = host_tree.accept_greedy_rows_on_host(step.tree, step.num_drafts, row_tokens)
        return output

    def _grammar_filtered_trees(self, trees: Any, top_logprobs: torch.Tensor, top_token_ids: torch.Tensor, budget: int) -> Any:
        """The drafter's new trees with the structured requests' rebuilt from grammar-admitted candidates
        only, their grammars at the state after this step's output (`NodeGrammars.filtered_trees`)."""
        step = self.step
        if step is None or step.acceptance is None:
            return trees
        num_reqs = self.input_batch.num_reqs
        return self.node_grammars.filtered_trees(
            trees, top_logprobs, top_token_ids, budget, self.input_batch.req_ids, step.acceptance.output_token_ids,
            self.discard_request_mask.np[:num_reqs], self.requests,
        )

    def _clock_sampled(self, step: TreeStep | None, output: torch.Tensor) -> None:
        """Tell the clock the tokens this step commits, and what each shape nested in it would accept."""
        assert self.clock is not None
        num_reqs = self.input_batch.num_reqs
        discarded = int(np.count_nonzero(self.discard_request_mask.np[:num_reqs]))
        used = self._step_shape
        if step is None or not step.has_drafts:  # roots alone: one token per request, no draft to accept
            self.clock.step_sampled(num_reqs - discarded, {used: 0})
            return
        committed = np.count_nonzero(output.numpy() >= 0, axis=1)
        self.clock.step_sampled(
            int(committed.sum()) - discarded, accepted_by_shape(self.clock.policy.shapes, used, step), verified_tokens(step, committed)
        )

    def _compact_target_kv(self, step: TreeStep) -> None:
        """Move the accepted nodes' K/V to rows start + k in every target layer (the draft's layers are
        rewritten from the context on the next draft pass). A batch of chains moves nothing: each
        accepted path is its window's first rows, where its K/V already is."""
        assert step.acceptance is not None and step.node_slots is not None
        if self.gdn_groups:  # hybrid targets: the GDN layers' states and conv windows too
            compact_gdn_states(self, self.gdn_groups, step.acceptance, self.speculative_config.num_speculative_tokens)
        if not step.has_branching:
            return
        slots = step.node_slots
        if self._moves_kv_on_host:  # the real moves only (a path through first children has none)
            if (moves := kv_slot_moves(step)) is not None:
                self._move_kv_rows(*moves)
            return
        # Every plan entry, identity ones included (no real move writes their rows, `kv_plan`): fixed
        # shapes and nothing read back to the host, so on a GPU the copies just queue (graph-capturable).
        plan = kv_compaction_plan(step.acceptance)
        src = slots.gather(1, plan.src_offsets.to(slots.device)).flatten()
        self._move_kv_rows(src, slots.gather(1, plan.dst_offsets.to(slots.device)).flatten())

    @override
    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's bookkeeping with the partial-prefill rows' generators hidden from its offset rewind:
        no token of ours is drawn from vLLM's generators, so there is nothing to rewind (and CPU
        generators lack `set_offset`)."""
        num_reqs = self.input_batch.num_reqs
        generators = self.input_batch.generators
        if not generators:
            return super()._bookkeeping_sync(*args, **kwargs)
        discarded = np.nonzero(self.discard_request_mask.np[:num_reqs])[0]
        hidden = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)

    @override
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
        step = self.step
        assert step is not None
        if self._choose_next_shape().is_off and not step.has_drafts:
            # No speculation after a step without drafts (one vLLM's sampler could not serve): every row
            # is context at its own position and KV slot; the drafter only keeps it, nothing else of
            # vLLM's drafting path runs.
            count = scheduler_output.total_num_scheduled_tokens
            self._defer_context(count, hidden_states, aux_hidden_states, common_attn_metadata.slot_mapping)
            self._drafted = True
            return [[] for _ in range(self.input_batch.num_reqs)]
        if step.has_drafts and aux_hidden_states is not None:
            with self.stage_times.stage(KV_COMPACTION):
                aux_hidden_states = self._path_first(step, aux_hidden_states)
        if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
            # No request verified drafts (steps the budget policy ran without speculation): every row is
            # context at its own position and KV slot, vLLM's layout for a step without drafts.
            spec_decode_metadata = None
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
            self._proposals.add(trees, self.input_batch.req_ids)
        self._drafted = True
        return drafts

    def _defer_context(
        self, count: int, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor] | None, slot_mapping: torch.Tensor
    ) -> None:
        """Hand the drafter the context rows of a step without drafts followed by none
        (`DDTreeProposer.defer_context`): the step's `count` rows, each at its own position and KV slot."""
        parts = aux_hidden_states if self.use_aux_hidden_state_outputs else [hidden_states]
        assert parts is not None  # a draft that reads aux layers gets them from every target forward
        self.drafter.defer_context(parts, count, self.positions, slot_mapping)
        self.drafter.last_trees = None

    @override
    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts for the scheduler; None when this step drafted nothing: the drafter did not run
        (vLLM skips it when the batch's longest request is too close to max_model_len for a draft block
        and then hands the scheduler zeros, which would be verified as a chain of wasted rows), or the
        step ran without speculation. None leaves every request without drafts, since scheduling a
        request clears its drafts and only this step's scheduled requests are in the batch."""
        if not self._drafted:  # (vLLM's would hand back the last drafting step's drafts)
            return None
        drafts = super().take_draft_token_ids()
        if drafts is None or not any(drafts.draft_token_ids):
            return None
        return drafts

    def _path_first(self, step: TreeStep, aux_hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        """The drafter's context in path order at linear positions (`steps.path_first`)."""
        if step.has_branching:  # chains already sit at linear positions
            self._set_positions(*step.linear_positions())
        return path_first(step, aux_hidden_states)
