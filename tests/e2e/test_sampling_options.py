"""Sampling options alone and combined, on every kind of step, with the tree shapes forced.

Every token method 'ddtree' emits comes from the core's sampling rule, on every kind of step: a
request's first token (prefill; partial prefills are drawn and discarded), steps without drafts (the
budget policy chose "off"), chain steps and tree steps, mixed in one batch. A `ScriptedBudget` forces
the shape of every step (the tests never hope for timing), and each script is run on the same engine:
- options vLLM's CPU sampler treats specially on some step kinds (top_k without top_p takes its own
  path on a step without drafts) complete on every step kind, and the engine serves on;
- top_k = 1 at T > 0 emits exactly the greedy output, which equals plain decoding's;
- greedy requests equal plain decoding under every script (the chain included, walked as a tree);
- a seeded request's tokens are the same under every script, batched or alone: draws are keyed by
  (seed, position), whatever the step's shape.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import CHUNK, KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, model_runner, prompts
from tests.e2e.scripted_budget import ScriptedBudget
from vllm_ddtree.core import OFF, TreeShape, candidate_shapes

BUDGET = 16
DEPTH = 7  # the focused pair's block size - 1
CHAIN, TREE4, TREE16 = TreeShape(DEPTH, 1), TreeShape(4), TreeShape(BUDGET)
SCRIPTS = {
    "trees": [TREE16],
    "off": [OFF],
    "chain": [CHAIN],
    "mixed": [OFF, TREE16, CHAIN, TREE4],
    "mixed2": [TREE4, OFF, OFF, TREE16, CHAIN, CHAIN],
}
OPTIONS = {  # SamplingParams keywords besides max_tokens / ignore_eos
    "greedy": {"temperature": 0.0},
    "top_k=1": {"temperature": 1.0, "top_k": 1},
    "top_k=2": {"temperature": 1.0, "top_k": 2},
    "chat top_k=40": {"temperature": 0.7, "top_k": 40},
    "top_p": {"temperature": 1.0, "top_p": 0.5},
    "top_k+top_p": {"temperature": 0.9, "top_k": 3, "top_p": 0.8},
    "T=1.3": {"temperature": 1.3},
    "top_k=vocab-1": {"temperature": 1.0, "top_k": 510},
}


@pytest.fixture(scope="module")
def plain(engine_runs) -> list[list[int]]:
    """Plain greedy decoding of the standard prompts (its engine runs, and shuts vLLM's process
    groups down, before this module's engine starts)."""
    return engine_runs("focused", None).token_ids


@pytest.fixture(scope="module")
def engine(pair_dirs, plain):
    from vllm import LLM

    target, draft = pair_dirs["focused"]
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=CHUNK,
              max_num_seqs=16, seed=0,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _generate(llm, script: list[TreeShape], requests, params) -> list[list[int]]:
    policy = ScriptedBudget(candidate_shapes(BUDGET, DEPTH), script)
    model_runner(llm).use_budget_policy(policy)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert set(policy.chosen) == set(script)
    assert model_runner(llm).num_chain_fallbacks == 0
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def option_runs(engine):
    """Per script: one batch of every option on the standard prompts (long ones prefilled in chunks)."""
    from vllm import SamplingParams

    requests = prompts()
    names = [name for name in OPTIONS for _ in requests]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **OPTIONS[name]) for name in names]
    runs = {}
    for script_name, script in SCRIPTS.items():
        tokens = _generate(engine, script, requests * len(OPTIONS), params)
        runs[script_name] = {name: [t for t, n in zip(tokens, names) if n == name] for name in OPTIONS}
    return runs


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_every_option_completes_on_every_kind_of_step(option_runs, script):
    for name, outputs in option_runs[script].items():
        assert [len(t) for t in outputs] == [MAX_TOKENS] * len(prompts()), name


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_greedy_and_top_k_1_equal_plain_decoding(option_runs, plain, script):
    assert option_runs[script]["greedy"] == plain
    assert option_runs[script]["top_k=1"] == plain


def test_engine_serves_on_after_every_option(option_runs, engine, plain):
    from vllm import SamplingParams

    tokens = _generate(engine, [TREE16], prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert tokens == plain


SEEDED = [  # (prompt lengths seed, SamplingParams keywords)
    {"temperature": 1.0, "seed": 100},
    {"temperature": 0.7, "top_p": 0.95, "seed": 101},
    {"temperature": 1.3, "seed": 102},
    {"temperature": 1.0, "top_k": 2, "seed": 103},
    {"temperature": 0.8, "top_k": 3, "top_p": 0.9, "seed": 104},
    {"temperature": 1.0, "top_p": 0.9, "seed": 105},
]


def test_seeded_tokens_do_not_depend_on_the_step_shapes(engine):
    """Same seed, same tokens under every script, batched (with unseeded requests and chunked prompts
    around them) or one by one."""
    from vllm import SamplingParams

    seeded = prompts(lengths=(6, 30, 12, 50, 90, 3), seed=21)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **kw) for kw in SEEDED]
    others = prompts(lengths=(100, 9), seed=4)
    other_params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True), SamplingParams(temperature=0.0, max_tokens=20)]
    reference = _generate(engine, SCRIPTS["trees"], seeded, params)
    for name, script in SCRIPTS.items():
        batched = _generate(engine, script, others[:1] + seeded + others[1:], other_params[:1] + params + other_params[1:])[1:-1]
        assert batched == reference, name
    for name in ("off", "mixed2"):
        alone = [_generate(engine, SCRIPTS[name], [r], [p])[0] for r, p in zip(seeded[:3], params[:3])]
        assert alone == reference[:3], name
    different_seed = _generate(engine, SCRIPTS["mixed"], seeded[:1], [SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)])
    assert different_seed[0] != reference[0]
