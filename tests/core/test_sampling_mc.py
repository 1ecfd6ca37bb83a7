"""The real batched sampler draws from the processed target distribution; seeds reproduce.

Monte-Carlo check: 40,000 draws per configuration over an 8-token vocabulary, chi-square goodness of
fit against an independent per-row reference of vLLM's processing rules, rejected at p < 1e-4. At this
size the test detects a total-variation error of about 0.02 with power > 0.99 (checked by
test_chi_square_check_has_power_against_a_small_bias below).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from hypothesis import given
from hypothesis import strategies as st

from vllm_ddtree.core import TreeSamplingParams, sample_tree_tokens
from vllm_ddtree.core.sampling import _keyed_uniforms_torch, _uniforms, keyed_uniforms, splitmix_uniform

VOCAB = 8
DRAWS = 40_000
CONFIGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.8, 6, 0.9, 0.0),
    (1.5, 0, 0.75, 0.05),
    (0.6, 3, 1.0, 0.1),
]


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """vLLM 0.32's rules for one row, written plainly: temperature, min_p, top_k, top_p."""
    x = logits.astype(np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x[keep] if keep.any() else x)[::-1][min(top_k, keep.sum()) - 1]
    if top_p < 1.0:
        order = np.argsort(np.where(keep, x, -np.inf), kind="stable")  # ascending
        masked = np.where(keep, probs, 0.0)[order]
        cumulative = np.cumsum(masked / masked.sum())
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        keep[order[drop]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def draw_counts(logits: torch.Tensor, config, seed: int | None = None) -> np.ndarray:
    """DRAWS draws at distinct positions (seeded: one keyed noise vector per position)."""
    temperature, top_k, top_p, min_p = config
    params = TreeSamplingParams(
        temperature=torch.tensor([temperature]),
        top_k=torch.tensor([top_k]),
        top_p=torch.tensor([top_p]),
        min_p=torch.tensor([min_p]),
        seeds={0: seed} if seed is not None else {},
    )
    tokens = sample_tree_tokens(logits.expand(1, DRAWS, VOCAB), params, torch.arange(DRAWS).unsqueeze(0))
    return np.bincount(tokens.flatten().numpy(), minlength=VOCAB)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    assert counts[probs == 0].sum() == 0, "sampled a token the processed distribution excludes"
    support = probs > 0
    return chisquare(counts[support], probs[support] * counts.sum()).pvalue


def test_sampler_matches_processed_distribution():
    gen = torch.Generator().manual_seed(1234)
    for config in CONFIGS:
        logits = torch.randn(VOCAB, generator=gen) * 1.5
        for seed in (None, 7):
            counts = draw_counts(logits, config, seed)
            assert chi_square_pvalue(counts, reference_probs(logits.numpy(), *config)) > 1e-4, (config, seed)


def test_chi_square_check_has_power_against_a_small_bias():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))
    probs = reference_probs(logits.numpy(), 1.0, 0, 1.0, 0.0)
    biased = probs.copy()
    biased[np.argmax(biased)] -= 0.02
    biased[np.argmin(biased)] += 0.02
    rng = np.random.default_rng(0)
    rejections = sum(chi_square_pvalue(rng.multinomial(DRAWS, biased), probs) < 1e-4 for _ in range(200))
    assert rejections >= 198


def test_greedy_rows_take_the_argmax_and_mix_with_sampled_rows():
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(0))
    params = TreeSamplingParams(temperature=torch.tensor([0.0, 1.0, 0.0]), top_k=torch.tensor([0, 2, 3]))
    tokens = sample_tree_tokens(logits, params)
    assert torch.equal(tokens[[0, 2]], logits[[0, 2]].argmax(-1))
    top2 = logits[1].topk(2, dim=-1).indices
    assert bool((tokens[1].unsqueeze(-1) == top2).any(-1).all())


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(4, 9, VOCAB, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(9).unsqueeze(0) + torch.tensor([[30], [40], [50], [60]])

    def run(rows, seeds):
        params = TreeSamplingParams(temperature=torch.ones(len(rows)), seeds={i: s for i, s in enumerate(seeds) if s is not None})
        return sample_tree_tokens(logits[rows], params, positions[rows])

    alone = run([2], [42])
    in_batch = run([0, 2, 3], [None, 42, 7])
    reordered = run([3, 1, 2], [11, None, 42])
    assert torch.equal(alone[0], in_batch[1]) and torch.equal(alone[0], reordered[2])


def test_seeded_draws_depend_on_position_only_not_on_tree_shape_or_size():
    """Nodes drawing the same position with the same logits get the same token, however many nodes the
    tree has, where they sit, and how the batch is padded."""
    gen = torch.Generator().manual_seed(3)
    row_logits = torch.randn(4, VOCAB, generator=gen)  # logits for positions 10..13
    depths = torch.tensor([0, 1, 1, 2, 3, 2, 1, 3])  # a bushy tree: several nodes per position
    big = sample_tree_tokens(
        row_logits[depths].unsqueeze(0), TreeSamplingParams(temperature=torch.ones(1), seeds={0: 5}), (10 + depths).unsqueeze(0)
    )
    chain = sample_tree_tokens(
        row_logits.unsqueeze(0), TreeSamplingParams(temperature=torch.ones(1), seeds={0: 5}), (10 + torch.arange(4)).unsqueeze(0)
    )
    assert torch.equal(big[0], chain[0][depths])
    other_seed = [
        sample_tree_tokens(row_logits.unsqueeze(0), TreeSamplingParams(temperature=torch.ones(1), seeds={0: s}), (10 + torch.arange(4)).unsqueeze(0))
        for s in range(6, 12)
    ]
    assert any(not torch.equal(o, chain) for o in other_seed)


def test_requests_in_a_batch_do_not_share_randomness():
    logits = torch.zeros(2, 200, VOCAB)  # identical uniform rows
    positions = torch.arange(200).expand(2, 200)
    unseeded = sample_tree_tokens(logits, TreeSamplingParams(temperature=torch.ones(2)))
    assert not torch.equal(unseeded[0], unseeded[1])
    seeded = sample_tree_tokens(logits, TreeSamplingParams(temperature=torch.ones(2), seeds={0: 1, 1: 2}), positions)
    assert not torch.equal(seeded[0], seeded[1])


def splitmix_uniform_oracle(seed: int, position: int) -> float:
    """splitmix64 in Python's unbounded ints, reduced mod 2^64 at every step."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


@given(st.integers(0, 2**63 - 1), st.integers(0, 2**40))
def test_keyed_uniforms_are_splitmix64_of_seed_and_position(seed, position):
    got = float(keyed_uniforms(torch.tensor(seed), torch.tensor(position)))
    assert got == splitmix_uniform_oracle(seed, position) == splitmix_uniform(seed, position) and 0.0 <= got < 1.0


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=4), st.integers(0, 2**40), st.integers(1, 5))
def test_keyed_uniforms_on_host_and_in_torch_are_the_same_bits(seeds, first_position, nodes):
    """Host tensors take numpy's uint64 path, device tensors torch's int64 path: same bits, any seed."""
    keys = torch.tensor(seeds).unsqueeze(1)
    positions = first_position + torch.arange(len(seeds) * nodes).view(len(seeds), nodes)
    assert torch.equal(keyed_uniforms(keys, positions), _keyed_uniforms_torch(keys, positions))


@given(
    st.dictionaries(st.integers(0, 5), st.integers(-(2**64), 2**64 + 5), min_size=1, max_size=6),
    st.integers(0, 2**40),
    st.sampled_from([1, 2, 7, 40]),
)
def test_few_and_many_keyed_draws_are_the_same_bits(seeds, first_position, nodes):
    """`_uniforms` draws few keyed uniforms one by one in Python, many through `keyed_uniforms`: the
    seeded rows hold the same bits either way (any int seed, taken mod 2^64)."""
    shape = torch.Size((6, nodes))
    positions = first_position + torch.arange(6 * nodes).view(shape)
    got = _uniforms(seeds, positions, shape, torch.device("cpu"))
    for row, seed in seeds.items():
        key = torch.tensor([[seed % 2**64 - (2**64 if seed % 2**64 >= 2**63 else 0)]])
        assert torch.equal(got[row], keyed_uniforms(key, positions[row : row + 1])[0])
        assert got[row].tolist() == [splitmix_uniform_oracle(seed, int(p)) for p in positions[row]]


def test_seeds_above_int64_range_are_taken_mod_two_to_the_64():
    logits = torch.randn(1, 6, VOCAB, generator=torch.Generator().manual_seed(9))
    positions = torch.arange(6).unsqueeze(0)
    big = sample_tree_tokens(logits, TreeSamplingParams(temperature=torch.ones(1), seeds={0: 2**64 - 5}), positions)
    wrapped = sample_tree_tokens(logits, TreeSamplingParams(temperature=torch.ones(1), seeds={0: -5}), positions)
    assert torch.equal(big, wrapped)


@given(
    st.integers(1, 5),
    st.sampled_from([1, 2, 63, 64, 65, 128, 130, 300]),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["normal", "few values", "with -inf", "with +inf", "with nan", "all -inf", "all nan", "signed zeros"]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_argmax_first_equals_torch_argmax(rows, vocab, seed, kind, dtype):
    """Ties (many equal values, +0 and -0), +-inf, NaN, vocab below / at / around multiples of the block:
    the two-level argmax (large bfloat16 host logits), numpy's (other dtypes) and the dispatch alike."""
    from vllm_ddtree.core.sampling import _argmax_two_level, argmax_first

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if kind == "few values":
        logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    elif kind == "with -inf":
        logits[torch.rand(rows, vocab, generator=gen) < 0.5] = float("-inf")
    elif kind == "with nan":
        logits[torch.rand(rows, vocab, generator=gen) < 0.01] = float("nan")
    elif kind == "with +inf":
        logits[torch.rand(rows, vocab, generator=gen) < 0.05] = float("inf")
    elif kind == "all -inf":
        logits.fill_(float("-inf"))
    elif kind == "all nan":
        logits.fill_(float("nan"))
    elif kind == "signed zeros":
        logits = torch.where(torch.rand(rows, vocab, generator=gen) < 0.5, 0.0, -0.0)
    logits = logits.to(dtype)
    assert torch.equal(_argmax_two_level(logits), logits.argmax(dim=-1))
    assert torch.equal(argmax_first(logits), logits.argmax(dim=-1))


def test_inplace_sampling_draws_the_same_tokens():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(2))
    params = TreeSamplingParams(temperature=torch.tensor([0.0, 0.7, 1.3]), top_k=torch.tensor([0, 5, 0]), seeds={0: 1, 1: 2, 2: 3})
    positions = torch.arange(15).view(3, 5)
    copied = sample_tree_tokens(logits, params, positions)
    assert torch.equal(sample_tree_tokens(logits.clone(), params, positions, inplace=True), copied)


def test_rows_without_mass_take_their_first_maximal_logit_never_a_token_past_the_vocabulary():
    """Every token masked (-inf row), +inf or NaN logits: no distribution to draw from. The rule takes
    the first maximal processed logit (NaN maximal; all -inf: token 0), as vLLM's Gumbel-max sampler
    does, whatever the filters; rows with mass in the same batch are drawn as usual."""
    vocab = 130  # not a multiple of the 64-token blocks
    logits = torch.full((2, 4, vocab), float("-inf"))
    logits[1, 0, 5] = 1.0
    logits[1, 1, [9, 11]] = float("inf")
    logits[1, 2, 40] = float("nan")
    logits[1, 3] = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).view(2, 4)
    for params in (
        TreeSamplingParams(temperature=torch.tensor([1.0, 0.7]), seeds={1: 3}),
        TreeSamplingParams(temperature=torch.tensor([1.3, 1.0]), top_k=torch.tensor([3, 500]),
                           top_p=torch.tensor([0.5, 0.9]), min_p=torch.tensor([0.5, 0.0])),
    ):
        tokens = sample_tree_tokens(logits.clone(), params, positions)
        assert tokens[0].tolist() == [0, 0, 0, 0]
        assert tokens[1, :3].tolist() == [5, 9, 40]
        assert 0 <= int(tokens[1, 3]) < vocab and bool(torch.isfinite(logits[1, 3, tokens[1, 3]]))


@given(
    st.integers(1, 4),
    st.sampled_from([1, 63, 64, 65, 130, 300]),
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 1.0, exclude_max=True),
)
def test_inverse_cdf_on_host_and_in_torch_follow_the_rule_exactly(rows, vocab, seed, u):
    """Both paths (numpy for host tensors, torch otherwise) return the token i with
    cdf(i-1) <= u * total < cdf(i), never a zero-mass token. Masses are small multiples of 2**-10 with
    zeros (exact float32 and float64 sums in any order, so the rule is checked exactly, at interval
    bounds and beyond the last token with mass too)."""
    from vllm_ddtree.core.sampling import _inverse_cdf_torch, inverse_cdf

    gen = torch.Generator().manual_seed(seed)
    probs = torch.randint(0, 4, (rows, vocab), generator=gen).float() * 2.0**-10
    probs[:, torch.randint(0, vocab, (1,), generator=gen)] += 2.0**-10  # every row has mass
    uniforms = torch.full((rows,), u, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    expected = torch.minimum((cdf <= target).sum(-1), (cdf < cdf[:, -1:]).sum(-1))
    assert torch.equal(inverse_cdf(probs, uniforms), expected)
    assert torch.equal(_inverse_cdf_torch(probs, uniforms), expected)
    assert bool((probs.gather(1, expected.unsqueeze(1)) > 0).all())
    for row in range(rows):  # one row at a time: the host's single-draw path
        assert torch.equal(inverse_cdf(probs[row : row + 1], uniforms[row : row + 1]), expected[row : row + 1])


@given(st.sampled_from([1, 63, 64, 65, 130, 4097]), st.integers(0, 2**31 - 1), st.sampled_from(["softmax", "masked", "tiny"]))
def test_single_draws_on_host_are_the_batched_draws_bit_for_bit(vocab, seed, kind):
    """The host's single-row path sums exactly as the batched numpy path (same block and cumulative
    sums), so a draw is the same token whether its step drew one token or many, for any u."""
    from vllm_ddtree.core.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(seed)
    probs = torch.randn(3, vocab, generator=gen).mul(4).softmax(-1)
    if kind == "masked":
        probs[torch.rand(3, vocab, generator=gen) < 0.7] = 0.0
        probs[:, 0] += 1e-3
    elif kind == "tiny":
        probs = probs * 1e-30
    uniforms = torch.rand(3, dtype=torch.float64, generator=gen)
    batched = inverse_cdf(probs, uniforms)
    for row in range(3):
        assert torch.equal(inverse_cdf(probs[row : row + 1], uniforms[row : row + 1]), batched[row : row + 1])


def test_inverse_cdf_rows_without_mass_give_minus_one_on_both_paths():
    from vllm_ddtree.core.sampling import _inverse_cdf_torch, inverse_cdf

    probs = torch.rand(3, 130)
    probs[0] = float("nan")
    probs[2] = 0.0
    uniforms = torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    for path in (inverse_cdf, _inverse_cdf_torch):
        tokens = path(probs, uniforms)
        assert tokens[0] == -1 and tokens[2] == -1 and 0 <= tokens[1] < 130
    assert [int(inverse_cdf(probs[r : r + 1], uniforms[r : r + 1])) for r in range(3)] == tokens.tolist()


def test_argmax_first_of_large_host_logits_is_torch_argmax():
    """Above the two-level threshold (many ties: the first maximum must win)."""
    from vllm_ddtree.core.sampling import _TWO_LEVEL_ARGMAX_MIN_ENTRIES, argmax_first

    logits = torch.randint(0, 4, (3, 50_000), generator=torch.Generator().manual_seed(5)).float()
    logits[1, 49_999] = 9.0
    logits[2, 7] = float("nan")
    assert logits.numel() > _TWO_LEVEL_ARGMAX_MIN_ENTRIES
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(argmax_first(logits.to(dtype)), logits.to(dtype).argmax(dim=-1))


def test_a_block_mass_rounded_up_never_yields_a_token_without_mass():
    """The float32 block sum 1 + 2^-24 * 1.5 rounds up to 1 + 2^-23, above the float64 prefix sums of its
    tokens: a u near 1 aims past the block's last token with mass, and every path must still return it
    (token 1), never a zero-mass token after it."""
    from vllm_ddtree.core.sampling import _inverse_cdf_torch, inverse_cdf

    probs = torch.zeros(2, 64)
    probs[:, 0], probs[:, 1] = 1.0, 1.5 * 2.0**-24
    assert float(probs[0].sum()) > 1.0 + 1.5 * 2.0**-24
    uniforms = torch.full((2,), 1.0 - 2.0**-40, dtype=torch.float64)
    for path in (inverse_cdf, _inverse_cdf_torch):
        assert path(probs, uniforms).tolist() == [1, 1]
    assert inverse_cdf(probs[:1], uniforms[:1]).tolist() == [1]


@given(
    temperatures=st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 50.0, allow_subnormal=False)), min_size=1, max_size=4),
    nodes=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_host_temperature_division_has_torchs_bits(temperatures, nodes, seed):
    """Host rows are divided by their temperature in numpy, device rows in torch: the same float32
    quotients (greedy requests' rows divided by 1), so a row's draw never depends on which path ran."""
    from vllm_ddtree.core.sampling import _divide_by_temperature, _per_row

    temperature = torch.tensor(temperatures, dtype=torch.float32)
    logits = torch.randn(len(temperatures) * nodes, 97, generator=torch.Generator().manual_seed(seed)) * 30
    host = logits.clone()
    _divide_by_temperature(host, TreeSamplingParams(temperature=temperature), nodes)
    params = TreeSamplingParams(temperature=temperature)
    expected = logits / _per_row(torch.where(params.is_greedy, 1.0, temperature), nodes)
    assert torch.equal(host, expected)
