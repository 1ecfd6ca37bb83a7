"""Hostile HTTP requests to `vllm serve` under method 'ddtree' (default adaptive configuration, the
embedded trained pair, multiprocess engine as users run it): nothing a client sends takes the engine
down.

Raw JSON bodies (so NaN, Infinity, integers past int64 and wrong types reach the server as sent),
all posted at once from threads while greedy completions run beside them (each twice at once, under
one client-chosen X-Request-Id). Each hostile request gets the status vLLM's validation gives it (400
for what vLLM or method 'ddtree' refuses, 200 for what it serves; a 500 only where vLLM itself ends a
request with an error, as plain decoding does offline: a grammar that rejects the one token the other
options leave, test_hostile_requests), the greedy completions equal the same completions sent alone
before (`reference`), and afterwards the server is healthy, runs nothing, holds no KV block, and
still answers the reference completions unchanged.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import MAX_MODEL_LEN
from tests.e2e.served import get, vllm_serve
from tests.e2e.test_load import _gauge

MAX_TOKENS = 24
NAN, INF = float("nan"), float("inf")
HOSTILE: dict[str, tuple[dict, int]] = {  # name -> (completion fields besides model/prompt, expected status)
    "logit_bias key not an integer": ({"logit_bias": {"abc": 1.0}}, 400),
    "logit_bias id past the vocabulary": ({"logit_bias": {"4097": 1.0}}, 400),
    "logit_bias NaN (clamped by the server)": ({"logit_bias": {"5": NAN}, "temperature": 0.9}, 200),
    "logit_bias Infinity (clamped by the server)": ({"logit_bias": {"5": INF}, "temperature": 0.9}, 200),
    "temperature NaN": ({"temperature": NAN}, 400),
    "temperature Infinity": ({"temperature": INF}, 400),
    "top_p 0": ({"temperature": 1.0, "top_p": 0.0}, 400),
    "top_k -5": ({"temperature": 1.0, "top_k": -5}, 400),
    "min_p 2": ({"temperature": 1.0, "min_p": 2.0}, 400),
    "repetition_penalty Infinity": ({"repetition_penalty": INF}, 400),
    "repetition_penalty 1e-45": ({"repetition_penalty": 1e-45, "temperature": 0.8}, 200),
    "seed past 2**64": ({"temperature": 1.0, "seed": 2**64 + 5}, 400),
    "smallest int64 seed": ({"temperature": 1.0, "seed": -(2**63)}, 200),
    "greedy n 3": ({"n": 3, "temperature": 0.0}, 400),
    "n 3 seeded with penalties": ({"n": 3, "temperature": 0.8, "seed": 1, "presence_penalty": 2.0, "frequency_penalty": -2.0}, 200),
    "max_tokens 1e12": ({"max_tokens": 10**12}, 400),
    "max_tokens not a number": ({"max_tokens": "many"}, 400),
    "prompt token id past the vocabulary": ({"prompt": [5, 4097]}, 400),
    "empty prompt": ({"prompt": []}, 400),
    "prompt of max_model_len tokens": ({"prompt": [5] * MAX_MODEL_LEN}, 400),
    "logprobs 21": ({"logprobs": 21}, 400),
    "echo with logprobs": ({"echo": True, "logprobs": 5, "max_tokens": 1}, 200),
    "empty stop string": ({"stop": [""]}, 400),
    "allowed_token_ids empty": ({"allowed_token_ids": []}, 400),
    "every token masked, sampled": ({"allowed_token_ids": [7, 8], "logit_bias": {"7": -100, "8": -100}, "temperature": 0.9}, 200),
    "allowed EOS only with min_tokens": ({"allowed_token_ids": [0], "min_tokens": 3, "temperature": 0.9}, 200),
    "bad word of 3000 characters": ({"bad_words": ["x" * 3000]}, 200),
    "min_tokens > max_tokens": ({"min_tokens": 30, "max_tokens": 10}, 400),
    "invalid json schema": ({"structured_outputs": {"json": {"type": "nonsense"}}}, 400),
    "invalid regex": ({"structured_outputs": {"regex": "((("}}, 400),
    "grammar admitting only EOS": ({"structured_outputs": {"grammar": 'root ::= ""'}}, 200),
    # vLLM's own rule, as under plain decoding (test_hostile_requests): the options mask every token, the
    # first (EOS) is drawn, the grammar rejects it, vLLM ends that request with an error (HTTP 500)
    "grammar vs allowed_token_ids": ({"structured_outputs": {"choice": ["return"]}, "allowed_token_ids": [5]}, 500),
    "thinking_token_budget": ({"thinking_token_budget": 5}, 400),
    "streamed n 2 with a grammar and logprobs": ({"stream": True, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": 2,
                                                  "structured_outputs": {"choice": ["return self", "pass"]}}, 200),
}


def _texts() -> list[str]:
    from vllm_ddtree.demo import heldout_prompts

    return heldout_prompts(4, 48, as_text=True)


def _post(url: str, body: dict, request_id: str | None = None) -> tuple[int, str]:
    """POST a JSON body to the completions endpoint as Python's json writes it (NaN and Infinity
    included), with an X-Request-Id header if given: (status, response text)."""
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _greedy(url: str, model: str, text: str, request_id: str | None = None) -> list[int]:
    status, body = _post(url, {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                               "ignore_eos": True, "return_token_ids": True}, request_id)
    assert status == 200, body
    return json.loads(body)["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def server(pair_dirs, tmp_path_factory):
    target, draft = pair_dirs["trained"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16}
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "64"]
    with vllm_serve(target, spec, args, tmp_path_factory.mktemp("serve")) as served:
        yield served


def test_hostile_requests_are_answered_alone_and_the_server_serves_on(server):
    url, model, texts = server.url, server.model, _texts()
    reference = [_greedy(url, model, text) for text in texts]
    jobs = [("hostile", name, {"model": model, "prompt": texts[i % len(texts)], "max_tokens": MAX_TOKENS, **fields})
            for i, (name, (fields, _)) in enumerate(HOSTILE.items())]
    jobs += [("greedy", i, None) for i in range(len(texts))]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        # every greedy completion twice, both copies under one client-chosen X-Request-Id
        futures = [pool.submit(_greedy, url, model, texts[key], f"same-id-{key}") if kind == "greedy" else pool.submit(_post, url, body)
                   for kind, key, body in jobs + [job for job in jobs if job[0] == "greedy"]]
        results = [future.result() for future in futures]
    answers = {key: result for (kind, key, _), result in zip(jobs, results) if kind == "hostile"}
    unexpected = {name: (status, text[:300]) for name, (status, text) in answers.items() if status != HOSTILE[name][1]}
    assert not unexpected, unexpected
    assert [result for (kind, _, _), result in zip(jobs + jobs[-len(texts):], results) if kind == "greedy"] == reference * 2
    assert get(f"{url}/health") == ""
    deadline = time.monotonic() + 20
    while True:
        metrics = get(f"{url}/metrics")
        running, kv = _gauge(metrics, "vllm:num_requests_running"), _gauge(metrics, "vllm:kv_cache_usage_perc")
        if (running == 0 and kv == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (running, kv) == (0, 0)
    assert [_greedy(url, model, text) for text in texts] == reference
