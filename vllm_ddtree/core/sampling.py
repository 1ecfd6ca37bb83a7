"""The target's token at every tree node: the tree acceptance rule's only source of randomness.

Rule (lossless for any tree fixed before the target is consulted): at every node draw ONE token from
the target distribution exactly as plain decoding would sample it there (temperature, then min_p, then
top_k, then top_p, in vLLM 0.32's order and with its tie rules), or take the argmax of the unscaled
logits for greedy requests. The walk descends iff the draw is a child. Each emitted token is then a
plain target sample given the emitted prefix. Never apply min(1, p/q) to top-k (non-sampled) draft
tokens: that rule is biased.

Randomness: a draw is the inverse CDF at one uniform u in [0, 1): token i iff cdf(i-1) <= u * cdf(V-1)
< cdf(i) (masked tokens have empty intervals), found in two levels: blocks of 64 tokens (float32 block
sums, float64 cumulative sums), then the token inside the block (float64 prefix sums). Seeded requests key u by
(seed, position of the token drawn) through splitmix64: every node sampling position p uses the same
u_p. Along the path the walk follows each position is drawn once, and whether a position is reached
depends only on earlier positions' u, so the emitted tokens are a plain target sample, and the same
one whatever the tree's shape or size and whatever else is in the batch (same seed, same prompt ->
same output). Unseeded requests draw u from the default generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's _SAMPLING_EPS)."""


@dataclass(frozen=True)
class TreeSamplingParams:
    """Per-request sampling parameters, [R] each; None means the filter is off for every request.

    temperature < GREEDY_EPS means greedy. top_k <= 0 or >= vocab, top_p >= 1 and min_p <= 0 switch a
    filter off for that request. seeds maps a request index to its seed (position-keyed draws).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeds: dict[int, int] = field(default_factory=dict)
    all_greedy: bool | None = None
    """Set by callers that know it on the host; None computes it (a device sync on accelerators)."""
    any_greedy: bool | None = None
    """Likewise: whether some request is greedy."""

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_EPS


def _per_row(values: torch.Tensor, nodes: int) -> torch.Tensor:
    return values.repeat_interleave(nodes).unsqueeze(1)


def process_logits(logits: torch.Tensor, params: TreeSamplingParams, inplace: bool = False) -> torch.Tensor:
    """[R, N, V] logits -> [R, N, V] float32 logits of the distribution plain sampling draws from.

    Masked tokens are -inf. Rows of greedy requests are processed with temperature 1 (unused).
    inplace: a contiguous float32 `logits` is overwritten instead of copied (callers' scratch copies).
    """
    num_req, nodes, vocab = logits.shape
    flat = logits.reshape(num_req * nodes, vocab).to(torch.float32, copy=not inplace)
    _divide_by_temperature(flat, params, nodes)
    if params.min_p is not None:
        probs = flat.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _per_row(params.min_p.to(torch.float32), nodes)
        flat.masked_fill_(probs < threshold, float("-inf"))
    if params.top_k is not None or params.top_p is not None:
        flat = _apply_top_k_top_p(flat, params, nodes, vocab)
    return flat.view(num_req, nodes, vocab)


def _divide_by_temperature(flat: torch.Tensor, params: TreeSamplingParams, nodes: int) -> None:
    """flat [R * N, V] float32 /= each request's temperature (1 for greedy requests), in place. Host rows
    through numpy (float32 division is correctly rounded in both libraries, so the bits are torch's):
    at a few rows each of the four torch ops costs tens of microseconds once a forward pass has evicted
    the caches, the division itself a few."""
    if flat.device.type != "cpu" or params.temperature.device.type != "cpu":
        flat.div_(_per_row(torch.where(params.is_greedy, 1.0, params.temperature.to(torch.float32)), nodes))
        return
    temperature = params.temperature.numpy()
    temperature = np.where(temperature < GREEDY_EPS, 1.0, temperature).astype(np.float32, copy=False)
    if (temperature == 1.0).all():  # x / 1 is x exactly: no pass over the rows
        return
    rows = flat.numpy()
    np.divide(rows, np.repeat(temperature, nodes)[:, None], out=rows)


def _apply_top_k_top_p(flat: torch.Tensor, params: TreeSamplingParams, nodes: int, vocab: int) -> torch.Tensor:
    """vLLM's rule: top_k keeps logits >= the k-th largest; top_p then drops the ascending-sorted
    prefix whose cumulative probability is <= 1 - p, always keeping the largest token."""
    ascending, order = flat.sort(dim=-1, stable=True)
    if params.top_k is not None:
        k = params.top_k.to(torch.long)
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        kth_largest = ascending.gather(1, _per_row(vocab - k, nodes))
        ascending.masked_fill_(ascending < kth_largest, float("-inf"))
    if params.top_p is not None:
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - _per_row(params.top_p.to(torch.float32), nodes)
        drop[:, -1] = False
        ascending.masked_fill_(drop, float("-inf"))
    return flat.scatter_(1, order, ascending)


def sample_tree_tokens(
    logits: torch.Tensor, params: TreeSamplingParams, positions: torch.Tensor | None = None, inplace: bool = False
) -> torch.Tensor:
    """[R, N, V] target logits at every node -> [R, N] the target's token at every node.

    positions [R, N]: the sequence position of the token each node draws (its depth + 1 past the
    root's position); needed when any request is seeded. inplace: `logits` may be overwritten."""
    greedy = params.is_greedy if params.all_greedy is None or params.any_greedy is not False else None
    all_greedy = bool(greedy.all()) if params.all_greedy is None else params.all_greedy
    any_greedy = all_greedy or (bool(greedy.any()) if params.any_greedy is None else params.any_greedy)
    greedy_tokens = argmax_first(logits.flatten(0, 1)).view(logits.shape[:2]) if any_greedy else None
    if all_greedy:
        return greedy_tokens
    processed = process_logits(logits, params, inplace)
    probs = processed.softmax(dim=-1)  # one fused pass: max, exp, sum
    uniforms = _uniforms(params.seeds, positions, probs.shape[:2], probs.device)
    sampled = inverse_cdf(probs.flatten(0, 1), uniforms.flatten()).view(probs.shape[:2])
    # A row without mass (every token masked, e.g. allowed_token_ids that min_tokens or bad_words forbid,
    # or +inf / NaN logits from extreme penalties) takes its first maximal processed logit (NaN counting
    # as maximal; all -inf: token 0), as vLLM's Gumbel-max sampler does; never a token past the vocabulary.
    # (A host sync only where it matters; the caller reads the tokens back next.)
    if bool((sampled.numpy() < 0).any() if sampled.device.type == "cpu" else (sampled < 0).any()):
        no_mass = sampled < 0
        sampled = torch.where(no_mass, argmax_first(processed.flatten(0, 1)).view(no_mass.shape), sampled)
    if greedy_tokens is None:
        return sampled
    assert greedy is not None
    return torch.where(greedy.unsqueeze(1), greedy_tokens, sampled)


def _uniforms(seeds: dict[int, int], positions: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """[R, N] float64 uniforms: keyed by (seed, position) in the rows of seeded requests, from the default
    generator in the others. Keyed uniforms are computed where `positions` live, then moved to `device`;
    a few host draws (a step without drafts, a small batch of chains) one by one in Python's ints, the
    same bits as `keyed_uniforms` without its dozen array ops."""
    if not seeds:
        return torch.rand(shape, dtype=torch.float64, device=device)
    if positions is None:
        raise ValueError("seeded requests need the positions of the tokens their nodes draw")
    rows = sorted(seeds)
    every_row = len(rows) == shape[0]  # every request seeded (rows are 0 .. R-1)
    seeded_positions = positions if every_row else positions[rows]
    if positions.device.type == "cpu" and seeded_positions.numel() <= _FEW_KEYED_DRAWS:
        keyed = torch.from_numpy(np.array(  # numpy builds the array several times faster than torch.tensor
            [[splitmix_uniform(seeds[r], p) for p in row] for r, row in zip(rows, seeded_positions.tolist())], dtype=np.float64
        ).reshape(len(rows), -1))
    else:
        keys = torch.tensor([_signed(seeds[r] & _MASK64) for r in rows], dtype=torch.long, device=positions.device).unsqueeze(1)
        keyed = keyed_uniforms(keys, seeded_positions.long())
    if every_row:
        return keyed.to(device)
    uniforms = torch.rand(shape, dtype=torch.float64, device=device)
    uniforms[rows] = keyed.to(device)
    return uniforms


_FEW_KEYED_DRAWS = 32
"""Up to this many keyed host draws go through `splitmix_uniform` one by one, more through
`keyed_uniforms`' array ops, whose fixed cost per call (whatever the size) exceeds a few scalar draws."""


_BLOCK = 64


_TWO_LEVEL_ARGMAX_MIN_ENTRIES = 98_304
"""bfloat16 host logits (numpy has no such dtype) with more entries than this take the two-level argmax:
it costs more per call than `max(-1).indices` but less per entry; this is about where they cross on a
CPU."""

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax_first(logits: torch.Tensor) -> torch.Tensor:
    """[M] index of the first maximal entry of each row of logits [M, V], exactly `logits.argmax(-1)`
    (NaN counts as maximal, as there; int64). Host logits of a dtype numpy has go through numpy's
    vectorised argmax (the same rule: first maximum, first NaN; several times cheaper than torch's
    `max(-1).indices` on the host); bfloat16
    host logits through `_argmax_two_level` when large, else `max(-1).indices` (the first maximal entry
    too, NaN included); device logits through torch's argmax itself."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(logits.numpy().argmax(-1).astype(np.int64, copy=False))
    if logits.numel() > _TWO_LEVEL_ARGMAX_MIN_ENTRIES:
        return _argmax_two_level(logits)
    return logits.max(dim=-1).indices


def _argmax_two_level(logits: torch.Tensor) -> torch.Tensor:
    """`argmax_first` in two levels: the first block of 64 holding the row maximum (block maxima are a
    vectorised reduction), then the first maximum inside it."""
    rows, vocab = logits.shape
    whole = vocab - vocab % _BLOCK
    if whole == 0:
        return logits.argmax(dim=-1)
    block_max = logits[:, :whole].unflatten(1, (-1, _BLOCK)).amax(-1)
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(-1, keepdim=True)], 1)
    first = block_max.argmax(dim=-1) * _BLOCK
    columns = first.unsqueeze(1) + torch.arange(_BLOCK, device=logits.device)
    inside = logits.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, float("-inf"))
    return first + inside.argmax(dim=-1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[M] the token i of each row of probs [M, V] (>= 0, not normalised) with
    cdf(i-1) <= u * cdf(V-1) < cdf(i). Block masses are summed in the probs' dtype (float32: relative
    error below 64 * 2**-24 ~ 4e-6 per block, far under what any sample size can detect; a float64 copy
    of the probs would cost many times more), their cumulative sums and the chosen block's prefix sums are
    float64; a token of zero mass is never returned. A row without positive mass (NaN: the softmax of
    logits that are all -inf, or hold +inf or NaN) gives -1.

    Host tensors go through numpy (a few vector ops instead of ~25 tensor ops: the per-step cost of
    small batches), device tensors through torch: the same rule, each path used for every draw on its
    device (rounding may differ between them only where u falls within a rounding error of a token's
    interval bound)."""
    if probs.device.type == "cpu" and uniforms.device.type == "cpu":
        if probs.shape[0] == 1:  # one draw (batch 1 without drafts): scalar bounds, half the array ops
            return torch.from_numpy(np.array([_inverse_cdf_numpy_row(probs.numpy()[0], float(uniforms.numpy()[0]))], dtype=np.int64))
        return torch.from_numpy(_inverse_cdf_numpy(probs.numpy(), uniforms.numpy()))
    return _inverse_cdf_torch(probs, uniforms)


def _inverse_cdf_torch(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    rows, vocab = probs.shape
    whole = vocab - vocab % _BLOCK
    block_mass = probs[:, :whole].reshape(rows, -1, _BLOCK).sum(-1).double()
    if whole < vocab:
        block_mass = torch.cat([block_mass, probs[:, whole:].sum(-1, keepdim=True).double()], 1)
    block_cdf = block_mass.cumsum_(-1)  # [M, ceil(vocab / 64)]
    total = block_cdf[:, -1]
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, targets.unsqueeze(1), right=True).squeeze(1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    tokens = block.unsqueeze(1) * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    inside = torch.where(tokens < vocab, probs.gather(1, tokens.clamp(max=vocab - 1)).double(), 0.0).cumsum_(-1)
    offset = torch.searchsorted(inside, (targets - before).unsqueeze(1), right=True).squeeze(1)
    last_with_mass = (inside < inside[:, -1:]).sum(-1)  # rounding between the two levels never overshoots it
    return torch.where(total > 0, block * _BLOCK + torch.minimum(offset, last_with_mass), -1)


def _inverse_cdf_numpy(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """`_inverse_cdf_torch` in numpy, step for step (searchsorted(right=True) on a sorted row is the count
    of its entries <= the target)."""
    rows, vocab = probs.shape
    whole = vocab - vocab % _BLOCK
    block_mass = probs[:, :whole].reshape(rows, -1, _BLOCK).sum(-1).astype(np.float64)
    if whole < vocab:
        block_mass = np.concatenate([block_mass, probs[:, whole:].sum(-1, keepdims=True).astype(np.float64)], 1)
    block_cdf = np.cumsum(block_mass, axis=1)
    total = block_cdf[:, -1]
    with np.errstate(invalid="ignore"):  # NaN rows (no mass) compare False everywhere and give -1 below
        targets = np.minimum(uniforms * total, np.nextafter(total, 0.0))
        block = (block_cdf <= targets[:, None]).sum(1)
        row = np.arange(rows)
        before = np.where(block > 0, block_cdf[row, np.maximum(block - 1, 0)], 0.0)
        tokens = block[:, None] * _BLOCK + np.arange(_BLOCK)
        inside = np.where(tokens < vocab, probs[row[:, None], np.minimum(tokens, vocab - 1)].astype(np.float64), 0.0)
        inside = np.cumsum(inside, axis=1)
        offset = (inside <= (targets - before)[:, None]).sum(1)
        last_with_mass = (inside < inside[:, -1:]).sum(1)
        return np.where(total > 0, block * _BLOCK + np.minimum(offset, last_with_mass), -1).astype(np.int64)


def _inverse_cdf_numpy_row(probs: np.ndarray, uniform: float) -> int:
    """`_inverse_cdf_numpy` of one row probs [V], the same numpy sums (block masses, cumulative sums)
    with the bounds as Python floats and the searches as `searchsorted` (the count of entries <= the
    target, as there; the block's tokens past the vocabulary, zero mass there, are simply absent)."""
    vocab = probs.shape[0]
    whole = vocab - vocab % _BLOCK
    block_mass = probs[:whole].reshape(-1, _BLOCK).sum(-1).astype(np.float64)
    if whole < vocab:
        block_mass = np.append(block_mass, np.float64(probs[whole:].sum()))
    block_cdf = np.cumsum(block_mass)
    total = float(block_cdf[-1])
    if not total > 0:  # NaN (no mass) included
        return -1
    target = min(uniform * total, float(np.nextafter(total, 0.0)))
    block = int(np.searchsorted(block_cdf, target, side="right"))
    before = float(block_cdf[block - 1]) if block > 0 else 0.0
    inside = np.cumsum(probs[block * _BLOCK : (block + 1) * _BLOCK].astype(np.float64))
    offset = int(np.searchsorted(inside, target - before, side="right"))
    last_with_mass = int(np.searchsorted(inside, inside[-1], side="left"))
    return block * _BLOCK + min(offset, last_with_mass)


_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def keyed_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per (seed, position) (int64 tensors, broadcast): the top 53 bits
    of splitmix64(seed * golden + position + 1), in wrapping 64-bit arithmetic. Host tensors go through
    numpy's uint64 (a few vector ops instead of ~20 tensor ops: the per-step cost of small batches);
    device tensors through torch's int64. Both give the same bits."""
    if seeds.device.type == "cpu" and positions.device.type == "cpu":
        return torch.from_numpy(_keyed_uniforms_numpy(seeds.numpy(), positions.numpy()))
    return _keyed_uniforms_torch(seeds, positions)


def splitmix_uniform(seed: int, position: int) -> float:
    """`keyed_uniforms` of one (seed, position), in Python's ints reduced mod 2^64 (any int seed)."""
    z = (seed * _GOLDEN + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def _keyed_uniforms_numpy(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as intended (0-d inputs are numpy scalars)
        z = seeds.astype(np.uint64) * np.uint64(_GOLDEN & _MASK64) + positions.astype(np.uint64) + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1 & _MASK64)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2 & _MASK64)
        z = z ^ (z >> np.uint64(31))
    return np.asarray((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def _keyed_uniforms_torch(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    z = seeds * _GOLDEN + positions + 1
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).to(torch.float64) * 2.0**-53
