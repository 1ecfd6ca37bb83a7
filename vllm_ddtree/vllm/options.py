"""The request options of one step's batch, in one runner-neutral record (`RequestOptions`).

Each runner layer reads the record from its own per-request state (V1: `v1/options.py`); the shared code
(`sampling.py`, `node_logits.py`, `logprobs.py`) reads only the record. Requests are the batch's
first `num_reqs` rows in the runner's batch order; every per-request tensor has those rows, on the
device of the step's logits.

Invariants:
- a request appears in `bad_words` or `logit_bias` only when it has some, in `min_tokens` only while
  its output is shorter than min_tokens (with or without stop tokens: either way the batch is one that
  only the core rule serves, `sampling.plain_sampler_serves`);
- `penalties` is None when no request of the batch has a penalty; otherwise it holds every request's
  (presence 0, frequency 0, repetition 1 for those without: their logits come out unchanged);
- `output_token_ids` holds the committed output of every request with bad words (the others' rows may
  be empty): a node's history is that output followed by the node's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_ddtree.core import TreeSamplingParams


@dataclass
class Penalties:
    """Presence, frequency and repetition penalties (OpenAI's definitions, as vLLM applies them)."""

    presence: torch.Tensor
    """[R] float32, subtracted once from a token the history holds."""
    frequency: torch.Tensor
    """[R] float32, subtracted once per occurrence in the history."""
    repetition: torch.Tensor
    """[R] float32: a token of the prompt or the history has a positive logit divided by it, any other
    logit multiplied by it (1: off)."""
    prompt_mask: torch.Tensor
    """[R, V] bool: the token occurs in the request's prompt."""
    output_counts: torch.Tensor
    """[R, V] int32: occurrences of the token in the request's committed output."""


@dataclass(frozen=True)
class MinTokens:
    """Stop tokens are masked while the output is shorter than min_tokens."""

    tokens_left: int
    """min_tokens minus the committed output's length (> 0): stops are masked at the nodes whose depth
    is below it (a node at depth d draws output token len(output) + d)."""
    stop_token_ids: tuple[int, ...]
    """Sorted; empty when the request has none (ignore_eos and no stop_token_ids)."""
    keep_if_all_masked: bool
    """A structured-output request: where masking its stops would leave a node's row all -inf (a grammar
    that has ended admits only stops), the stops keep their finite logits."""


@dataclass
class RequestOptions:
    """Every option of a batch's requests that the tree sampling reads (module docstring)."""

    num_reqs: int
    device: torch.device
    """The step's logits' device, where every tensor of the record lives."""
    all_greedy: bool
    """Every request is greedy (temperature 0)."""
    all_random: bool
    """No request is greedy (host flag: no device sync to learn it)."""
    temperature: torch.Tensor | None = None
    """[R] float32; None when all_greedy."""
    top_k: torch.Tensor | None = None
    """[R]; None: no request uses top_k (<= 0 or >= V: off for that request)."""
    top_p: torch.Tensor | None = None
    """[R]; None: no request uses top_p."""
    min_p: torch.Tensor | None = None
    """[R] float32; None: no request uses min_p (0: off for that request)."""
    seeds: dict[int, int] = field(default_factory=dict)
    """Request index -> seed, for the seeded requests (their draws are keyed by seed and position)."""
    disallowed: torch.Tensor | None = None
    """[R, V] bool: True where allowed_token_ids excludes the token; None when no request has them."""
    bad_words: dict[int, list[list[int]]] = field(default_factory=dict)
    """Request index -> its bad words' token ids (the last token of a word is banned where the history
    ends with the rest of it)."""
    min_tokens: dict[int, MinTokens] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    """Request index -> token id -> bias added to that token's logit."""
    penalties: Penalties | None = None
    output_token_ids: Sequence[Sequence[int]] = ()
    """[R] each request's committed output (host)."""
    num_logprobs: int | None = None
    """The largest top-n logprobs a request asks for (V for the whole vocabulary); None: none asks."""
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Request index -> the token ids whose logprobs it asks for."""

    @property
    def needs_node_processing(self) -> bool:
        """Whether some request's logits change with its history before sampling (`node_logits`)."""
        return bool(
            self.disallowed is not None or self.bad_words or self.min_tokens or self.logit_bias or self.penalties is not None
        )

    @property
    def wants_logprobs(self) -> bool:
        return self.num_logprobs is not None or bool(self.logprob_token_ids)

    def sampling_params(self, top_k_one_is_greedy: bool = True) -> TreeSamplingParams:
        """The core rule's parameters of the batch's requests.

        top_k_one_is_greedy: draw top_k 1 as greedy: plain sampling keeps only the largest logit (ties
        aside), and the argmax is exactly what a greedy request emits (logprobs keep the request's own
        parameters)."""
        if self.all_greedy or self.temperature is None:
            return TreeSamplingParams(temperature=torch.zeros(self.num_reqs, device=self.device), all_greedy=True)
        temperature = self.temperature
        if self.top_k is not None and top_k_one_is_greedy:
            temperature = torch.where(self.top_k == 1, 0.0, temperature)
        no_greedy = self.all_random and (self.top_k is None or not top_k_one_is_greedy)
        return TreeSamplingParams(
            all_greedy=False if no_greedy else None,
            any_greedy=False if no_greedy else None,
            temperature=temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seeds=self.seeds,
        )


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_ids), vocab_size] int32: how often each token occurs in each list."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)  # vocab_size: the padding's bin
    for row, ids in enumerate(token_ids):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]
