"""Shared e2e fixtures: tiny target + DFlash draft pairs on disk and in-process vLLM CPU engines.

Every engine configuration runs once per session (`engine_runs`); tests compare the cached results.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in the test process: starts faster, runner readable
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

# An in-process CPU engine leaves vLLM's OpenMP kernels at one thread per core (its CPU worker then
# disables torch.set_num_threads). On a few shared cores their spin-waits slow every kernel call, and
# the whole suite with them; one thread, set before the engine exists, avoids it.
torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import pytest

from tests.e2e.pairs import build_pair

if importlib.util.find_spec("vllm") is None:  # engine-agnostic installs run tests/core only
    collect_ignore_glob = ["test_*.py"]

KV_CACHE_BYTES = 128 * 2**20
MAX_MODEL_LEN = 512
CHUNK = 64  # max_num_batched_tokens: the longest prompt is prefilled in chunks
PROMPT_LENGTHS = (3, 7, 12, 20, 31, 45, 70, 100)
MAX_TOKENS = 32


def prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token-id prompts of the given lengths (ids 1..499; the mask token 511 never appears)."""
    return [{"prompt_token_ids": [(7 * (i + seed) + 13 * j * j + 3 * j) % 499 + 1 for j in range(n)]} for i, n in enumerate(lengths)]


def heldout_code_prompts(lengths=PROMPT_LENGTHS) -> list[dict[str, list[int]]]:
    """The embedded pair's held-out code, one file per prompt, cut to the given lengths."""
    from vllm_ddtree.demo import heldout_prompts

    return [{"prompt_token_ids": ids[:n]} for ids, n in zip(heldout_prompts(len(lengths), max(lengths)), lengths)]


@dataclass(frozen=True)
class VerifiedRequests:
    """The requests of one engine step that verified drafts (T of them), from the runner's `TreeStep`:
    tree [T, N], starts [T] (root positions), acceptance (the walk's result)."""

    tree: Any
    starts: Any
    acceptance: Any


def verified_requests(step: Any) -> VerifiedRequests | None:
    """The drafted requests of a sampled `TreeStep`, or None when no request verified drafts (None for a
    plain step, which has no `TreeStep`)."""
    from vllm_ddtree.core import DraftTree, TreeAcceptance

    if step is None:
        return None
    keep = step.num_drafts > 0  # the requests that verified drafts
    if not bool(keep.any()):
        return None
    names = ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes")
    tree = DraftTree(**{name: getattr(step.tree, name)[keep] for name in names}, max_depth=step.tree.max_depth)
    acceptance = TreeAcceptance(*(getattr(step.acceptance, f.name)[keep] for f in fields(TreeAcceptance)))
    return VerifiedRequests(tree, step.starts[keep], acceptance)


def record_verified_steps(runner: Any, steps: list) -> None:
    """Append `verified_requests` of every step the runner samples to `steps` (the V1 runner samples in
    `_sample`, the V2 runner in `sample`)."""
    name = "sample" if hasattr(runner, "speculator") else "_sample"
    sample = getattr(runner, name)

    def recording_sample(*args, **kw):
        out = sample(*args, **kw)
        verified = verified_requests(runner.step)
        if verified is not None:
            steps.append(verified)
        return out

    setattr(runner, name, recording_sample)


@dataclass
class Run:
    """One engine's outputs: per-prompt token ids and finish reasons, the spec-decode counters (and
    preemptions) of `LLM.get_metrics()`, (method 'ddtree') every verify step (`VerifiedRequests`), and
    vLLM's `RequestOutput`s themselves (logprobs, prompt logprobs)."""

    token_ids: list[list[int]]
    finish_reasons: list[str]
    metrics: dict[str, Any]
    steps: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per verify step (accepted draft tokens + bonus)."""
        return 1 + self.metrics["vllm:spec_decode_num_accepted_tokens"] / self.metrics["vllm:spec_decode_num_drafts"]


def _spec_metrics(llm) -> dict[str, Any]:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode") or metric.name == "vllm:num_preemptions":
            out[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


def model_runner(llm: Any) -> Any:
    """The model runner of an engine whose core runs in this process (uniproc executor, no V1
    multiprocessing), where a test reads or drives it directly."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def run_engine(target: str, spec: dict | None, requests, params, **llm_kwargs) -> Run:
    """Build an in-process engine, generate, record, shut it down."""
    from vllm import LLM

    kwargs = {
        "model": target,
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "distributed_executor_backend": "uni",
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": CHUNK,
        "max_num_seqs": 16,
        "disable_log_stats": False,
        "seed": 0,
    }
    kwargs.update(llm_kwargs)
    llm = LLM(speculative_config=spec, **kwargs)
    steps: list[Any] = []
    runner = model_runner(llm)
    if spec is not None and spec.get("method") == "ddtree":
        record_verified_steps(runner, steps)
    try:
        outs = llm.generate(requests, params, use_tqdm=False)
        assert getattr(runner, "num_chain_fallbacks", 0) == 0, "scheduled drafts that were not the proposed trees"
        return Run(
            token_ids=[list(o.outputs[0].token_ids) for o in outs],
            finish_reasons=[o.outputs[0].finish_reason for o in outs],
            metrics=_spec_metrics(llm),
            steps=steps,
            outputs=outs,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{"random": ..., "focused": ..., "trained": (target, draft)}: two synthetic pairs built here
    (vocab 512) and the embedded trained pair (vllm_ddtree/demo/pair)."""
    from vllm_ddtree.demo import demo_pair_paths

    root = tmp_path_factory.mktemp("pairs")
    pairs = {name: build_pair(str(root / name), focused=name == "focused") for name in ("random", "focused")}
    return {**pairs, "trained": demo_pair_paths()}


@pytest.fixture(scope="session")
def engine_runs(pair_dirs) -> Callable[..., Run]:
    """engine_runs(pair, spec, **llm_kwargs) -> Run over the standard prompts, computed once per session.

    spec: None (plain decoding), ("dflash", k) or ("ddtree", budget[, extra keys dict]); ddtree budgets
    are fixed (`ddtree_adaptive: false`) unless the extra keys say otherwise, so tests that count
    tree steps do not depend on the adaptive policy's timing.
    Prompts: the standard token-id prompts; held-out code of the same lengths for the trained pair.
    """
    from vllm import SamplingParams

    cache: dict[str, Run] = {}

    def get(pair: str, spec: tuple | None, **llm_kwargs) -> Run:
        key = json.dumps([pair, spec, llm_kwargs], sort_keys=True)
        if key not in cache:
            target, draft = pair_dirs[pair]
            config = None
            if spec is not None:
                method, k, *extra = spec
                fixed = {"ddtree_adaptive": False} if method == "ddtree" else {}
                config = {"method": method, "model": draft, "num_speculative_tokens": k, **fixed, **(extra[0] if extra else {})}
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            requests = heldout_code_prompts() if pair == "trained" else prompts()
            cache[key] = run_engine(target, config, requests, params, **llm_kwargs)
        return cache[key]

    return get
