"""Method 'ddtree' with temperature: lossless in distribution, seeded requests reproducible, and mixed
batches (greedy + sampled, different max_tokens and stop tokens) served together.

Distribution test. Pair: the focused pair cut to a 32-token vocabulary with its LM head scaled by 0.3
(`small_vocab.shrink_vocab`): at T = 1 the target spreads its mass over the four FOCUS tokens (about
0.58 / 0.19 / 0.16 / 0.05, the other 28 tokens ~0.02 together) and the draft's top-4 holds them, so
the tree accepts deep paths (budget 16, even with max_tokens 3). N = 2,000 requests
of one prompt per setting (T = 1; T = 0.8 with top_p 0.9 and top_k 6), max_tokens 3, under ddtree and
under plain decoding, all in one `generate` call per engine. The first token is drawn at the prefill step
(a tree of the root alone), tokens 2 and 3 by the tree walk. For the laws of the first token and of the first three
tokens a two-sample chi-square test (cells with fewer than 10 samples in both runs together pooled)
must give p > 1e-3. Power: moving a mass d between two cells of probability 0.1 shifts the statistic's
non-centrality by 1000 d^2 * 20, so at alpha = 1e-3 the test detects d = TV = 0.05 with power >= 0.9
with up to 30 degrees of freedom (0.71 with 60) and d = 0.04 with power 0.94 for the first token. top_k
alone (no top_p) has a setting of its own: vLLM's sampler takes a separate path for it. Penalties have one too: tokens 2
and 3 are drawn at tree nodes whose histories (output + the node's path) set the penalties; and min_p
with logit_bias (both refused by vLLM under its own speculative methods). Seeds under forced tree shapes:
tests/e2e/test_sampling_options.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.e2e.conftest import prompts, run_engine
from tests.e2e.pairs import FOCUS
from tests.e2e.small_vocab import shrink_vocab

N = 2000
ALPHA = 1e-3
SMALL_PROMPT = {"prompt_token_ids": [5, 9, 2, 17, 3]}
SETTINGS = {
    "T=1": {"temperature": 1.0},
    "T=0.8,top_p=0.9,top_k=6": {"temperature": 0.8, "top_p": 0.9, "top_k": 6},
    "T=1,top_k=3": {"temperature": 1.0, "top_k": 3},
    "T=1,penalties": {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    "T=1,min_p=0.1,logit_bias": {"temperature": 1.0, "min_p": 0.1, "logit_bias": {3: 1.0, 5: 2.0}},  # small-vocab ids
}


@pytest.fixture(scope="module")
def small_pair(pair_dirs, tmp_path_factory) -> tuple[str, str]:
    return shrink_vocab(pair_dirs["focused"], str(tmp_path_factory.mktemp("small_vocab")), head_scale=0.3)


@pytest.fixture(scope="module")
def distribution_runs(small_pair):
    from vllm import SamplingParams

    target, draft = small_pair
    params = [SamplingParams(max_tokens=3, ignore_eos=True, **s) for s in SETTINGS.values() for _ in range(N)]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    return {
        name: run_engine(target, config, [SMALL_PROMPT] * len(params), params, max_num_seqs=256, max_num_batched_tokens=2048)
        for name, config in (("plain", None), ("ddtree", spec))
    }


def two_sample_chi_square(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of the 2 x k contingency table of two samples' counts,
    cells with fewer than min_count samples in both samples together pooled into one."""
    from scipy.stats import chi2_contingency

    rows: list[list[int]] = []
    pooled = [0, 0]
    for cell in set(a) | set(b):
        counts = [a[cell], b[cell]]
        if sum(counts) < min_count:
            pooled = [pooled[0] + counts[0], pooled[1] + counts[1]]
        else:
            rows.append(counts)
    if sum(pooled) > 0:
        rows.append(pooled)
    result = chi2_contingency(rows)
    return float(result.statistic), int(result.dof), float(result.pvalue)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("prefix", [1, 3])
def test_sampled_law_equals_plain_sampling(distribution_runs, setting, prefix):
    offset = list(SETTINGS).index(setting) * N
    laws = {
        name: Counter(tuple(tokens[:prefix]) for tokens in run.token_ids[offset : offset + N])
        for name, run in distribution_runs.items()
    }
    statistic, dof, p = two_sample_chi_square(laws["plain"], laws["ddtree"])
    print(f"{setting} first {prefix}: chi2 {statistic:.1f}, dof {dof}, p {p:.3g}, N {N} per engine")
    assert p > ALPHA, (statistic, dof, laws)
    assert all(len(tokens) == 3 for run in distribution_runs.values() for tokens in run.token_ids)


def test_tree_accepts_with_temperature(distribution_runs):
    run = distribution_runs["ddtree"]
    print(f"tokens per verify step (T = 1 and T = 0.8 requests together): {run.tokens_per_step:.2f}")
    assert run.tokens_per_step > 1.5


MIXED_PROMPTS = prompts()


@pytest.fixture(scope="module")
def seeded_engine(pair_dirs):
    """A ddtree engine on the focused pair whose token budget never cuts a draft (decode needs at most
    16 x 17 tokens), so a seeded request's trees do not depend on the batch, while a 600-token prompt is
    still prefilled in chunks."""
    from vllm import LLM

    target, draft = pair_dirs["focused"]
    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=2 * 2**27, max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=16, seed=0,
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_seeded_requests_reproducible_across_batch_compositions(seeded_engine):
    """Same seed -> same tokens, alone or among other requests (greedy, unseeded, long prompts being
    prefilled in chunks), including a seeded request whose own 600-token prompt is chunked differently
    (stock vLLM's CPU runner crashes on seeds + chunked prefill: it rewinds the partial-prefill rows'
    generators; ours never draws from vLLM's generators and hides them from that rewind)."""
    from vllm import SamplingParams

    seeded = prompts(lengths=(6, 600, 30), seed=11)
    seeded_params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(3)]
    others = prompts(lengths=(500, 9, 90, 14), seed=4)
    other_params = [SamplingParams(temperature=t, max_tokens=20, ignore_eos=True) for t in (1.0, 0.0, 0.7, 1.3)]

    def generate(requests, params):
        return [list(o.outputs[0].token_ids) for o in seeded_engine.generate(requests, params, use_tqdm=False)]

    alone = [generate([r], [p])[0] for r, p in zip(seeded, seeded_params)]
    together = generate(others[:2] + seeded + others[2:], other_params[:2] + seeded_params + other_params[2:])[2:5]
    reversed_batch = generate(seeded[::-1] + others, seeded_params[::-1] + other_params)[:3][::-1]
    assert together == alone
    assert reversed_batch == alone
    different_seed = generate([seeded[0]], [SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True)])
    assert different_seed[0] != alone[0]


def test_mixed_batch_greedy_requests_equal_plain_decoding(pair_dirs):
    """Greedy and sampled requests (temperature, top_k, top_p, seeds; vLLM refuses min_p under speculative decoding), different max_tokens and
    stop token ids, in one batch: the greedy ones equal plain decoding, every request honours its
    max_tokens and stop tokens."""
    from vllm import SamplingParams

    target, draft = pair_dirs["focused"]
    stop = [FOCUS[2]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=stop, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=3, max_tokens=25, stop_token_ids=stop, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=stop, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=4, max_tokens=30, stop_token_ids=stop, ignore_eos=True),
    ]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    ddtree = run_engine(target, spec, MIXED_PROMPTS, params)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    plain = run_engine(target, None, [MIXED_PROMPTS[i] for i in greedy], [params[i] for i in greedy])
    assert [ddtree.token_ids[i] for i in greedy] == plain.token_ids
    assert [ddtree.finish_reasons[i] for i in greedy] == plain.finish_reasons
    for tokens, reason, p in zip(ddtree.token_ids, ddtree.finish_reasons, params):
        assert 0 < len(tokens) <= p.max_tokens
        stops = set(p.stop_token_ids or [])
        assert not stops & set(tokens[:-1])
        assert reason == ("stop" if tokens[-1] in stops else "length")
    assert ddtree.tokens_per_step > 1.5
