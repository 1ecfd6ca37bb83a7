"""The host's copy of each request's sampling params, prompt and committed output on vLLM's V2 model
runner (docs/v2_runner.md, D12): V2 keeps no `requests` dict, and its own copy of the tokens
(`req_states.all_token_ids`) lives on the device, so the node histories (committed output + a node's
path) come from here.

Fed from two places only, both on the host:
- `NewRequestData` (a new request, or one resumed after preemption: vLLM re-adds it with its prompt and
  the output it had, `prefill_token_ids`, the first `prompt_len` of them the prompt);
- each step whose tokens the core rule drew (`commit`): the first num_sampled tokens of every request's
  output row (accepted path + bonus).

Invariant: the output of a request that `needs_history` (its options or grammar read it) is its
committed output: every batch holding such a request is drawn by the core rule
(`v2/options.vllm_sampler_serves`), so none of its tokens is committed past `commit`. (A step that
ends a request, at a stop or max_tokens, may append tokens vLLM drops; the request is then finished
and dropped.) The other requests keep no output (None): nothing reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def has_penalties(params: Any) -> bool:
    """Whether a SamplingParams has a presence, frequency or repetition penalty."""
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def needs_history(params: Any) -> bool:
    """Whether a SamplingParams' options read the committed output: penalties (its token counts),
    bad words (its last tokens), min_tokens (its length), structured outputs (the grammar's state)."""
    return bool(has_penalties(params) or params.bad_words_token_ids or params.min_tokens > 0 or params.structured_outputs is not None)


@dataclass
class MirroredRequest:
    """One request: its SamplingParams, prompt token ids, committed output (None unless `needs_history`)."""

    params: Any
    prompt: Sequence[int]
    output: list[int] | None

    # what `node_grammar.NodeGrammars` reads of a request (V1 hands it vLLM's `CachedRequestState`)
    @property
    def sampling_params(self) -> Any:
        return self.params

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.prompt

    @property
    def output_token_ids(self) -> list[int] | None:
        return self.output


class OutputMirror:
    """Every live request's `MirroredRequest`, by request id."""

    def __init__(self) -> None:
        self._requests: dict[str, MirroredRequest] = {}

    def note_new_requests(self, new_requests: Iterable[Any]) -> None:
        """Add (or, for a resumed request, replace) the scheduler's new requests (`NewRequestData`)."""
        for new in new_requests:
            params = new.sampling_params
            if params is None:  # pooling requests sample nothing
                continue
            tokens = new.prefill_token_ids
            output = list(tokens[new.prompt_len :]) if needs_history(params) else None
            self._requests[new.req_id] = MirroredRequest(params, tokens[: new.prompt_len], output)

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests (a preempted one comes back as a new request)."""
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    def requests(self, req_ids: Sequence[str]) -> list[MirroredRequest]:
        """The batch's requests, in batch order."""
        return [self._requests[req_id] for req_id in req_ids]

    @property
    def by_id(self) -> Mapping[str, MirroredRequest]:
        """Every live request by id (read-only use)."""
        return self._requests

    def commit(self, req_ids: Sequence[str], output_rows: np.ndarray, num_sampled: np.ndarray) -> None:
        """Append this step's committed tokens: output_rows [R, W] (the accepted path + bonus, -1 padded),
        num_sampled [R] how many of each row vLLM commits (0 for a row still prefilling)."""
        for row, req_id in enumerate(req_ids):
            output = self._requests[req_id].output
            if output is not None and num_sampled[row]:
                output.extend(output_rows[row, : num_sampled[row]].tolist())
