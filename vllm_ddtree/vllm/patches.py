"""Every run-time patch vllm_ddtree applies to vLLM, in one place (applied by `plugin.register`).

Everything else uses vLLM's own extension points: the `vllm.general_plugins` entry point,
`register_backend` for the attention backend, `worker_cls` for the worker, `additional_config` for the
DDTree settings, and subclasses of vLLM's runner, proposer and attention classes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from vllm_ddtree.vllm.config import (
    DDTreeConfig,
    check_engine_config,
    is_ddtree_request,
    log_rewrite,
    rewrite_engine_args,
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
        ddtree = isinstance(params, SamplingParams) and DDTreeConfig.from_vllm_config(self.vllm_config) is not None
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


def all_patches() -> list[Patch]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    return [
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
        # Why: vLLM 0.32 refuses min_p and logit_bias under every speculative method, because its
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
    ]


def apply_all() -> None:
    """Apply every patch once per process (plugins may be loaded more than once)."""
    for patch in all_patches():
        if not is_patched(patch.owner, patch.name):
            apply_patch(patch)
