"""The user contract `speculative_config={"method": "ddtree", ...}` and what it becomes inside vLLM.

Keys a user passes (the same JSON works for `LLM(speculative_config=...)` and
`vllm serve --speculative-config`; `--spec-method/--spec-model/--spec-tokens` work too):

- `method`: "ddtree".
- `model`: a DFlash draft checkpoint (config `architectures: ["DFlashDraftModel"]`); vLLM's own
  DFlash model code loads and runs it.
- `num_speculative_tokens`: the tree budget B, the number of draft nodes (root excluded) the target
  verifies per step in one forward pass. The tree is at most min(B, block_size - 1) deep, and the
  draft runs that many mask positions.
- `ddtree_topk` (optional): cap on the candidates kept per draft position; the tree uses
  min(ddtree_topk, B, vocab) (default B, which is never limiting).
- passed through to vLLM unchanged: `enforce_eager`, `max_model_len`, `revision`, `code_revision`,
  `quantization`. Any other key fails with a message naming it.

Inside vLLM the request runs as `method: "dflash"` with `num_speculative_tokens = B` (so the draft
checkpoint, its KV cache, the target's auxiliary hidden states and the scheduler's KV lookahead are
vLLM's own), plus `additional_config["ddtree"]` (which selects the tree path in our worker),
`worker_cls` = our CPU worker and async scheduling off. `rewrite_engine_args` does that rewrite and
`log_rewrite` logs what it forced. Refused with a message: non-CPU platforms, the V2 model runner,
async scheduling, another worker_cls, a quantized KV cache, pipeline/data parallelism > 1. Tensor
parallelism is supported (every rank samples from the same all-gathered logits and the sampled tokens
are broadcast from rank 0, so all ranks accept the same path; see `runner.DDTreeModelRunner._sample`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

# A child of vLLM's logger: our records follow vLLM's logging configuration (level, format, stream).
logger = logging.getLogger("vllm.ddtree")

METHOD = "ddtree"
WORKER_CLS = "vllm_ddtree.vllm.worker.DDTreeCPUWorker"
ADDITIONAL_CONFIG_KEY = "ddtree"

_PASSTHROUGH_KEYS = frozenset(
    {"model", "num_speculative_tokens", "enforce_eager", "max_model_len", "revision", "code_revision", "quantization"}
)
_DDTREE_KEYS = frozenset({"ddtree_topk"})


@dataclass(frozen=True)
class DDTreeConfig:
    """DDTree settings shared by every vLLM process (carried in `additional_config["ddtree"]`).

    budget: draft nodes verified per step (root excluded), >= 1.
    topk: cap on candidates per draft position, >= 1; None means no cap beyond the budget.
    """

    budget: int
    topk: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
            raise ValueError(f"method 'ddtree' needs num_speculative_tokens (the tree budget) >= 1, got {self.budget!r}")
        if self.topk is not None and (not isinstance(self.topk, int) or isinstance(self.topk, bool) or self.topk < 1):
            raise ValueError(f"ddtree_topk must be an integer >= 1, got {self.topk!r}")

    def candidates_per_depth(self, vocab_size: int) -> int:
        """K: how many draft candidates per position the tree builder sees."""
        return min(self.budget, vocab_size, self.topk or self.budget)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DDTreeConfig | None:
        """The DDTree settings of an engine, or None when it does not run method 'ddtree'."""
        extra = vllm_config.additional_config
        if not isinstance(extra, dict) or ADDITIONAL_CONFIG_KEY not in extra:
            return None
        return cls(**extra[ADDITIONAL_CONFIG_KEY])


_SPEC_FLAGS = (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens"))


def is_ddtree_request(args: Any) -> bool:
    """Whether an EngineArgs asks for method 'ddtree' (in speculative_config or via --spec-method)."""
    spec = args.speculative_config
    return getattr(args, "spec_method", None) == METHOD or (isinstance(spec, dict) and spec.get("method") == METHOD)


def _user_speculative_config(args: Any) -> dict[str, Any]:
    """speculative_config merged with --spec-method/--spec-model/--spec-tokens, as vLLM merges them."""
    spec = dict(args.speculative_config or {})
    for flag, key in _SPEC_FLAGS:
        value = getattr(args, flag, None)
        if value is None:
            continue
        if key in spec:
            raise ValueError(f"--{flag.replace('_', '-')} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
        setattr(args, flag, None)
    return spec


def _split_user_config(spec: dict[str, Any]) -> tuple[DDTreeConfig, dict[str, Any]]:
    """(DDTree settings, the speculative config vLLM runs) from the user's dict; rejects unknown keys."""
    spec = {key.replace("-", "_"): value for key, value in spec.items()}
    unknown = sorted(set(spec) - _PASSTHROUGH_KEYS - _DDTREE_KEYS - {"method"})
    if unknown:
        raise ValueError(
            f"speculative_config key(s) {unknown} are not supported with method 'ddtree'. Supported keys: "
            f"{sorted(_PASSTHROUGH_KEYS | _DDTREE_KEYS | {'method'})}. Use method 'dflash' for the other options."
        )
    if not spec.get("model"):
        raise ValueError("method 'ddtree' needs 'model': a DFlash draft checkpoint")
    ddtree = DDTreeConfig(budget=spec.get("num_speculative_tokens"), topk=spec.get("ddtree_topk"))
    dflash = {key: value for key, value in spec.items() if key in _PASSTHROUGH_KEYS}
    dflash["method"] = "dflash"
    return ddtree, dflash


def rewrite_engine_args(args: Any) -> DDTreeConfig:
    """Rewrite an EngineArgs whose speculative_config asks for method 'ddtree' into what vLLM runs.

    Fails with a clear message on settings DDTree cannot honour instead of silently changing them.
    """
    from vllm.platforms import current_platform

    ddtree, dflash = _split_user_config(_user_speculative_config(args))
    if not current_platform.is_cpu():
        raise ValueError("method 'ddtree' runs on vLLM's CPU backend only in this release; use method 'dflash' on GPUs")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise ValueError("method 'ddtree' needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")
    if args.async_scheduling:
        raise ValueError("method 'ddtree' does not support async scheduling; drop --async-scheduling")
    if args.worker_cls not in ("auto", WORKER_CLS):
        raise ValueError(f"method 'ddtree' installs its own worker ({WORKER_CLS}); drop worker_cls={args.worker_cls!r}")
    if args.kv_cache_dtype not in ("auto", None):
        raise ValueError(f"method 'ddtree' needs an unquantized KV cache; drop kv_cache_dtype={args.kv_cache_dtype!r}")
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        if (getattr(args, name) or 1) > 1:
            raise ValueError(f"method 'ddtree' supports tensor parallelism only in this release; drop {name}={getattr(args, name)}")
    if ADDITIONAL_CONFIG_KEY in (args.additional_config or {}):
        raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is reserved for method 'ddtree'")

    args.speculative_config = dflash
    args.async_scheduling = False
    args.worker_cls = WORKER_CLS
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: asdict(ddtree)}
    return ddtree


def log_rewrite(ddtree: DDTreeConfig) -> None:
    """Log what `rewrite_engine_args` forced (call once vLLM has configured logging)."""
    logger.info(
        "vllm_ddtree: method 'ddtree' (budget %d, topk cap %s) runs on vLLM's DFlash draft machinery; forced: "
        "speculative method 'dflash' with num_speculative_tokens=%d, async_scheduling=False, worker_cls=%s",
        ddtree.budget,
        ddtree.topk,
        ddtree.budget,
        WORKER_CLS,
    )
