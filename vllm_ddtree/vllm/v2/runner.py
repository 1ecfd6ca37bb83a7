"""Method 'ddtree' on vLLM's V2 model runner, platform-neutral: one `TreeStep` per engine step
(docs/v2_runner.md, 2.1). Hooks, in the order a step runs them:

- build (`prepare_inputs`): after vLLM laid out the rows, the step's trees from the scheduled draft
  counts, the verified tokens (the rows' input ids) and the previous step's proposals;
- position (`prepare_attn`): after vLLM computed the KV slots from linear positions, each branching
  tree's rows move to RoPE position start + depth by adding depth(i) - i in place to the persistent
  positions buffer (D1-D3: no absolute position crosses from the host, and a FULL graph replay reads the
  same buffer); the nodes' KV slots are a gather of vLLM's slot mapping;
- attend (`model_state.prepare_attn`, wrapped on the instance): the tree rows onto the target's
  attention metadata (the platform's);
- verify (`sample`): every node's token by the core's rule (greedy: each row's first argmax; sampled:
  the request's temperature, top_k, top_p, min_p, its seed keying draws by position; a node's logits
  first masked by its grammar state (`node_grammar`) and processed by the request's penalties,
  min_tokens, bad words, logit bias and allowed ids (`node_logits`), both with the node's own history:
  the host's copy of the committed output (`output_mirror`, D11-D12), then its path), the walk, K/V
  compaction; vLLM's triple (rows of accepted path + bonus, -1 padded; num_sampled = accepted + 1;
  num_rejected = the rest) so `post_update` advances each request by accepted + 1 (D4, D5), with each
  emitted token's logprobs from its node's row in V2's layout (D13, `v2/logprobs.py`);
- draft (`DDTreeDraft.propose`, after `chain_view` restores linear positions and puts each
  accepted path first, D7; a structured request's tree built from grammar-admitted candidates,
  `tree_filter`);
- hand (`take_draft_token_ids`): each tree's nodes as real token lists (D8).

Tensor parallelism (D15): every rank builds its trees from TP rank 0's draft top-K and shape
(`speculator`) and takes TP rank 0's sampled tokens (`rank_zero`), so the host state each rank keeps
(trees, proposals, policy choice) and the tokens it commits agree; each rank moves its own K/V shard.

Steps without drafts (prefills, steps the policy runs without speculation) are vLLM's own `sample`,
except for a batch with a seeded request, an option processed at every node, a grammar or logprobs,
which the core rule draws at every step (`v2/options.vllm_sampler_serves`): so every token of such a
request reaches the output mirror on the host, and what it reports never depends on the policy. Prompt
logprobs are vLLM's, from the prompt rows of prefill chunks (never tree rows). Host starts come from
vLLM's host mirror of the computed tokens, exact because scheduling is synchronous (checked at start).
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
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from vllm_ddtree.core import BudgetPolicy, SamplingRegimes, StepClock
from vllm_ddtree.core.sampling import argmax_first
from vllm_ddtree.vllm import host_tree
from vllm_ddtree.vllm.config import DDTreeConfig
from vllm_ddtree.vllm.node_grammar import NodeGrammars
from vllm_ddtree.vllm.node_logits import process_node_logits
from vllm_ddtree.vllm.options import RequestOptions
from vllm_ddtree.vllm.patching import installed_vllm_version, supported_release
from vllm_ddtree.vllm.rank_zero import from_rank_zero
from vllm_ddtree.vllm.sampling import gather_node_logits, sample_nodes
from vllm_ddtree.vllm.steps import accepted_by_shape, kv_slot_moves, path_first, verified_tokens, walk
from vllm_ddtree.vllm.surface import COMPUTE_SAMPLE_LOGITS, available, check_vllm_surface, release_surface
from vllm_ddtree.vllm.tree_step import Proposals, TreeRows, TreeStep
from vllm_ddtree.vllm.v2.logprobs import v2_emitted_logprobs
from vllm_ddtree.vllm.v2.options import read_v2_options, vllm_sampler_serves
from vllm_ddtree.vllm.v2.dflash2 import speculator_class
from vllm_ddtree.vllm.v2.output_mirror import OutputMirror

logger = logging.getLogger("vllm.ddtree")


def shift_positions_(positions: torch.Tensor, rows: np.ndarray, deltas: np.ndarray) -> None:
    """positions[rows] += deltas, in place in the persistent buffer: numpy's indexing on the host, else
    host-to-device copies without blocking (no host sync)."""
    if positions.device.type == "cpu":
        np.add.at(positions.numpy(), rows, deltas)
        return
    device = positions.device
    positions.index_add_(0, torch.from_numpy(rows).to(device, non_blocking=True), torch.from_numpy(deltas).to(device, positions.dtype, non_blocking=True))


def tree_deltas(step: TreeStep) -> tuple[np.ndarray, np.ndarray]:
    """(rows, depth(i) - i) of the branching trees' nodes: the verify rows' RoPE shift (a step built at
    relative positions: the layout's positions are depths and node indices)."""
    rows, depths = step.tree_positions()
    _, indices = step.linear_positions()
    return rows, depths - indices


class DDTreeV2RunnerMixin:
    """DDTree hooks over vLLM's V2 `GPUModelRunner` (or its CPU subclass).

    step: this step's `TreeStep` (None in a step without one: dummy runs); clock: feeds the budget
    policy (None for a fixed budget); num_chain_fallbacks: requests verified as a chain because their
    scheduled drafts were not their proposed tree (expected 0).
    """

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        check_vllm_surface(release_surface("v2", supported_release(installed_vllm_version()) or "", cpu=torch.device(device).type == "cpu"))
        ddtree = DDTreeConfig.from_vllm_config(vllm_config)
        if ddtree is None:
            raise ValueError("the DDTree model runner needs additional_config['ddtree'] (set by method 'ddtree')")
        if vllm_config.scheduler_config.async_scheduling:
            raise ValueError("method 'ddtree' on the V2 model runner needs synchronous scheduling (the host's starts are exact only then)")
        speculator = speculator_class(vllm_config)  # by the draft's architecture, as vLLM's `init_speculator`
        if type(self.speculator) is not speculator:  # vLLM 0.34 builds DFlash's from the registered config (D14)
            self.speculator = speculator(vllm_config, device, ddtree)
        self._logits_from_model_state = available(COMPUTE_SAMPLE_LOGITS)  # how this release's `sample` takes logits (F11)
        self.speculator.chain_view = self._chain_view
        self.step: TreeStep | None = None
        self._step_batch: Any = None  # the InputBatch `step` was built for
        self._core_rule_draws = False  # this step's batch needs the core rule even without drafts
        self._logprobs_dims: tuple[int, int] | None = None  # this step's (top n, most logprob_token_ids), None: no logprobs
        self.options: RequestOptions | None = None  # this step's request options (`prepare_inputs`)
        self.mirror = OutputMirror()  # each request's params, prompt and committed output (D12)
        self.node_grammars = NodeGrammars(vllm_config)
        self.speculator.tree_filter = self._grammar_filtered_trees
        self._discarded = np.zeros(0, dtype=bool)  # the step's rows still prefilling (they commit nothing)
        self._proposals = Proposals()
        self.clock: StepClock | None = None
        self._context_tokens = 0.0
        self._step_shape = self.speculator.last_shape  # the shape this step's drafts were drafted for
        self.num_chain_fallbacks = 0
        if self.speculator.budget_policy is not None:
            self.use_budget_policy(self.speculator.budget_policy)

    def use_budget_policy(self, policy: BudgetPolicy) -> None:
        """Let `policy` choose every step's tree shape from now on, fed with this runner's steps."""
        self.speculator.budget_policy = policy
        self.clock = StepClock(policy)

    # ---- platform layer ----------------------------------------------------------------------------
    def _attach_tree_attention(self, attn_metadata: dict[str, Any], rows: TreeRows, block_tables: tuple[torch.Tensor, ...]) -> None:
        """Give the target's attention metadata the masks of this step's branching trees."""
        raise NotImplementedError

    def _move_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the K/V at host `src_slots` to `dst_slots` [M] in every target attention layer."""
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
        self._wrap_model_state_prepare_attn()
        host_tree.warm_up()

    def _target_attention_layers(self) -> list[Attention]:
        draft_layers = self.speculator.draft_attn_layer_names
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        return [layer for name, layer in layers.items() if name not in draft_layers]

    @property
    def _attention_gid(self) -> int:
        """The one KV cache group of target and draft attention (vLLM's DFlash shares it)."""
        return self.speculator.draft_kv_cache_group_id

    def _wrap_model_state_prepare_attn(self) -> None:
        """Attend: vLLM's metadata for the step's batch, then the tree rows onto it. Only the call for
        the batch `step` was built for attaches (dummy runs and captures build metadata for none)."""
        original = self.model_state.prepare_attn

        def prepare_attn(input_batch: Any, cudagraph_mode: Any, block_tables: Any, *args: Any, **kwargs: Any) -> Any:
            attn_metadata = original(input_batch, cudagraph_mode, block_tables, *args, **kwargs)
            step = self.step
            if step is not None and input_batch is self._step_batch and (rows := step.attention_rows()) is not None:
                self._attach_tree_attention(attn_metadata, rows, block_tables)
            return attn_metadata

        self.model_state.prepare_attn = prepare_attn

    # ---- the step ----------------------------------------------------------------------------------
    @override
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self.step = self._step_batch = None
        self._step_shape = self.speculator.last_shape
        gone = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
        self._proposals.drop(gone)
        self.mirror.drop(gone)
        self.mirror.note_new_requests(scheduler_output.scheduled_new_reqs)
        self.node_grammars.drop(scheduler_output.finished_req_ids)  # a preempted request's grammar waits for it
        self.node_grammars.note_new_requests(scheduler_output.scheduled_new_reqs)
        if self.clock is not None and scheduler_output.total_num_scheduled_tokens:
            num_reqs = len(scheduler_output.num_scheduled_tokens)
            if scheduler_output.scheduled_new_reqs:
                self.clock.policy.requests_arrived(num_reqs)
            num_drafts = sum(map(len, scheduler_output.scheduled_spec_decode_tokens.values()))
            decode_only = scheduler_output.total_num_scheduled_tokens == num_reqs + num_drafts
            self.clock.step_started(time.perf_counter(), num_reqs, self._step_shape, decode_only, self._context_tokens)
        return super().execute_model(scheduler_output, *args, **kwargs)

    @override
    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        batch = self._step_batch
        if batch is not None and self.speculator.last_trees is not None:
            self._proposals.add(self.speculator.last_trees, list(batch.req_ids))
        if self.clock is not None and batch is not None:
            self.clock.step_ended(time.perf_counter())
        return output

    @override
    def prepare_inputs(self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any, num_active_loras: int) -> Any:
        input_batch = super().prepare_inputs(scheduler_output, batch_req_state, batch_desc, num_active_loras)
        self.step = self._build_step(input_batch)
        self._step_batch = input_batch
        requests = self.mirror.requests(input_batch.req_ids)
        self.options = read_v2_options(self.sampler.sampling_states, input_batch.idx_mapping_np, requests, self.vocab_size, self.device)
        self._logprobs_dims = self.sampler.get_logprobs_dims(input_batch.idx_mapping_np)
        self._core_rule_draws = not vllm_sampler_serves(self.options, scheduler_output.has_structured_output_requests, self._logprobs_dims is not None)
        num_reqs = input_batch.num_reqs
        if isinstance(policy := self.speculator.budget_policy, SamplingRegimes):  # this batch's regime
            policy.use(self.options.all_greedy)
        if self.clock is not None:  # the policy times shapes apart by context length (attention grows with it)
            self._context_tokens = float(input_batch.num_computed_tokens_np.sum()) / max(1, num_reqs)
        self.speculator.choose_shape(num_reqs, self._context_tokens)
        return input_batch

    def _build_step(self, input_batch: Any) -> TreeStep:
        """Every request's tree (its root alone without drafts). The trees are built at relative
        positions (root at 0: the layout's positions are depths and node indices, whose difference is
        D1's delta) from the verified tokens themselves, the rows' input ids; the absolute starts
        (vLLM's host mirror of the computed tokens) are set after."""
        num_reqs = input_batch.num_reqs
        num_drafts = np.zeros(num_reqs, dtype=np.int64)
        if input_batch.num_draft_tokens_per_req is not None:
            num_drafts[:] = input_batch.num_draft_tokens_per_req
        root_rows = input_batch.query_start_loc_np[1 : num_reqs + 1].astype(np.int64) - 1 - num_drafts
        starts = input_batch.num_computed_tokens_np.astype(np.int64) + input_batch.num_scheduled_tokens - 1 - num_drafts
        offsets = np.arange(1 + int(num_drafts.max()))
        window = root_rows[:, None] + np.where(offsets[None, :] <= num_drafts[:, None], offsets[None, :], 0)
        tokens = input_batch.input_ids.cpu().numpy()[window]
        step = TreeStep.build(input_batch.req_ids, root_rows, np.zeros(num_reqs, dtype=np.int64), num_drafts, tokens, self._proposals)
        step.starts = torch.from_numpy(starts)
        if step.num_chain_fallbacks:
            self.num_chain_fallbacks += step.num_chain_fallbacks
            logger.warning("method 'ddtree': %d request(s) verified as a chain (drafts were not their proposed tree; "
                           "exact, fewer tokens per step)", step.num_chain_fallbacks)
        return step

    @override
    def prepare_attn(self, input_batch: Any) -> Any:
        block_tables, slot_mappings = super().prepare_attn(input_batch)
        step = self.step
        if step is not None and input_batch is self._step_batch and step.has_drafts:
            if step.has_branching:  # chains keep vLLM's linear positions
                shift_positions_(self.input_buffers.positions, *tree_deltas(step))
            slot_mapping = slot_mappings[self._attention_gid]
            step.node_slots = slot_mapping[step.node_rows().to(slot_mapping.device, non_blocking=True)].cpu()
        return block_tables, slot_mappings

    @override
    def sample(self, hidden_states: torch.Tensor, input_batch: Any, grammar_output: Any) -> Any:
        """Every node's token by the core's rule (`vllm_ddtree.core.sampling`; greedy: each row's first
        argmax), the walk and K/V compaction, for a step with drafts or one vLLM's sampler must not draw
        (`v2.options.vllm_sampler_serves`); vLLM's own sampling for the others. Under tensor parallelism
        the tokens are TP rank 0's on every rank (`rank_zero`: unseeded draws and logits ties may differ
        per rank), so every rank walks the same paths, compacts its own K/V shard alike and commits the
        same tokens."""
        step = self.step
        if step is None or input_batch is not self._step_batch or not (step.has_drafts or self._core_rule_draws):
            result = super().sample(hidden_states, input_batch, grammar_output)
            result[0].sampled_token_ids = from_rank_zero(result[0].sampled_token_ids)  # one token per request
            if self.clock is not None and step is not None:
                self.clock.step_sampled(int(result[1].sum()), {self._step_shape: 0})
            return result
        assert grammar_output is None and self.options is not None  # the scheduler sends no masks to 'ddtree' engines (`patches`)
        sampled_hidden = hidden_states[input_batch.logits_indices]
        logits = self.model_state.compute_sample_logits(sampled_hidden) if self._logits_from_model_state else self.model.compute_logits(sampled_hidden)
        self.node_grammars.mask_(logits, step, list(input_batch.req_ids), self.mirror.by_id)
        params = self.options.sampling_params()
        processed = None  # the nodes' logits after history-dependent options, where any request has one
        if params.all_greedy and not self.options.needs_node_processing:  # every node's token: its row's argmax, read in the walk's compiled call
            row_tokens = from_rank_zero(argmax_first(logits)).cpu()
            step.target_token_ids, step.acceptance, output = host_tree.accept_greedy_rows_on_host(step.tree, step.num_drafts, row_tokens)
        else:
            rows = step.node_logit_rows().to(logits.device)
            processed = process_node_logits(gather_node_logits(logits, rows), step.tree, self.options) if self.options.needs_node_processing else None
            positions = step.draw_positions().to(logits.device) if params.seeds else None  # only seeded draws are keyed
            step.target_token_ids = from_rank_zero(sample_nodes(logits, rows, positions, params, processed)).cpu()
            output = walk(step)
        logprobs = v2_emitted_logprobs(self.sampler, input_batch, self._logprobs_dims, self.options, logits, processed, step, output)
        if step.has_branching and (moves := kv_slot_moves(step)) is not None:
            self._move_kv_rows(*moves)
        device = logits.device
        num_sampled = torch.from_numpy(np.count_nonzero(output.numpy() >= 0, axis=1).astype(np.int32)).to(device)
        # rows still prefilling sample nothing: vLLM's own rule, on the device's counts
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping, self.req_states.prefill_len.gpu
        )
        committed = num_sampled.cpu().numpy()
        self._discarded = committed == 0
        self.mirror.commit(input_batch.req_ids, output.numpy(), committed)
        if self.clock is not None:
            self._clock_sampled(step, committed)
        sampler_output = SamplerOutput(
            sampled_token_ids=output.to(device), logprobs_tensors=logprobs, num_nans=None, num_sampled=num_sampled, num_rejected=num_rejected
        )
        return sampler_output, num_sampled, num_rejected

    def _grammar_filtered_trees(self, trees: Any, top_logprobs: torch.Tensor, top_token_ids: torch.Tensor, budget: int) -> Any:
        """The speculator's new trees with the structured requests' rebuilt from grammar-admitted
        candidates only, their grammars at the state after this step's output (`NodeGrammars.filtered_trees`;
        a step vLLM's sampler drew has no structured request)."""
        step = self.step
        if step is None or step.acceptance is None or self._step_batch is None:
            return trees
        return self.node_grammars.filtered_trees(trees, top_logprobs, top_token_ids, budget, list(self._step_batch.req_ids),
                                                 step.acceptance.output_token_ids, self._discarded, self.mirror.by_id)

    def _clock_sampled(self, step: TreeStep, committed: np.ndarray) -> None:
        """Tell the clock the tokens this step commits (committed [R] per request), and what each shape
        nested in it would accept."""
        assert self.clock is not None
        self.clock.step_sampled(
            int(committed.sum()), accepted_by_shape(self.clock.policy.shapes, self._step_shape, step), verified_tokens(step, committed)
        )

    def _chain_view(self, aux_hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        """The draft's view of the verify step: linear positions again and each window's accepted path
        first (`steps.path_first`)."""
        step = self.step
        if step is None or not step.has_drafts or step.acceptance is None:
            return aux_hidden_states
        if step.has_branching:
            rows, deltas = tree_deltas(step)
            shift_positions_(self.input_buffers.positions, rows, -deltas)
        return path_first(step, aux_hidden_states)

    @override
    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Each request's tree nodes as real token lists (vLLM's handler would hand placeholders); None
        when the step proposed no drafts (an off step), which leaves every request without drafts."""
        batch = self._step_batch
        lists = self.speculator.draft_lists
        if batch is None or not any(lists):
            return None
        return DraftTokenIds(list(batch.req_ids), lists)
