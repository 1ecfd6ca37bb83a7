"""Whole-vocabulary logprobs (streamed) and structured outputs under a reasoning parser through vLLM's
OpenAI server under method 'ddtree', against offline plain decoding of the same requests.

The server is the embedded trained pair started as users type it (`vllm serve TARGET
--speculative-config '{"method": "ddtree", ...}'`, multiprocess engine) with `--max-logprobs -1` (vLLM
serves logprobs=-1 only up to it) and the test reasoning parser (`newline_reasoning`: the reasoning
ends at the first output token holding a newline) in `--structured-outputs-config`, its plugin file
imported by `--reasoning-parser-plugin`. (Not `--reasoning-parser`: that also builds vLLM's thinking-
budget config, which the DFlash drafter's config copy rebuilds in the worker process, where vLLM has
not imported the plugin: vLLM 0.32's DFlash drafter fails there, with or without trees.) The references
come from an in-process plain engine with the same settings, computed before the server starts.
Checked: a streamed greedy completion with logprobs=-1 has plain decoding's tokens and, at every
position, every token id's logprob within float tolerance; greedy regex completions (the grammar
starting after the reasoning) equal plain decoding's.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.e2e.newline_reasoning import PLUGIN
from tests.e2e.served import vllm_serve
from tests.e2e.test_reasoning_structured import REGEX, STRUCTURED_OUTPUTS_CONFIG

NUM_PROMPTS = 3
VOCABULARY_TOKENS = 12
REGEX_TOKENS = 48
VOCAB = 4097  # the trained pair's


def _texts() -> list[str]:
    from vllm_ddtree.demo import heldout_prompts

    return heldout_prompts(NUM_PROMPTS, 40, as_text=True)


@pytest.fixture(scope="module")
def references(pair_dirs) -> dict[str, list]:
    """Offline plain decoding: "vocabulary": per prompt (token ids, [{token: logprob}]); "regex": token ids."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    target, _ = pair_dirs["trained"]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
              max_num_seqs=16, seed=0, max_logprobs=-1,
              structured_outputs_config=STRUCTURED_OUTPUTS_CONFIG)
    try:
        vocabulary = llm.generate(_texts(), SamplingParams(temperature=0.0, max_tokens=VOCABULARY_TOKENS, logprobs=-1, ignore_eos=True),
                                  use_tqdm=False)
        regex = llm.generate(_texts(), SamplingParams(temperature=0.0, max_tokens=REGEX_TOKENS, structured_outputs=StructuredOutputsParams(regex=REGEX)),
                             use_tqdm=False)
        return {
            "vocabulary": [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                           for o in vocabulary],
            "regex": [list(o.outputs[0].token_ids) for o in regex],
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def client(references, pair_dirs, tmp_path_factory):
    from openai import OpenAI

    target, draft = pair_dirs["trained"]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-logprobs", "-1",
            "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG), "--reasoning-parser-plugin", PLUGIN]
    with vllm_serve(target, spec, args, tmp_path_factory.mktemp("serve")) as served:
        client = OpenAI(base_url=f"{served.url}/v1", api_key="unused")
        yield client, client.models.list().data[0].id


def test_streamed_whole_vocabulary_logprobs_equal_plain_decoding(client, references):
    client, model = client
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    for text, (want, plain) in zip(_texts(), references["vocabulary"]):
        tokens: list[int] = []
        positions: list[dict[int, float]] = []
        for chunk in client.completions.create(model=model, prompt=text, max_tokens=VOCABULARY_TOKENS, temperature=0.0, logprobs=-1,
                                               stream=True, extra_body=extra):
            choice = chunk.choices[0]
            tokens += choice.token_ids or []
            if choice.logprobs is not None:  # keys "token_id:<id>"
                positions += [{int(key.split(":")[1]): value for key, value in top.items()} for top in choice.logprobs.top_logprobs]
        assert tokens == want
        assert len(positions) == len(plain) == VOCABULARY_TOKENS
        for position, expected in zip(positions, plain):
            assert position.keys() == expected.keys() and len(position) == VOCAB
            assert all(abs(position[t] - expected[t]) < 1e-4 for t in position)


def test_structured_completions_under_a_reasoning_parser_equal_plain_decoding(client, references):
    client, model = client
    extra = {"structured_outputs": {"regex": REGEX}, "return_token_ids": True}
    for text, want in zip(_texts(), references["regex"]):
        response = client.completions.create(model=model, prompt=text, max_tokens=REGEX_TOKENS, temperature=0.0, extra_body=extra)
        assert list(response.choices[0].token_ids) == want
