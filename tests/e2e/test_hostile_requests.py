"""Hostile requests and option combinations under method 'ddtree', through the user contract only
(`LLM.generate` and `LLMEngine.add_request` / `abort_request` / `step`).

One ddtree engine (the embedded trained pair: it has a tokenizer, so stop strings, bad words and
grammars work; the default adaptive configuration, budget 16; 64-token scheduler budget, so long
prompts are prefilled in chunks and trees get cut) and, before it, one plain engine with the same
settings that computes the references (`plain`). Each probe (`_probes`) is one request:
- vLLM's own refusals (out-of-vocab logit_bias / allowed_token_ids, empty allowed_token_ids,
  min_tokens > max_tokens, out-of-range sampling values, too many logprobs, empty stop strings,
  invalid or unsatisfiable grammars, empty or too long prompts, prompt token ids outside the
  vocabulary, min_tokens past the room left, greedy n > 1): whatever plain decoding refuses, method 'ddtree' refuses with the same message, for that
  request only;
- the rest must give plain decoding's output exactly (tokens, text, finish and stop reason,
  logprobs and prompt logprobs within float tolerance): greedy requests under every option at its
  extremes (huge and infinite logit biases, one allowed token, bad words longer than the output /
  overlapping / single-token, min_tokens = max_tokens, max_tokens 1 and 1e9, stop strings with
  logprobs and with a grammar, penalties at their limits and beyond (+inf logits), logprobs at vLLM's
  max with prompt_logprobs and penalties, grammars that admit only EOS or one string, a grammar that
  ends before min_tokens with stop_token_ids, a prompt of max_model_len - 1 tokens), sampled requests whose law is a point mass (top_p 1e-9, min_p 1, top_k
  1 at T 2) and sampled requests whose rows have no mass at all (every token masked; +inf biases);
- seeded sampled requests (n > 1 with penalties, top_k past the vocabulary, T 2, T 1e-6 (vLLM clamps
  it to 0.01), a grammar, a choice with n 2, logprobs and a stop string, seeds at both ends of the
  range) have no plain reference (vLLM's sampler draws other uniforms): their tokens must not depend
  on the batch, the step shapes or the timing.
Runs: every probe alone (a fixed tree each step), all of them in one batch with the step shapes
forced through off / tree / chain / small trees, refusals while requests are in flight (also method
'ddtree''s own: seeds a torch generator cannot take, NaN biases), aborts mid-prefill and mid-decode,
the adaptive policy with seeded random delays injected into every step (its choices vary, the
outputs may not), a one-token prompt joining a decoding batch (vLLM pads it with placeholder drafts), and vLLM's beam search (per-step logprobs requests). After each run a plain greedy
batch still equals plain decoding.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, model_runner
from tests.e2e.scripted_budget import ScriptedBudget
from vllm_ddtree.core import OFF, AdaptiveBudget, TreeShape, candidate_shapes

BUDGET = 16
DEPTH = 7  # the trained pair's block size - 1
MAX_MODEL_LEN = 512
MAX_TOKENS = 24
TOKEN_BUDGET = 64  # max_num_batched_tokens: chunked prefill, trees cut in full batches
TOL = 1e-4
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
NUM_VLLM_REFUSALS = 23  # the first probes of `_probes`
TREE = [TreeShape(BUDGET)]
MIXED = [OFF, TreeShape(BUDGET), TreeShape(DEPTH, 1), TreeShape(4), TreeShape(8)]
CHOICES = ["return self", "return None", "raise NotImplementedError", "pass"]
DEF_REGEX = r"def [a-z_]{1,12}\(self(, [a-z_]{1,12}){0,2}\):"


@dataclass(frozen=True)
class Probe:
    """One request: prompt (text, or token ids as vLLM's dict), SamplingParams keywords, and seeded:
    no plain reference (compared with itself across runs), else it must equal plain decoding."""

    prompt: Any
    options: dict
    seeded: bool = False

    def params(self):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        options = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **self.options}
        return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **options)


def _texts() -> list[str]:
    from vllm_ddtree.demo import heldout_prompts

    return heldout_prompts(8, 48, as_text=True)


def _long_prompt(length: int) -> dict:
    """Held-out code token ids, `length` of them (two snippets back to back)."""
    from vllm_ddtree.demo import heldout_prompts

    first, second = heldout_prompts(2, 256)
    return {"prompt_token_ids": (first + second)[:length]}


def _probes(free: list[list[int]], tokenizer: Any) -> dict[str, Probe]:
    """Every probe; free: plain greedy outputs of `_texts()` (bad words and biases are taken from
    them, so that they act)."""
    from vllm.sampling_params import StructuredOutputsParams as Structured

    texts = _texts()
    frequent = [token for token, _ in Counter(t for out in free for t in out).most_common(6)]
    f0, f1, f2, f3, f4, f5 = frequent
    inf = float("inf")

    def words(*spans: list[int]) -> list[str]:
        return [tokenizer.decode(span) for span in spans]

    def p(i: int, seeded: bool = False, **options) -> Probe:
        return Probe(texts[i % len(texts)], options, seeded)

    return {
        # vLLM's own refusals (plain decoding refuses them too)
        "logit_bias id past the vocabulary": p(0, logit_bias={4097: 1.0}),
        "logit_bias negative id": p(0, logit_bias={-1: 1.0}),
        "allowed_token_ids past the vocabulary": p(0, allowed_token_ids=[5, 4097]),
        "allowed_token_ids empty": p(0, allowed_token_ids=[]),
        "min_tokens > max_tokens": p(0, min_tokens=30, max_tokens=10),
        "temperature 1e6": p(0, temperature=1e6),
        "top_p 0": p(0, temperature=1.0, top_p=0.0),
        "min_p 1.5": p(0, temperature=1.0, min_p=1.5),
        "presence_penalty 3": p(0, presence_penalty=3.0),
        "repetition_penalty 0": p(0, repetition_penalty=0.0),
        "logprobs past max_logprobs": p(0, logprobs=21),
        "prompt_logprobs past max_logprobs": p(0, prompt_logprobs=21),
        "empty stop string": p(0, stop=[""]),
        "invalid json schema": p(0, structured_outputs=Structured(json={"type": "nonsense"})),
        "json schema not json": p(0, structured_outputs=Structured(json='{"type": ')),
        "unsatisfiable json schema": p(0, structured_outputs=Structured(json={"type": "string", "minLength": 5, "maxLength": 2})),
        "invalid regex": p(0, structured_outputs=Structured(regex="(((")),
        "empty prompt": Probe({"prompt_token_ids": []}, {}),
        "prompt token id past the vocabulary": Probe({"prompt_token_ids": [5, 6, 4097]}, {}),
        "negative prompt token id": Probe({"prompt_token_ids": [5, -1, 6]}, {}),
        "prompt of max_model_len + 1 tokens": Probe(_long_prompt(MAX_MODEL_LEN + 1), {}),
        "n 2, greedy": p(0, n=2),
        "min_tokens past the room left": Probe(_long_prompt(MAX_MODEL_LEN - 12), {"max_tokens": None, "min_tokens": 20}),
        # greedy, equal to plain decoding
        "logit_bias 1e30": p(1, logit_bias={f4: 1e30}),
        "logit_bias -inf on the greedy picks": p(2, logit_bias={f0: -inf, f1: -1e30, f2: -100.0}),
        "logit_bias +inf on two tokens": p(3, logit_bias={f3: inf, f2: inf}),
        "allowed_token_ids one token": p(4, allowed_token_ids=[f3]),
        "allowed_token_ids with a -inf bias": p(5, allowed_token_ids=[f0, f1, f2, f3], logit_bias={f0: -inf}),
        "bad_words longer than the output": p(0, bad_words=words(free[0][:40])),
        "bad_words matching the output": p(0, bad_words=words(free[0][4:10])),
        "bad_words overlapping": p(1, bad_words=words(free[1][2:4], free[1][3:5])),
        "bad_words single tokens": p(2, bad_words=words([f0], [f1])),
        "min_tokens = max_tokens": p(3, min_tokens=MAX_TOKENS, ignore_eos=False),
        "max_tokens 1": p(4, max_tokens=1),
        "stop strings with logprobs": p(5, stop=["\n", " = "], logprobs=5, ignore_eos=False),
        "stop string with a grammar": p(6, stop=["("], structured_outputs=Structured(regex=DEF_REGEX), ignore_eos=False),
        "top_p 1e-9": p(7, temperature=1.0, top_p=1e-9),
        "min_p 1": p(0, temperature=1.3, min_p=1.0),
        "top_k 1 at temperature 2": p(1, temperature=2.0, top_k=1),
        "penalties at their maxima": p(3, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0),
        "penalties at their minima": p(4, presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=0.5),
        "repetition_penalty 1e-45 (inf logits)": p(5, repetition_penalty=1e-45),
        "repetition_penalty 1e30": p(6, repetition_penalty=1e30),
        "logprobs 20 and prompt_logprobs 20 with penalties": p(7, logprobs=20, prompt_logprobs=20, presence_penalty=1.0, repetition_penalty=1.3),
        "logprobs 0": p(0, logprobs=0, prompt_logprobs=0),
        "grammar admitting only EOS": p(1, structured_outputs=Structured(grammar='root ::= ""'), ignore_eos=False),
        "choice of the empty string": p(2, structured_outputs=Structured(choice=[""]), ignore_eos=False),
        "json const": p(3, structured_outputs=Structured(json={"const": 1}), ignore_eos=False),
        "one choice, ignore_eos": p(4, structured_outputs=Structured(choice=["return"]), max_tokens=12),
        "grammar vs allowed_token_ids": p(5, structured_outputs=Structured(choice=["return"]), allowed_token_ids=[f5], ignore_eos=False),
        # the grammar ends before min_tokens: vLLM keeps a structured request's stop tokens where masking them
        # would leave no token at all, so it stops on the best stop token
        "grammar ended before min_tokens, stop_token_ids": p(6, structured_outputs=Structured(choice=["return"]), min_tokens=5,
                                                             stop_token_ids=[f0, f1], ignore_eos=False),
        "grammar ended before min_tokens, stop_token_ids, ignore_eos": p(7, structured_outputs=Structured(choice=["return"]),
                                                                         min_tokens=5, stop_token_ids=[f2]),
        "max_tokens 1e9 (cut at max_model_len)": Probe(_long_prompt(MAX_MODEL_LEN - 30), {"max_tokens": 10**9, "presence_penalty": 1.0}),
        "prompt of max_model_len - 1 tokens": Probe(_long_prompt(MAX_MODEL_LEN - 1), {"logprobs": 3, "prompt_logprobs": 2, "presence_penalty": 0.5}),
        "prompt of max_model_len - 1 tokens, a grammar": Probe(_long_prompt(MAX_MODEL_LEN - 1), {"structured_outputs": Structured(choice=["return"])}),
        # sampled rows without mass: deterministic, equal to plain decoding
        "every token masked, sampled": p(6, temperature=0.9, allowed_token_ids=[f0, f1], logit_bias={f0: -inf, f1: -inf}, max_tokens=6),
        "+inf biases, sampled": p(7, temperature=0.9, logit_bias={f2: inf, f3: inf}),
        # seeded: the same tokens whatever the batch, the shapes and the timing
        "n 3, seeded, penalties": p(0, True, n=3, temperature=0.8, seed=4, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2),
        "top_k past the vocabulary": p(1, True, temperature=1.0, top_k=10**6, seed=5),
        "temperature 2, top_p": p(2, True, temperature=2.0, top_p=0.9, seed=6),
        "temperature 1e-6, clamped to 0.01": p(3, True, temperature=1e-6, seed=7),
        "seeded choice, n 2, logprobs, stop string": p(5, True, n=2, temperature=1.0, seed=11, logprobs=2, stop=["r"],
                                                       structured_outputs=Structured(choice=CHOICES), ignore_eos=False),
        "seeded json object": p(4, True, temperature=0.8, seed=8, structured_outputs=Structured(json_object=True), ignore_eos=False),
        "seeded min_p and logit_bias": p(5, True, temperature=1.0, min_p=0.2, logit_bias={f0: 2.0}, seed=9),
        "seeded allowed_token_ids and bad_words": p(6, True, temperature=0.7, allowed_token_ids=frequent, bad_words=words([f0]), seed=10),
        "largest seed": p(7, True, temperature=1.0, seed=SEED_MAX),
        "smallest seed": p(0, True, temperature=1.0, seed=SEED_MIN),
    }


DDTREE_REFUSALS = {  # method 'ddtree''s own (no engine can serve them): keywords, the option named
    "seed past 2**64 - 1": ({"temperature": 1.0, "seed": SEED_MAX + 1}, "seed"),
    "seed below -2**63": ({"temperature": 1.0, "seed": SEED_MIN - 1}, "seed"),
    "n 3 from the largest seed": ({"temperature": 1.0, "seed": SEED_MAX - 1, "n": 3}, "seed"),
    "seed not an integer": ({"temperature": 1.0, "seed": 1.5}, "seed"),
    "NaN logit_bias": ({"temperature": 1.0, "logit_bias": {5: float("nan")}}, "logit_bias"),
}


def _logprobs(positions) -> list | None:
    if positions is None:
        return None
    return [None if lp is None else {token: (v.logprob, v.rank) for token, v in lp.items()} for lp in positions]


def _record(output) -> dict:
    """What a request returned: per sample tokens, text, finish and stop reason, logprobs; prompt logprobs."""
    samples = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason, _logprobs(c.logprobs)) for c in output.outputs]
    return {"samples": samples, "prompt_logprobs": _logprobs(output.prompt_logprobs)}


def _same_logprobs(ours, theirs) -> bool:
    if ours is None or theirs is None:
        return ours is None and theirs is None
    if len(ours) != len(theirs):
        return False
    for mine, plain in zip(ours, theirs):
        if (mine is None) != (plain is None) or (mine is not None and mine.keys() != plain.keys()):
            return False
        for token, (value, rank) in (mine or {}).items():
            other, other_rank = plain[token]
            if rank != other_rank or not (value == other or abs(value - other) < TOL):
                return False
    return True


def _differs(ours: dict, theirs: dict) -> str | None:
    """None if two records agree (logprobs within TOL), else what differs."""
    if len(ours["samples"]) != len(theirs["samples"]):
        return "number of samples"
    for mine, plain in zip(ours["samples"], theirs["samples"]):
        if mine[:4] != plain[:4]:
            return f"output {mine[:4]} != {plain[:4]}"
        if not _same_logprobs(mine[4], plain[4]):
            return "logprobs"
    if not _same_logprobs(ours["prompt_logprobs"], theirs["prompt_logprobs"]):
        return "prompt logprobs"
    return None


def _engine(target: str, spec: dict | None):
    from vllm import LLM

    return LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
               kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=TOKEN_BUDGET,
               max_num_seqs=16, seed=0, speculative_config=spec)


def _greedy_batch_params():
    """Plain greedy requests: the free outputs' parameters."""
    return Probe("", {}).params()


def _try(llm, probes: dict[str, Probe]) -> dict[str, dict | str]:
    """Each probe alone: its record, or the message of the error it was refused with."""
    results: dict[str, dict | str] = {}
    for name, probe in probes.items():
        try:
            results[name] = _record(llm.generate([probe.prompt], probe.params(), use_tqdm=False)[0])
        except Exception as error:  # noqa: BLE001 - a refusal is an outcome here
            results[name] = f"{type(error).__name__}: {error}"
    return results


def _batch(llm, probes: dict[str, Probe]) -> dict[str, dict]:
    outputs = llm.generate([p.prompt for p in probes.values()], [p.params() for p in probes.values()], use_tqdm=False)
    return {name: _record(output) for name, output in zip(probes, outputs)}


def _beam_search(llm) -> list:
    """vLLM's offline beam search (greedy requests of max_tokens 1 with 2 x beam_width logprobs, one
    per beam per token) on two prompts: every beam's tokens and cumulative logprob."""
    from vllm.sampling_params import BeamSearchParams

    outputs = llm.beam_search([{"prompt": text} for text in _texts()[:2]], BeamSearchParams(beam_width=3, max_tokens=12))
    return [[(list(s.tokens), s.cum_logprob) for s in output.sequences] for output in outputs]


@pytest.fixture(scope="module")
def plain(pair_dirs) -> dict:
    """Plain decoding's references, computed before the module's ddtree engine starts: the free greedy
    outputs of `_texts()`, the probes built from them, each non-seeded probe alone (its record or its
    refusal) and the served ones in one batch."""
    target, _ = pair_dirs["trained"]
    llm = _engine(target, None)
    try:
        params = _greedy_batch_params()
        free = [list(o.outputs[0].token_ids) for o in llm.generate(_texts(), params, use_tqdm=False)]
        probes = _probes(free, llm.get_tokenizer())
        alone = _try(llm, {name: probe for name, probe in probes.items() if not probe.seeded})
        served = {name: probes[name] for name, result in alone.items() if isinstance(result, dict)}
        return {"free": free, "probes": probes, "alone": alone, "batch": _batch(llm, served), "beams": _beam_search(llm)}
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(pair_dirs, plain):
    target, draft = pair_dirs["trained"]
    llm = _engine(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _scripted(llm, script: list[TreeShape]) -> ScriptedBudget:
    policy = ScriptedBudget(candidate_shapes(BUDGET, DEPTH), script)
    model_runner(llm).use_budget_policy(policy)
    return policy


def _served(plain: dict) -> dict[str, Probe]:
    """The probes plain decoding served, and the seeded ones."""
    return {name: probe for name, probe in plain["probes"].items() if probe.seeded or isinstance(plain["alone"].get(name), dict)}


def _assert_engine_serves_on(llm, plain: dict) -> None:
    outputs = llm.generate(_texts(), _greedy_batch_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain["free"]
    assert model_runner(llm).num_chain_fallbacks == 0


@pytest.fixture(scope="module")
def alone(engine, plain) -> dict[str, dict | str]:
    """Every probe alone on the ddtree engine, a tree of BUDGET nodes every step."""
    _scripted(engine, TREE)
    return _try(engine, plain["probes"])


def test_vllm_refusals_are_plain_decodings_and_the_rest_is_served(alone, plain, engine):
    refused = {name: message for name, message in plain["alone"].items() if isinstance(message, str)}
    assert sorted(refused) == sorted(list(plain["probes"])[:NUM_VLLM_REFUSALS])  # those meant as such, no other
    assert all("VLLMValidationError" in message or "ValueError" in message for message in refused.values()), refused
    assert {name: alone[name] for name in refused} == refused
    errors = {name: result for name, result in alone.items() if name not in refused and isinstance(result, str)}
    assert not errors
    _assert_engine_serves_on(engine, plain)


def test_each_probe_alone_equals_plain_decoding(alone, plain):
    served = [name for name, probe in _served(plain).items() if not probe.seeded]
    differences = {name: _differs(alone[name], plain["alone"][name]) for name in served}
    assert not {name: d for name, d in differences.items() if d}, differences
    lengths = {name: [len(s[0]) for s in alone[name]["samples"]] for name in served}
    assert lengths["max_tokens 1"] == [1] and lengths["prompt of max_model_len - 1 tokens"] == [1]
    assert lengths["max_tokens 1e9 (cut at max_model_len)"] == [30]
    assert alone["every token masked, sampled"]["samples"][0][0] == [0] * 6  # the first maximal logit: token 0


def test_seeded_probes_are_complete(alone, plain):
    seeded = [name for name, probe in plain["probes"].items() if probe.seeded]
    for name in seeded:
        samples = alone[name]["samples"]
        assert len(samples) == plain["probes"][name].options.get("n", 1), name
        assert all(0 < len(s[0]) <= MAX_TOKENS and all(0 <= t < 4097 for t in s[0]) for s in samples), name
    assert len({tuple(s[0]) for s in alone["n 3, seeded, penalties"]["samples"]}) > 1


def test_beam_search_equals_plain_decoding(engine, plain):
    _scripted(engine, MIXED)
    ours = _beam_search(engine)
    for mine, theirs in zip(ours, plain["beams"]):
        assert [tokens for tokens, _ in mine] == [tokens for tokens, _ in theirs]
        assert all(abs(a - b) < TOL for (_, a), (_, b) in zip(mine, theirs))


def test_mixed_batch_with_forced_step_shapes(engine, plain, alone):
    """Every served probe in one batch, step shapes cycling through off, tree, chain and small trees:
    plain decoding's batch for the others, the alone outputs for the seeded ones."""
    policy = _scripted(engine, MIXED)
    probes = _served(plain)
    ours = _batch(engine, probes)
    assert set(policy.chosen) == set(MIXED)
    reference = {name: alone[name] if probe.seeded else plain["batch"][name] for name, probe in probes.items()}
    differences = {name: _differs(ours[name], reference[name]) for name in probes}
    assert not {name: d for name, d in differences.items() if d}, differences
    _assert_engine_serves_on(engine, plain)


def test_refusals_while_requests_are_in_flight(engine, plain):
    """vLLM's refusals and method 'ddtree''s own, offered while greedy requests run: each raises for
    that request only (a VLLMValidationError: HTTP 400 when serving), the running ones finish as plain
    decoding, and a request admitted after them too."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    _scripted(engine, MIXED)
    llm_engine = engine.llm_engine
    texts = _texts()
    for i in range(3):
        llm_engine.add_request(f"running-{i}", texts[i], _greedy_batch_params())
    for _ in range(3):
        llm_engine.step()
    assert llm_engine.has_unfinished_requests()
    refusals = {name: probe for name, probe in plain["probes"].items() if isinstance(plain["alone"].get(name), str)}
    raised = {}
    for name, probe in refusals.items():
        with pytest.raises(Exception) as error:
            llm_engine.add_request(f"refused-{name}", probe.prompt, probe.params())
        raised[name] = f"{error.type.__name__}: {error.value}"
    assert raised == {name: plain["alone"][name] for name in refusals}
    for name, (options, option) in DDTREE_REFUSALS.items():
        with pytest.raises(VLLMValidationError, match=option) as error:
            llm_engine.add_request(f"refused-{name}", texts[3], SamplingParams(max_tokens=MAX_TOKENS, **options))
        assert isinstance(error.value, ValueError), name
    llm_engine.add_request("late", texts[3], _greedy_batch_params())
    finished = {}
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    assert finished == {**{f"running-{i}": plain["free"][i] for i in range(3)}, "late": plain["free"][3]}
    _assert_engine_serves_on(engine, plain)


def test_aborts_mid_prefill_and_mid_decode(engine, plain, alone):
    """Requests with every kind of per-request state (a grammar, penalties and bad words, a seed, n > 1,
    a prompt still being prefilled in chunks) aborted after a few steps: what they streamed is a prefix
    of their full output, the others finish as plain decoding, nothing is left running or holding KV."""
    from vllm.sampling_params import RequestOutputKind

    _scripted(engine, MIXED)
    llm_engine = engine.llm_engine
    names = ["stop string with a grammar", "bad_words matching the output", "penalties at their maxima",
             "n 3, seeded, penalties", "seeded json object", "prompt of max_model_len - 1 tokens"]
    probes = {name: plain["probes"][name] for name in names}
    texts = _texts()
    for name, probe in probes.items():
        params = probe.params()
        params.output_kind = RequestOutputKind.CUMULATIVE
        llm_engine.add_request(name, probe.prompt, params)
    llm_engine.add_request("kept", texts[7], _greedy_batch_params())
    streamed: dict[str, dict[int, list[int]]] = {}
    for _ in range(4):
        for output in llm_engine.step():
            streamed.setdefault(output.request_id, {}).update({c.index: list(c.token_ids) for c in output.outputs})
    assert "prompt of max_model_len - 1 tokens" not in streamed  # still prefilling
    llm_engine.abort_request(names)
    finished = {}
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    assert finished["kept"] == plain["free"][7]
    for name, samples in streamed.items():
        for index, got in samples.items():
            assert got == alone[name]["samples"][index][0][: len(got)], name
    scheduler = llm_engine.engine_core.engine_core.scheduler
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv_cache_manager.usage == 0
    _assert_engine_serves_on(engine, plain)


@pytest.mark.parametrize("vllm_pads", [False, True], ids=["our-scheduler", "vllm-padding"])
def test_a_one_token_prompt_joining_a_decoding_batch_is_served_without_fallback(engine, plain, alone, monkeypatch, vllm_pads):
    """vLLM's scheduler pads a request that joins a decoding batch with one token left to compute (here a
    one-token prompt) to 1 + num_speculative_tokens rows of placeholder drafts (-1), which no proposed
    tree holds. Our CPU scheduler schedules it as its one token (`UnpaddedScheduler`);
    with vLLM's padding forced back on (as on a GPU), the placeholders are verified as a chain and
    rejected. Either way both requests give what they give alone, and no chain fallback is counted."""
    from vllm_ddtree.vllm import tree_step

    padded = []
    placeholders = tree_step._placeholders

    def recorded(*args):
        found = placeholders(*args)
        padded.append(bool(found.any()))
        return found

    monkeypatch.setattr(tree_step, "_placeholders", recorded)
    llm_engine = engine.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    assert scheduler.dynamic_sd_lookup is not None, "the CPU engine does not run UnpaddedScheduler"
    if vllm_pads:
        monkeypatch.setattr(scheduler, "dynamic_sd_lookup", None)  # vLLM's padding condition holds again
    first_rows = []
    schedule = scheduler.schedule

    def scheduled(*args, **kwargs):
        output = schedule(*args, **kwargs)
        rows = [count for req_id, count in output.num_scheduled_tokens.items() if req_id.startswith("one token")]
        if rows and not first_rows:  # (vLLM suffixes request ids)
            first_rows.append(rows[0])
        return output

    monkeypatch.setattr(scheduler, "schedule", scheduled)
    _scripted(engine, [TreeShape(8)])  # room left in the token budget for the padded request beside the tree
    one_token = {"prompt_token_ids": [plain["free"][0][0]]}
    expected = list(engine.generate([one_token], _greedy_batch_params(), use_tqdm=False)[0].outputs[0].token_ids)
    fallbacks = model_runner(engine).num_chain_fallbacks
    llm_engine.add_request("decoding", _texts()[0], _greedy_batch_params())
    while not any(request.num_output_tokens for request in scheduler.requests.values()):  # prefilled, decoding
        llm_engine.step()
    llm_engine.add_request("one token", one_token, _greedy_batch_params())
    finished = {}
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    assert first_rows == [1 + scheduler.num_spec_tokens if vllm_pads else 1]
    assert any(padded) == vllm_pads
    assert finished == {"decoding": plain["free"][0], "one token": expected}
    assert model_runner(engine).num_chain_fallbacks == fallbacks
    _assert_engine_serves_on(engine, plain)


@dataclass
class _RecordingPolicy:
    """The adaptive policy, its choices recorded."""

    policy: AdaptiveBudget
    chosen: list[TreeShape] = field(default_factory=list)

    @property
    def shapes(self) -> list[TreeShape]:
        return self.policy.shapes

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> TreeShape:
        shape = self.policy.choose(num_requests, context_tokens)
        self.chosen.append(shape)
        return shape

    def observe(self, *args: Any) -> None:
        self.policy.observe(*args)

    def requests_arrived(self, num_requests: int) -> None:
        self.policy.requests_arrived(num_requests)


def test_timing_perturbed_adaptive_policy_changes_no_output(engine, plain, alone):
    """The default adaptive policy, fresh, with a seeded random delay (0-30 ms) added to every step
    inside the time it measures: its shape choices follow the noise, the outputs may not (greedy:
    plain decoding's; seeded: the alone outputs)."""
    runner = model_runner(engine)
    recording = _RecordingPolicy(AdaptiveBudget(candidate_shapes(BUDGET, DEPTH)))
    runner.use_budget_policy(recording)
    delays = random.Random(0)
    execute_model = runner.execute_model

    def delayed_execute_model(*args: Any, **kwargs: Any) -> Any:
        output = execute_model(*args, **kwargs)
        time.sleep(delays.uniform(0.0, 0.03))
        return output

    runner.execute_model = delayed_execute_model
    try:
        probes = _served(plain)
        ours = _batch(engine, probes)
    finally:
        del runner.execute_model
    reference = {name: alone[name] if probe.seeded else plain["batch"][name] for name, probe in probes.items()}
    differences = {name: _differs(ours[name], reference[name]) for name in probes}
    assert not {name: d for name, d in differences.items() if d}, differences
    print("shapes the perturbed policy chose:", Counter(f"{s.budget}/{s.topk}" for s in recording.chosen))
    assert len(set(recording.chosen)) >= 2
    _assert_engine_serves_on(engine, plain)


class _OddClock:
    """The `time` module, its perf_counter stopped (the same reading every call), then running backwards,
    then jumping between odd readings: what a frozen or mocked clock gives the step clock."""

    def __init__(self) -> None:
        self.calls, self.rng = 0, random.Random(1)

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls < 300:
            return 1000.0
        if self.calls < 500:
            return 1000.0 - 0.01 * self.calls
        return self.rng.choice([0.0, -5.0, 1e12, time.perf_counter()])

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_a_stopped_or_jumping_clock_changes_no_output(engine, plain, alone, monkeypatch):
    """The adaptive policy, first timing the steps with the real clock, then with a stopped, backwards
    and jumping one (zero, negative and huge step times), takes no engine down (a stopped clock gives
    a held shape's steps zero seconds, a machine speed of 0 to divide by) and changes no output."""
    from vllm_ddtree.vllm.v1 import runner as runner_module

    model_runner(engine).use_budget_policy(AdaptiveBudget(candidate_shapes(BUDGET, DEPTH), explore=0.2))
    _assert_engine_serves_on(engine, plain)  # the real clock: the policy times its shapes
    monkeypatch.setattr(runner_module, "time", _OddClock())
    for _ in range(3):
        _assert_engine_serves_on(engine, plain)
    probes = _served(plain)
    ours = _batch(engine, probes)
    monkeypatch.undo()
    reference = {name: alone[name] if probe.seeded else plain["batch"][name] for name, probe in probes.items()}
    differences = {name: _differs(ours[name], reference[name]) for name in probes}
    assert not {name: d for name, d in differences.items() if d}, differences
    _assert_engine_serves_on(engine, plain)


def test_no_probe_left_a_non_finite_or_out_of_vocabulary_token(alone):
    for name, result in alone.items():
        if isinstance(result, dict):
            for tokens, *_ in result["samples"]:
                assert all(isinstance(t, int) and 0 <= t < 4097 for t in tokens), name
            for positions in [s[4] for s in result["samples"] if s[4]]:
                assert all(not math.isnan(v) for lp in positions if lp for v, _ in lp.values()), name
