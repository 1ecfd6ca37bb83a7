"""Method 'ddtree' behind vLLM's OpenAI-compatible server, driven by the official `openai` client.

The server runs as a subprocess started as users type it (`vllm serve TARGET --speculative-config ...`,
`served.vllm_serve`) on the focused pair with `--speculative-config '{"method": "ddtree", ...}'` and
`--skip-tokenizer-init` (token-id prompts, output read from `token_ids`).

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

import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import MAX_MODEL_LEN, MAX_TOKENS, prompts
from tests.e2e.served import Served, get, vllm_serve


@pytest.fixture(scope="module")
def server(pair_dirs, tmp_path_factory) -> Iterator[Served]:
    target, draft = pair_dirs["focused"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    args = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    with vllm_serve(target, spec, args, tmp_path_factory.mktemp("serve")) as served:
        yield served


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

    counters = _spec_counters(get(f"{server.url}/metrics"))
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    tokens_per_step = 1 + counters["vllm:spec_decode_num_accepted_tokens_total"] / drafts
    print(f"server start {server.start_s:.1f} s; {MAX_TOKENS}-token completion latency median "
          f"{sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms; "
          f"tokens per step {tokens_per_step:.2f} over {drafts:.0f} verify steps")
    assert tokens_per_step > 1.5
