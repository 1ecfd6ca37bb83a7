"""Options that change the target's logits, under method 'ddtree': every tree node sees its own history
(committed output + its path), so greedy outputs equal plain decoding's. logit_bias (like min_p) is
refused by vLLM under other speculative methods; method 'ddtree' serves it with vLLM's own processor.

Focused pair (deep trees, several FOCUS tokens competing, so penalties change the greedy choice),
fixed budget 16; each option alone and combined, EOS honoured where min_tokens is tested. bad_words
needs a tokenizer: the embedded trained pair with held-out code as text. The sampled law under
penalties is checked by the chi-square test in test_temperature.py.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import heldout_code_prompts, prompts, run_engine
from tests.e2e.pairs import EOS_TOKEN_ID, FOCUS

OPTIONS = {
    "none": {},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 0.7},
    "repetition_penalty": {"repetition_penalty": 1.4},
    "min_tokens": {"min_tokens": 20, "ignore_eos": False},
    "allowed_token_ids": {"allowed_token_ids": [FOCUS[0], FOCUS[2], FOCUS[3], 5, 100]},
    "logit_bias": {"logit_bias": {FOCUS[1]: 1.5, FOCUS[3]: 2.5, 7: 4.0}},
    "all together": {"presence_penalty": 0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "min_tokens": 10,
                     "ignore_eos": False, "allowed_token_ids": [FOCUS[0], FOCUS[1], FOCUS[2], 7]},
}


def _params(options):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=28, **{"ignore_eos": True, **options})


@pytest.fixture(scope="module")
def runs(pair_dirs):
    target, draft = pair_dirs["focused"]
    requests = prompts()
    params = [_params(options) for options in OPTIONS.values() for _ in requests]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    return {name: run_engine(target, config, requests * len(OPTIONS), params) for name, config in (("plain", None), ("ddtree", spec))}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_greedy_with_history_dependent_options_equals_plain_decoding(runs, option):
    count = len(prompts())
    start = list(OPTIONS).index(option) * count
    ours, plain = (run.token_ids[start : start + count] for run in (runs["ddtree"], runs["plain"]))
    assert ours == plain
    if option == "min_tokens":
        assert all(len(tokens) >= 20 and EOS_TOKEN_ID not in tokens[:19] for tokens in ours)
    if option == "allowed_token_ids":
        assert all(set(tokens) <= set(OPTIONS[option]["allowed_token_ids"]) for tokens in ours)


def test_the_options_change_the_output_and_trees_still_accept(runs):
    count = len(prompts())
    outputs = {name: runs["plain"].token_ids[i * count : (i + 1) * count] for i, name in enumerate(OPTIONS)}
    print({name: sum(a != b for a, b in zip(o, outputs["none"])) for name, o in outputs.items()})
    assert all(outputs[name] != outputs["none"] for name in OPTIONS if name != "none")  # each option acts here
    assert runs["ddtree"].tokens_per_step > 1.3


def test_bad_words_equal_plain_decoding(pair_dirs):
    """Bad words taken from the unconstrained output (two frequent tokens and a two-token word, whose
    ban depends on the token before it: a node's own path), so they do act."""
    from collections import Counter

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    target, draft = pair_dirs["trained"]
    requests = heldout_code_prompts()
    free = run_engine(target, None, requests, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    tokenizer = AutoTokenizer.from_pretrained(target)
    frequent = [token for token, _ in Counter(t for out in free.token_ids for t in out).most_common(2)]
    pair = free.token_ids[0][4:6]
    words = [tokenizer.decode([token]) for token in frequent] + [tokenizer.decode(pair)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, bad_words=words)
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    plain = run_engine(target, None, requests, params, skip_tokenizer_init=False)  # bad words need the tokenizer
    ours = run_engine(target, spec, requests, params, skip_tokenizer_init=False)
    assert ours.token_ids == plain.token_ids
    assert plain.token_ids != free.token_ids
