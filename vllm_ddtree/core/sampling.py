"""The target's token at every tree node: the tree acceptance rule's only source of randomness.

Rule (lossless for any tree fixed before the target is consulted): at every node draw ONE token from
the target distribution exactly as plain decoding would sample it there (temperature, then min_p, then
top_k, then top_p, in vLLM 0.32's order and with its tie rules), or take the argmax of the unscaled
logits for greedy requests. The walk descends iff the draw is a child. Each emitted token is then a
plain target sample given the emitted prefix. Never apply min(1, p/q) to top-k (non-sampled) draft
tokens: that rule is biased.

Randomness: draws use the exponential race argmax(p / E), E ~ Exp(1) i.i.d. over the vocabulary, which
picks i with probability p_i. Seeded requests key E by (seed, position of the token drawn): every node
sampling position p uses the same E_p. Along the path the walk follows each position is drawn once, and
whether a position is reached depends only on earlier positions' E, so the emitted tokens are a plain
target sample, and the same one whatever the tree's shape or size and whatever else is in the batch
(same seed, same prompt -> same output). Unseeded requests draw from the default generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_EPS


def _per_row(values: torch.Tensor, nodes: int) -> torch.Tensor:
    return values.repeat_interleave(nodes).unsqueeze(1)


def process_logits(logits: torch.Tensor, params: TreeSamplingParams) -> torch.Tensor:
    """[R, N, V] logits -> [R, N, V] float32 logits of the distribution plain sampling draws from.

    Masked tokens are -inf. Rows of greedy requests are processed with temperature 1 (unused).
    """
    num_req, nodes, vocab = logits.shape
    flat = logits.reshape(num_req * nodes, vocab).to(torch.float32, copy=True)
    temperature = torch.where(params.is_greedy, 1.0, params.temperature.to(torch.float32))
    flat.div_(_per_row(temperature, nodes))
    if params.min_p is not None:
        probs = flat.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _per_row(params.min_p.to(torch.float32), nodes)
        flat.masked_fill_(probs < threshold, float("-inf"))
    if params.top_k is not None or params.top_p is not None:
        flat = _apply_top_k_top_p(flat, params, nodes, vocab)
    return flat.view(num_req, nodes, vocab)


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


def sample_tree_tokens(logits: torch.Tensor, params: TreeSamplingParams, positions: torch.Tensor | None = None) -> torch.Tensor:
    """[R, N, V] target logits at every node -> [R, N] the target's token at every node.

    positions [R, N]: the sequence position of the token each node draws (its depth + 1 past the
    root's position); needed when any request is seeded."""
    greedy_tokens = logits.argmax(dim=-1)
    all_greedy = bool(params.is_greedy.all()) if params.all_greedy is None else params.all_greedy
    if all_greedy:
        return greedy_tokens
    probs = process_logits(logits, params).softmax(dim=-1)
    noise = torch.empty_like(probs)
    if len(params.seeds) < probs.shape[0]:
        noise.exponential_()
    if params.seeds:
        if positions is None:
            raise ValueError("seeded requests need the positions of the tokens their nodes draw")
        for request, seed in params.seeds.items():
            _keyed_exponentials_(noise[request], seed, positions[request])
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(params.is_greedy.unsqueeze(1), greedy_tokens, sampled)


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for (request seed, position): splitmix64 of the pair, so nearby
    positions and seeds give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _keyed_exponentials_(noise: torch.Tensor, seed: int, positions: torch.Tensor) -> None:
    """noise [N, V]: row i := the Exp(1) vector of (seed, positions[i]); rows sharing a position share it."""
    generator = torch.Generator(device=noise.device)
    for position in positions.unique().tolist():
        generator.manual_seed(position_seed(seed, int(position)))
        row = torch.empty(noise.shape[1], dtype=noise.dtype, device=noise.device).exponential_(generator=generator)
        noise[positions == position] = row
