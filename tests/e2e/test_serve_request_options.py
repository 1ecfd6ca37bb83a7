"""Request options through vLLM's OpenAI server under method 'ddtree': structured outputs, logprobs and
penalties, each against offline plain decoding of the same requests.

The server is the embedded trained pair (it has the tokenizer structured outputs need) started as
users type it (`vllm serve TARGET --speculative-config '{"method": "ddtree", ...}'`, the virtual
environment's console script, multiprocess engine), with `--logprobs-mode processed_logprobs`, so the
logprobs it reports come after the penalties (the distribution each tree node is processed into).
The references come from an in-process plain engine with the same settings, computed before the
server starts. Checked: greedy completions under a regex, a choice, a JSON schema (`response_format`)
and an EBNF grammar equal plain decoding's and are valid (streamed too); a penalised greedy completion with top-5
logprobs has plain decoding's tokens, and its logprobs are plain decoding's within float tolerance.
"""

from __future__ import annotations


import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.e2e.served import vllm_serve
from tests.e2e.test_structured_outputs import CHOICES, EBNF, REGEX, SCHEMA, grammar_checker

MAX_TOKENS = 64
NUM_PROMPTS = 3
PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3}
LOGPROBS = 5
LOGPROBS_MODE = "processed_logprobs"


def _requests() -> dict[str, dict]:
    """name -> the completion request's options (OpenAI fields and vLLM's extra fields)."""
    return {
        "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
        "choice": {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
        "json schema": {"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}}},
        "grammar": {"extra_body": {"structured_outputs": {"grammar": EBNF}}},
        "penalties + logprobs": {"logprobs": LOGPROBS, "presence_penalty": PENALTIES["presence_penalty"],
                                 "frequency_penalty": PENALTIES["frequency_penalty"],
                                 "extra_body": {"repetition_penalty": PENALTIES["repetition_penalty"], "ignore_eos": True}},
    }


def _sampling_params(name: str):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = {
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "json schema": StructuredOutputsParams(json=SCHEMA),
        "grammar": StructuredOutputsParams(grammar=EBNF),
    }
    if name in structured:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=structured[name])
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, ignore_eos=True, **PENALTIES)


def _texts() -> list[str]:
    from vllm_ddtree.demo import heldout_prompts

    return heldout_prompts(NUM_PROMPTS, 48, as_text=True)


@pytest.fixture(scope="module")
def references(pair_dirs) -> dict[str, list]:
    """Offline plain decoding: name -> per prompt (text, token ids, [{token: logprob}] or None)."""
    from vllm import LLM

    target, _ = pair_dirs["trained"]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
              max_num_seqs=16, seed=0, logprobs_mode=LOGPROBS_MODE)
    try:
        out = {}
        for name in _requests():
            outs = llm.generate(_texts(), _sampling_params(name), use_tqdm=False)
            out[name] = [
                (o.outputs[0].text, list(o.outputs[0].token_ids),
                 None if o.outputs[0].logprobs is None else [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outs
            ]
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def server_url(references, pair_dirs, tmp_path_factory):
    target, draft = pair_dirs["trained"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--logprobs-mode", LOGPROBS_MODE]
    with vllm_serve(target, spec, args, tmp_path_factory.mktemp("serve")) as served:
        yield served.url
    assert "rejected" not in served.log_path.read_text(), "a grammar rejected a token (see the server log)"


def _complete(url: str, name: str) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    options = _requests()[name]
    extra = {**options.get("extra_body", {}), "return_token_ids": True, "return_tokens_as_token_ids": True}
    results = []
    for text in _texts():
        response = client.completions.create(model=client.models.list().data[0].id, prompt=text, max_tokens=MAX_TOKENS, temperature=0.0,
                                             **{k: v for k, v in options.items() if k != "extra_body"}, extra_body=extra)
        choice = response.choices[0]
        logprobs = None
        if choice.logprobs is not None:  # keys "token_id:<id>"
            logprobs = [{int(key.split(":")[1]): value for key, value in top.items()} for top in choice.logprobs.top_logprobs]
        results.append((choice.text, list(choice.token_ids), logprobs, choice.finish_reason))
    return results


@pytest.mark.parametrize("name", ["regex", "choice", "json schema", "grammar"])
def test_structured_completions_equal_plain_decoding(server_url, references, pair_dirs, name):
    ours = _complete(server_url, name)
    assert [(text, ids) for text, ids, _, _ in ours] == [(text, ids) for text, ids, _ in references[name]]
    valid = grammar_checker(pair_dirs["trained"][0], disable_any_whitespace=False)  # the server's default
    assert all(valid(name, (text, ids, reason)) for text, ids, _, reason in ours), ours


def test_penalised_completion_logprobs_equal_plain_decoding(server_url, references):
    """Tokens equal; at each position the top-5 logprobs (and the chosen token's), by token id, equal
    plain decoding's within float tolerance."""
    ours = _complete(server_url, "penalties + logprobs")
    plain = references["penalties + logprobs"]
    assert [ids for _, ids, _, _ in ours] == [ids for _, ids, _ in plain]
    for (_, _, mine, _), (_, _, theirs) in zip(ours, plain):
        assert len(mine) == len(theirs) == MAX_TOKENS
        for position, expected in zip(mine, theirs):
            assert position.keys() == expected.keys()
            assert all(position[t] == pytest.approx(expected[t], abs=1e-4) for t in position), (position, expected)


def test_streamed_structured_completion_equals_plain_decoding(server_url, references):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    extra = {"structured_outputs": {"regex": REGEX}, "return_token_ids": True}
    for text, (_, want, _) in zip(_texts(), references["regex"]):
        streamed: list[int] = []
        for chunk in client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0.0, stream=True, extra_body=extra):
            streamed += chunk.choices[0].token_ids or []
        assert streamed == want
