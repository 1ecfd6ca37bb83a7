"""Sampled structured outputs under method 'ddtree': the law of plain decoding under the same grammar.

Every tree node's logits are masked by the grammar state after its path and every token is one draw
from the node's masked, processed distribution, so at T = 1 the outputs of a grammar have plain
decoding's law. Setting: the embedded trained pair (structured outputs need its tokenizer), xgrammar
(vLLM's default backend), a choice grammar of four methods' bodies after a code prompt, T = 1,
N = 2,000 seeded requests (seeds 0..N-1: the run is deterministic) per engine in one `generate` call,
plain decoding and method 'ddtree' (budget 16, fixed trees). The choices take 2 to 16 tokens, spelled
in several tokenizations, so the draws reach deep tree nodes (about 2.3 tokens per verify step).

Checked: every output is one of the choices and ended the grammar; two-sample chi-square tests
(`test_temperature.two_sample_chi_square`, cells with fewer than 10 samples pooled) of the law of the
text and of the first three tokens give p > 1e-3, and the text laws' total variation is under 0.07.
Power (`test_the_chi_square_test_has_power`, computed from plain decoding's measured text law):
moving a mass d = 0.07 between any two choices gives the text test a non-centrality of at least
(N / 2) d^2 (1/p_a + 1/p_b), which it detects at alpha = 1e-3 with power >= 0.9 for the worst pair of
choices (the power test computes it from plain decoding's law of this run, so it holds for the law the
chi-square tests actually compare).
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.e2e.test_temperature import two_sample_chi_square

N = 2000
ALPHA = 1e-3
SHIFT = 0.07  # the mass moved between two choices the test must detect
MIN_POWER = 0.9
MAX_TV = 0.07
PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def is_empty(self):\n        "
CHOICES = ["return self.items == []", "return not self.items", "return len(self.items) == 0", "pass"]
# Scheduler token budget: every running request's whole tree and every new prompt in one step, so no
# seeded prompt is prefilled in part (stock vLLM's CPU runner crashes on those: tests/e2e README rule).
TOKEN_BUDGET = 16384
MAX_NUM_SEQS = 256


@pytest.fixture(scope="module")
def runs(pair_dirs):
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    target, draft = pair_dirs["trained"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=CHOICES))
              for i in range(N)]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    results = {}
    for name, config in (("plain", None), ("ddtree", spec)):
        llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=TOKEN_BUDGET,
                  max_num_seqs=MAX_NUM_SEQS, seed=0, speculative_config=config, disable_log_stats=False,
                  structured_outputs_config={"backend": "xgrammar"})
        try:
            outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
            metrics = {m.name: m.value for m in llm.get_metrics()
                       if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
            results[name] = {"outputs": [(o.outputs[0].text, tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs],
                             "metrics": metrics}
        finally:
            llm.llm_engine.engine_core.shutdown()
    return results


def _text_law(run) -> Counter:
    return Counter(text for text, _, _ in run["outputs"])


def test_every_sample_is_a_choice(runs):
    for run in runs.values():
        assert all(text in CHOICES and reason == "stop" for text, _, reason in run["outputs"]), _text_law(run)


@pytest.mark.parametrize("law", ["text", "first 3 tokens"])
def test_sampled_law_equals_plain_decoding_under_the_grammar(runs, law):
    def of(run) -> Counter:
        return _text_law(run) if law == "text" else Counter(tokens[:3] for _, tokens, _ in run["outputs"])

    plain, ours = of(runs["plain"]), of(runs["ddtree"])
    statistic, dof, p = two_sample_chi_square(plain, ours)
    tv = sum(abs(plain[c] - ours[c]) for c in set(plain) | set(ours)) / (2 * N)
    print(f"{law}: chi2 {statistic:.1f}, dof {dof}, p {p:.3g}, TV {tv:.3f}, N {N} per engine")
    assert p > ALPHA, (statistic, dof, plain, ours)
    if law == "text":
        assert tv < MAX_TV, (tv, plain, ours)


def test_the_chi_square_test_has_power(runs):
    """Power of the text test at alpha against moving SHIFT between the two choices where it is
    hardest to see, from plain decoding's measured law (non-centrality (N / 2) d^2 (1/p_a + 1/p_b))."""
    from scipy.stats import chi2, ncx2

    law = _text_law(runs["plain"])
    shares = [law[c] / N for c in CHOICES]
    assert min(shares) >= 10 / N  # no pooled cell: the test's degrees of freedom are len(CHOICES) - 1
    dof = len(CHOICES) - 1
    worst = min(N / 2 * SHIFT**2 * (1 / a + 1 / b) for a, b in combinations(shares, 2))
    power = float(ncx2.sf(chi2.ppf(1 - ALPHA, dof), dof, worst))
    print(f"text law {[round(s, 3) for s in shares]}: power {power:.3f} against a shift of {SHIFT}")
    assert power >= MIN_POWER


def test_trees_accept_under_the_grammar(runs):
    metrics = runs["ddtree"]["metrics"]
    tokens_per_step = 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_drafts"]
    print(f"tokens per verify step: {tokens_per_step:.2f}")
    assert tokens_per_step > 1.5
