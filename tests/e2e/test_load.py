"""Method 'ddtree' behind the OpenAI-compatible server under concurrent load: every request
is answered correctly or refused alone, and nothing leaks.

One server (the `server` fixture of test_serve: focused pair, budget 16, `--skip-tokenizer-init`) gets:
1. 64 concurrent streaming completions with mixed parameters (greedy at several max_tokens, greedy
   with a stop token id, seeded temperature/top_p) plus one request the server refuses
   (`logprobs=-1`, the whole vocabulary, over the server's max_logprobs: vLLM's own cap), which must
   get HTTP 400 while the others complete. The refused request is sent once a load stream has begun,
   and that stream is held open (not read further) until the 400 is back, so the refusal is answered
   while the load is in flight. Every greedy output equals the same prompt's greedy output sent alone;
   identical seeded requests give identical outputs.
2. 32 more streaming requests, half closed by the client after a few chunks (server-side abort);
   the other half still equal their alone-greedy outputs.
3. Afterwards /metrics shows `vllm:num_requests_running` 0 and `vllm:kv_cache_usage_perc` 0 (no KV
   blocks leaked by finished or aborted requests), and a last greedy request is still correct.
"""

from __future__ import annotations

import asyncio
import collections
import time

from tests.e2e.conftest import prompts
from tests.e2e.served import get
from tests.e2e.test_serve import server  # noqa: F401  (the module-scoped server fixture)

GREEDY_TOKENS = 32
LOAD_REQUESTS = 64
ABORT_REQUESTS = 32
LOAD_DEADLINE_S = 90
PROMPTS = [p["prompt_token_ids"] for p in prompts(lengths=(3, 9, 17, 28, 40, 57, 80, 120), seed=5)]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _gauge(metrics_text: str, name: str) -> float:
    """Sum of a gauge over its label sets (one engine here)."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} missing from /metrics"
    return total


async def _stream(
    client, model, prompt, *, abort_after: int | None = None, hold: tuple[asyncio.Event, asyncio.Event] | None = None, **params
) -> tuple[list[int], str | None, float]:
    """One streaming completion: (token ids, finish reason, latency); closed early if abort_after is set.
    hold=(begun, release): after the first chunk, set `begun` and read no further until `release` is set."""
    started = time.monotonic()
    tokens: list[int] = []
    finish = None
    extra_body = {**EXTRA, **params.pop("extra_body", {})}
    stream = await client.completions.create(model=model, prompt=prompt, stream=True, extra_body=extra_body, **params)
    chunks = 0
    try:
        async for chunk in stream:
            chunks += 1
            tokens += chunk.choices[0].token_ids or []
            finish = chunk.choices[0].finish_reason or finish
            if hold is not None and chunks == 1:
                hold[0].set()
                await hold[1].wait()
            if abort_after is not None and chunks >= abort_after:
                break
    finally:
        await stream.close()
    return tokens, finish, time.monotonic() - started


def test_concurrent_streams_aborts_and_kv_release(server):  # noqa: F811
    from openai import AsyncOpenAI, BadRequestError

    started = time.monotonic()
    model = server.model
    errors: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []

    async def guarded(coro):
        try:
            result = await coro
            latencies.append(result[2])
            return result
        except Exception as e:  # noqa: BLE001  (counted by kind, then asserted zero)
            errors[type(e).__name__] += 1
            return e

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=LOAD_DEADLINE_S, max_retries=0)
        # Reference: every greedy prompt alone, one at a time.
        refs = []
        for p in PROMPTS:
            tokens, finish, _ = await _stream(client, model, p, max_tokens=GREEDY_TOKENS, temperature=0.0)
            assert len(tokens) == GREEDY_TOKENS and finish == "length"
            refs.append(tokens)

        # 1. Mixed concurrent load + one unsupported request.
        specs = []
        for i in range(LOAD_REQUESTS):
            p, kind = i % len(PROMPTS), i % 4
            ref = refs[p]
            if kind == 0:
                specs.append(("greedy", p, ref, {"max_tokens": GREEDY_TOKENS, "temperature": 0.0}))
            elif kind == 1:
                n = 4 + (i % 5) * 6
                specs.append(("greedy", p, ref[:n], {"max_tokens": n, "temperature": 0.0}))
            elif kind == 2:
                stop = ref[5 + i % 20]
                j = ref.index(stop)
                specs.append(("stop", p, ref[: j + 1], {"max_tokens": GREEDY_TOKENS, "temperature": 0.0,
                                                           "extra_body": {"stop_token_ids": [stop]}}))
            else:
                seed = (i // 8) % 2  # requests i and i + 16 are identical
                params = {"max_tokens": 12 + 8 * seed, "temperature": 0.8, "seed": seed}
                if seed:
                    params["top_p"] = 0.9
                specs.append(("seeded", (p, seed), None, params))

        # Load stream 0 holds its response open after its first chunk until the refusal is back.
        held_begun, refusal_back = asyncio.Event(), asyncio.Event()
        load_done: list[int] = []  # indices of the load streams whose response ended, in order

        async def load_stream(i: int, prompt: list[int], params: dict):
            try:
                return await _stream(client, model, prompt, hold=(held_begun, refusal_back) if i == 0 else None, **params)
            finally:
                load_done.append(i)
                if i == 0:
                    held_begun.set()  # stream 0 failed before its first chunk: the refusal goes on, `errors` reports it

        async def unsupported():
            await held_begun.wait()  # the load has begun: the server is streaming load stream 0
            try:
                await client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, logprobs=-1, extra_body=EXTRA)
            except BadRequestError as e:
                return e, len(load_done)
            finally:
                refusal_back.set()
            return None, len(load_done)

        load_started = time.monotonic()
        tasks = [guarded(load_stream(i, PROMPTS[p if kind != "seeded" else p[0]], params))
                 for i, (kind, p, _, params) in enumerate(specs)]
        *results, (refused, done_at_refusal) = await asyncio.wait_for(asyncio.gather(*tasks, unsupported()), LOAD_DEADLINE_S)
        load_s = time.monotonic() - load_started
        assert isinstance(refused, BadRequestError) and refused.status_code == 400, refused
        assert "logprobs" in str(refused), refused
        assert done_at_refusal < LOAD_REQUESTS, "the refusal was answered after the whole load had ended"
        assert not errors, errors
        seeded: dict = {}
        for (kind, p, want, params), (tokens, finish, _) in zip(specs, results):
            if kind == "greedy":
                assert tokens == want and finish == "length", (p, params, tokens, want)
            elif kind == "stop":
                assert tokens in (want, want[:-1]) and finish == "stop", (p, params, tokens, want)
            else:
                assert len(tokens) == params["max_tokens"] and finish == "length"
                assert all(0 <= t < 512 for t in tokens)
                assert seeded.setdefault(p, tokens) == tokens, f"seeded request {p} not reproducible"
        served = len(results)

        # 2. Streams closed by the client mid-way (aborted server-side) among complete ones.
        abort_specs = [(i % len(PROMPTS), 3 if i % 2 else None) for i in range(ABORT_REQUESTS)]
        abort_results = await asyncio.wait_for(asyncio.gather(*[
            guarded(_stream(client, model, PROMPTS[p], abort_after=a, max_tokens=GREEDY_TOKENS, temperature=0.0))
            for p, a in abort_specs]), LOAD_DEADLINE_S)
        assert not errors, errors
        cut = 0
        for (p, a), (tokens, finish, _) in zip(abort_specs, abort_results):
            if a is None:
                assert tokens == refs[p] and finish == "length"
            else:
                assert tokens == refs[p][: len(tokens)]  # may already be complete: a chunk carries a whole accepted path
                cut += len(tokens) < GREEDY_TOKENS
        assert cut > 0, "no stream was closed before its end"
        served += len(abort_results)

        # 3. Nothing left running, no KV block leaked, still correct.
        deadline = time.monotonic() + 20
        while True:
            metrics = get(f"{server.url}/metrics")
            running = _gauge(metrics, "vllm:num_requests_running")
            kv = _gauge(metrics, "vllm:kv_cache_usage_perc")
            if (running == 0 and kv == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        tokens, finish, _ = await _stream(client, model, PROMPTS[3], max_tokens=GREEDY_TOKENS, temperature=0.0)
        assert tokens == refs[3] and finish == "length"
        await client.close()
        return served, load_s, running, kv, cut, LOAD_REQUESTS - done_at_refusal

    served, load_s, running, kv, cut, open_at_refusal = asyncio.run(main())
    lat = sorted(latencies)
    p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"served {served} streaming requests (+1 refused with 400 while {open_at_refusal} load streams were open, {ABORT_REQUESTS // 2} closed after 3 chunks, {cut} of them before the end); "
          f"errors {dict(errors) or 'none'}; 64-request load {load_s:.1f} s; latency p50 {p50:.2f} s, "
          f"p99 {p99:.2f} s; after the run: running {running:.0f}, kv_cache_usage_perc {kv:.4f}; "
          f"test {time.monotonic() - started:.1f} s")
    assert running == 0, running
    assert kv == 0, kv
