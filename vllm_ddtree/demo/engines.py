"""Several vLLM engines alive at once, timed round-robin on the same work (the benchmark and demo harness).

Interleaving. All variants' engines are started first; then each round times every variant once on the
same work (`run_round`), call by call: each `LLM.generate` call of the work (one batch) is served by
every engine in turn, in an order rotated by one place per call and per round, so that a drift of the
machine's speed (a shared VM) hits every variant alike and ratios can be taken inside a round
(`vllm_ddtree.demo.stats`). (Timing whole passes one engine after another instead, two identical
engines without speculation differed by up to 37% in a short cell, every round the same way.)

Processes. In-process vLLM engines cannot coexist (shutting one down tears down the others' process
groups), so every `LLM` here runs vLLM's V1 multiprocessing engine core (VLLM_ENABLE_V1_MULTIPROCESSING=1):
its own engine-core process, which holds the scheduler and, through vLLM's single-process executor,
the model runner too (by default vLLM's CPU platform adds a worker process per engine and pins its
OpenMP threads to core 0). An idle engine core blocks on its input socket (measured: under 1% of a core
while another engine runs), so only the engine being timed computes. Engines start one after the other
(vLLM's start-up keeps process-global state, plugins and the Prometheus registry, and is not safe in
parallel threads): about 8 s each on two shared cores, mostly the engine-core process importing vLLM;
each engine-core process of the tiny pair holds about 0.85 GB (measured with 6-9 engines alive).

What is read, and how:
* spec-decode counters: a stat logger added to each engine's own stat-logger manager sums the
  SpecDecodingStats that vLLM's scheduler sends with every step (what vllm:spec_decode_* count;
  `LLM.get_metrics()` reads process-global Prometheus metrics, which follow only the last engine started);
* the DDTree runner's stage times (VLLM_DDTREE_STAGE_TIMES=1, fixed-shape engines only: `stage_timed`)
  and the adaptive budget policy's step counts: `LLM.collective_rpc` with this module's functions
  (VLLM_ALLOW_INSECURE_SERIALIZATION=1), before and after each timed run;
* decode steps alone: before each timed pass the engine serves the same prompts with max_tokens 1 (the
  same prefill steps, which also give each prompt its first token); the timed pass minus that pass is
  the decode steps' time, stages and step count. Their target-forward rows: one per request and decode
  step, plus one per verified draft token (from the counters).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from vllm_ddtree.core import SamplingRegimes
from vllm_ddtree.demo.side_by_side import SpecCounters, decode_steps, tokens_per_decode_step
from vllm_ddtree.demo.stats import StepSplit, step_split
from vllm_ddtree.vllm.stage_times import ENV_FLAG as STAGE_TIMES_FLAG
from vllm_ddtree.vllm.stage_times import STAGES

T = TypeVar("T")

SNIPPET_TOKENS = 256  # tokens per held-out snippet (vllm_ddtree.demo.heldout_prompts)
SEED_BASE = 1000  # prompt i samples with seed SEED_BASE + i at T > 0

ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    # the engine-core process runs the model itself (a string, so that vLLM's CPU platform keeps it)
    "distributed_executor_backend": "vllm.v1.executor.uniproc_executor.UniProcExecutor",
    "disable_log_stats": False,  # the stat loggers (and so our SpecRecorder) run
    "seed": 0,
    "kv_cache_memory_bytes": 64 * 2**20,
    "max_model_len": 1024,
}


def configure_environment() -> None:
    """Environment of this process and of every engine started from it; call before importing vLLM.

    One OpenMP thread per engine unless OMP_NUM_THREADS says otherwise (vLLM passes this process's torch
    thread count on to the engine core): with the front end on the other core, two cores are used.
    OMP_WAIT_POLICY=PASSIVE unless set.
    VLLM_CPU_KVCACHE_SPACE is dropped: it would override every engine's kv_cache_memory_bytes.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # Idle OpenMP threads sleep instead of spinning: with every engine alive at once, the engine that just
    # finished its pass would otherwise spin on the cores the next one is timed on (measured: the default
    # config's throughput cell 0.46x -> 0.73x of no speculation, its policy misled into the chain).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))


def context_prompts(n: int, num_tokens: int, tokenizer: str | None = None) -> list[list[int]]:
    """`n` held-out code prompts of exactly `num_tokens` token ids.

    Up to one snippet (256 tokens): `heldout_prompts`. Longer: prompt i concatenates snippets i, i+8,
    i+16, ... (of the 64, cyclically) and is cut to length, so no two prompts start alike (no prefix-cache
    hits between prompts) and prompts 0-7 share no snippet. With `tokenizer` (a model directory or hub
    id, for a target other than the shipped pair's), the snippets' text is tokenized by it instead.
    """
    from vllm_ddtree.demo import heldout_prompts

    if tokenizer is None and num_tokens <= SNIPPET_TOKENS:
        return heldout_prompts(n, num_tokens)
    if n > 64:
        raise ValueError(f"at most 64 prompts, got {n}")
    if tokenizer is None:
        snippets = heldout_prompts(64, SNIPPET_TOKENS)
    else:
        from transformers import AutoTokenizer

        encode = AutoTokenizer.from_pretrained(tokenizer).encode
        snippets = [encode(text, add_special_tokens=False) for text in heldout_prompts(64, SNIPPET_TOKENS, as_text=True)]
    prompts = []
    for i in range(n):
        ids: list[int] = []
        for j in range(len(snippets)):
            ids += snippets[(i + 8 * j) % len(snippets)]
            if len(ids) >= num_tokens:
                break
        prompts.append(ids[:num_tokens])
    return prompts


@dataclass(frozen=True)
class Work:
    """What one timed run serves: every prompt (token ids), `batch` of them per `LLM.generate` call,
    `max_tokens` new tokens each (ignore_eos); greedy at temperature 0, else prompt i seeded with
    SEED_BASE + i (the same draws in every round) unless `seeded` is off (requests as most users send
    them: method 'ddtree' then draws its steps without drafts with vLLM's sampler, seeded ones with the
    core rule, `vllm.sampling.plain_sampler_serves`); the whole pass `repeats` times (a pass of one
    call is one short sample of a drifting machine per round; repeated, its calls interleave with the
    other engines' one by one, `serve_interleaved`, and the round's figure averages over them)."""

    prompts: tuple[tuple[int, ...], ...]
    batch: int
    temperature: float
    max_tokens: int
    seeded: bool = True
    repeats: int = 1

    @property
    def calls_per_pass(self) -> int:
        """`LLM.generate` calls of one pass over the prompts."""
        return -(-len(self.prompts) // self.batch)

    def calls(self) -> Iterator[tuple[list[dict[str, list[int]]], Any]]:
        """(prompts, sampling params) of each `LLM.generate` call, in order."""
        for _ in range(self.repeats):
            yield from self._pass()

    def _pass(self) -> Iterator[tuple[list[dict[str, list[int]]], Any]]:
        from vllm import SamplingParams

        for first in range(0, len(self.prompts), self.batch):
            indices = range(first, min(first + self.batch, len(self.prompts)))
            prompts = [{"prompt_token_ids": list(self.prompts[i])} for i in indices]
            if self.temperature == 0:
                sampling: Any = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
            else:
                sampling = [
                    SamplingParams(temperature=self.temperature, seed=SEED_BASE + i if self.seeded else None,
                                   max_tokens=self.max_tokens, ignore_eos=True)
                    for i in indices
                ]
            yield prompts, sampling


@dataclass(frozen=True)
class Pass:
    """Totals of one pass over a `Work`: summed wall seconds of its `LLM.generate` calls, and for a
    DDTree engine its runner's seconds per stage and "steps" (engine steps; else None)."""

    seconds: float
    stages: dict[str, float] | None


@dataclass(frozen=True)
class TimedRun:
    """One engine's timed pass over a `Work`, with the prefill-only pass run just before it.

    seconds: summed wall time of the `LLM.generate` calls; token_ids: every prompt's output tokens;
    counters: the pass's spec-decode counters; stages: its runner stage seconds and "steps" (DDTree
    engines, else None); shape_steps: for an adaptive DDTree engine, the decode steps its budget policy
    timed, per tree shape ("off", "chain 7", "tree 8", ...; else None); prefill: the same prompts with
    max_tokens 1 and the same batching, i.e. this pass's prefill steps alone (each prompt's first token
    comes from its prefill step), which `split` subtracts to time the decode steps.
    """

    seconds: float
    token_ids: list[list[int]]
    counters: SpecCounters
    stages: dict[str, float] | None
    shape_steps: dict[str, int] | None
    prefill: Pass

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        """Output tokens per wall-clock second."""
        return self.output_tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per request and decode step (`tokens_per_decode_step`; 1 without speculation)."""
        return tokens_per_decode_step(self.counters, self.output_tokens, len(self.token_ids))

    @property
    def nodes_per_step(self) -> float:
        """Draft tokens (tree nodes) verified per request and decode step."""
        steps = decode_steps(self.counters, self.output_tokens, len(self.token_ids))
        return self.counters.draft_tokens / steps if steps > 0 else 0.0

    @property
    def decode_rows(self) -> int:
        """Target-forward rows of the decode steps: one per request and step (`decode_steps`) plus one
        per verified draft token."""
        return decode_steps(self.counters, self.output_tokens, len(self.token_ids)) + self.counters.draft_tokens

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft position k accepted) per drafted request-step, k = 1, 2, ..."""
        c = self.counters
        return [a / c.drafts for a in c.accepted_per_position] if c.drafts else []

    def decode_stages(self) -> tuple[dict[str, float], float] | None:
        """(seconds per runner stage, engine steps) of the decode steps: this pass minus its prefill
        pass (None for engines without stage times)."""
        if self.stages is None or self.prefill.stages is None:
            return None
        steps = self.stages["steps"] - self.prefill.stages["steps"]
        if steps <= 0:
            return None
        return {name: self.stages[name] - self.prefill.stages[name] for name in STAGES}, steps

    def decode_stage_ms(self) -> dict[str, float] | None:
        """Milliseconds per decode step by runner stage (None without stage times)."""
        decode = self.decode_stages()
        return None if decode is None else {name: 1000 * seconds / decode[1] for name, seconds in decode[0].items()}

    def split(self) -> StepSplit | None:
        """The decode steps' `StepSplit` (None without stage times)."""
        decode = self.decode_stages()
        return None if decode is None else step_split(self.seconds - self.prefill.seconds, *decode, self.decode_rows)


class SpecRecorder:
    """A vLLM stat logger (the `StatLoggerBase` interface) summing one engine's spec-decode stats."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0
        self.accepted_per_position: list[int] = []

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if stats is None:
            return
        self.drafts += stats.num_drafts
        self.draft_tokens += stats.num_draft_tokens
        self.accepted += stats.num_accepted_tokens
        per_position = stats.num_accepted_tokens_per_pos
        if len(self.accepted_per_position) < len(per_position):
            self.accepted_per_position += [0] * (len(per_position) - len(self.accepted_per_position))
        for i, count in enumerate(per_position):
            self.accepted_per_position[i] += count

    def counters(self) -> SpecCounters:
        return SpecCounters(self.drafts, self.draft_tokens, self.accepted, tuple(self.accepted_per_position))

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


def shape_label(shape: Any) -> str:
    """"off", "chain N" or "tree N" for a `vllm_ddtree.core.TreeShape`."""
    if shape.budget == 0:
        return "off"
    return f"{'chain' if shape.topk == 1 else 'tree'} {shape.budget}"


def runner_state(worker: Any) -> tuple[dict[str, float] | None, dict[str, int] | None]:
    """(stage seconds + "steps", adaptive policy's timed decode steps per shape) of a worker's DDTree
    runner, each None where absent. Runs inside the engine-core process (`LLM.collective_rpc`)."""
    runner = worker.model_runner
    timer = getattr(runner, "stage_times", None)
    stages = timer.snapshot() if timer is not None and timer.enabled else None
    policy = getattr(getattr(runner, "drafter", None), "budget_policy", None)
    if policy is None:
        return stages, None
    steps: Counter[str] = Counter()
    for regime in policy.policies.values() if isinstance(policy, SamplingRegimes) else (policy,):
        for (_, shape), costs in regime.costs.items():
            steps[shape_label(shape)] += costs.steps
    return stages, dict(steps)


def _difference(after: dict[str, T] | None, before: dict[str, T] | None) -> dict[str, T] | None:
    if after is None:
        return None
    return {key: value - (before or {}).get(key, 0) for key, value in after.items()}


def stage_timed(speculative_config: dict[str, Any] | None) -> bool:
    """Whether an engine of this config times its runner stages: DDTree engines with a fixed shape
    (`ddtree_adaptive: false`), whose stage split the breakdown and the zero-overhead bound read. An
    adaptive engine (DDTree's default config) runs as users run it, without the timer: its ~8 timed
    blocks per step cost about 1% of a batch-1 step (measured in-process at batch 1, T=1, 2k-token
    prompts, interleaved per request: 0.924x vs 0.933x no speculation), which no engine without a DDTree
    runner (no speculation, vLLM's chain) pays. The fixed shapes keep that handicap."""
    return bool(speculative_config) and speculative_config.get("method") == "ddtree" and speculative_config.get("ddtree_adaptive") is False


class Engine:
    """One variant's `LLM` (its own engine-core process) with its spec-decode recorder."""

    def __init__(self, name: str, llm: Any, recorder: SpecRecorder) -> None:
        self.name = name
        self.llm = llm
        self.recorder = recorder

    @classmethod
    def start(cls, name: str, target: str, speculative_config: dict[str, Any] | None, engine_kwargs: dict[str, Any]) -> Engine:
        from vllm import LLM

        os.environ[STAGE_TIMES_FLAG] = "1" if stage_timed(speculative_config) else "0"  # read in the engine's runner
        llm = LLM(model=target, speculative_config=speculative_config, **engine_kwargs)
        recorder = SpecRecorder()
        llm.llm_engine.logger_manager.stat_loggers.append(recorder)
        return cls(name, llm, recorder)

    def snapshot(self) -> tuple[dict[str, float] | None, dict[str, int] | None, SpecCounters]:
        """Runner stage times, policy step counts (`runner_state`) and spec-decode counters so far."""
        stages, shapes = self.llm.collective_rpc(runner_state)[0]
        return stages, shapes, self.recorder.counters()

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def start_engines(
    target: str, variants: Sequence[tuple[str, dict[str, Any] | None]], engine_kwargs: dict[str, Any], say: Callable[[str], None]
) -> tuple[list[Engine], dict[str, str]]:
    """Start one engine per (name, speculative_config), in order, saying one line per engine; returns the
    engines and, per variant that failed to start, its error."""
    engines, errors = [], {}
    for name, config in variants:
        start = time.perf_counter()
        try:
            engines.append(Engine.start(name, target, config, engine_kwargs))
        except Exception as exc:  # noqa: BLE001 - one broken variant must not stop the others
            errors[name] = f"{type(exc).__name__}: {exc}"
            say(f"  FAILED to start {name}: {errors[name]}")
            continue
        say(f"  started {name} ({time.perf_counter() - start:.1f} s)")
    return engines, errors


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """`items` starting at index shift mod len: round k of an interleaved run uses rotation k."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def run_round(engines: Sequence[Engine], work: Work, shift: int) -> dict[str, TimedRun]:
    """One round: every engine serves `work` with max_tokens 1 (its prefill steps), then `work` itself,
    both interleaved call by call (`serve_interleaved`)."""
    prefill = serve_interleaved(engines, replace(work, max_tokens=1), shift)
    timed = serve_interleaved(engines, work, shift)
    return {
        name: TimedRun(served.seconds, token_ids, counters, served.stages, shape_steps, prefill[name][0])
        for name, (served, token_ids, counters, shape_steps) in timed.items()
    }


def serve_interleaved(
    engines: Sequence[Engine], work: Work, shift: int
) -> dict[str, tuple[Pass, list[list[int]], SpecCounters, dict[str, int] | None]]:
    """Every engine serves `work` once: call k of the work by every engine in turn, in the engines' order
    rotated by `shift` + k, timing only the `LLM.generate` calls. Per engine: its pass (seconds, stage
    times), every prompt's output tokens, its spec-decode counters and its policy's steps per shape
    (read before and after the pass; an idle engine's counters do not move)."""
    before = {engine.name: engine.snapshot() for engine in engines}
    seconds = dict.fromkeys(before, 0.0)
    token_ids: dict[str, list[list[int]]] = {name: [] for name in before}
    for index, (prompts, sampling) in enumerate(work.calls()):
        for engine in rotated(engines, shift + index):
            start = time.perf_counter()
            outputs = engine.llm.generate(prompts, sampling, use_tqdm=False)
            seconds[engine.name] += time.perf_counter() - start
            token_ids[engine.name] += [list(o.outputs[0].token_ids) for o in outputs]
    served = {}
    for engine in engines:
        stages_before, shapes_before, counters_before = before[engine.name]
        stages_after, shapes_after, counters_after = engine.snapshot()
        served[engine.name] = (
            Pass(seconds[engine.name], _difference(stages_after, stages_before)),
            token_ids[engine.name],
            counters_after - counters_before,
            _difference(shapes_after, shapes_before),
        )
    return served


def shutdown_all(engines: Sequence[Engine]) -> None:
    for engine in engines:
        engine.shutdown()
