"""Logprobs of a step's emitted tokens, as plain decoding reports them.

Token k of a request's output was drawn at the k-th node of its accepted path, so its logprobs come
from that node's logits row (raw modes) or that row after the node's history-dependent options
(processed modes), computed as vLLM's sampler computes them at the same position. The row choice
(`emitted_tokens`, `emitted_logit_values`) is shared by both runner layers; each gathers with its own
runner's code: V1's sampler (`Sampler.gather_logprobs`, `Sampler.gather_specific_token_logprobs`, below,
in V1's layout for the step's output rows), V2's `compute_topk_scores` (`v2/logprobs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_ddtree.core import TreeSamplingParams, process_logits

if TYPE_CHECKING:
    from vllm_ddtree.vllm.options import RequestOptions
    from vllm_ddtree.vllm.tree_step import TreeStep


@dataclass(frozen=True)
class EmittedTokens:
    """The M tokens a step emits (output >= 0, in row-major order of the output rows) and the rows their
    logprobs come from. Index tensors are host int64 tensors."""

    requests: torch.Tensor
    """[M] each token's request (batch index)."""
    columns: torch.Tensor
    """[M] each token's place in its request's output this step (0: the first token)."""
    token_ids: torch.Tensor
    """[M] the tokens."""
    source: torch.Tensor
    """[S, V] the rows the logprobs come from: the step's logits rows, or the nodes' processed rows
    flattened to [R * N, V] (processed modes of a batch whose nodes were processed)."""
    rows: torch.Tensor
    """[M] each token's row of `source`: the row of the node it was drawn at."""


def emitted_tokens(logits: torch.Tensor, processed: torch.Tensor | None, step: TreeStep, output: torch.Tensor, logprobs_mode: str) -> EmittedTokens:
    """The emitted tokens of `step` and their node rows. logits: the step's logits rows; processed
    [R, N, V]: the nodes' logits after their history-dependent options, or None; output [R, W] (host):
    the step's output rows (accepted drafts + bonus, -1 padded). Processed modes read `processed` when
    there is one, raw modes always the logits."""
    assert step.acceptance is not None
    requests, columns = (output >= 0).nonzero(as_tuple=True)
    nodes = step.acceptance.accepted_nodes[requests, columns]
    if processed is not None and logprobs_mode.startswith("processed"):
        source, rows = processed.flatten(0, 1), requests * step.tree.nodes_per_request + nodes
    else:
        source, rows = logits, step.node_logit_rows()[requests, nodes]
    return EmittedTokens(requests, columns, output[requests, columns].long(), source, rows)


def emitted_logprobs(
    sampler: Any, options: RequestOptions, logits: torch.Tensor, processed: torch.Tensor | None, step: TreeStep, output: torch.Tensor
) -> LogprobsTensors | None:
    """V1: logprobs of every emitted token of `step` (None unless a request of the batch asked for them:
    top n, the whole vocabulary or `logprob_token_ids`; options: the batch's; sampler: vLLM's V1 one).
    logits, processed, output: as `emitted_tokens`. Rows follow V1's layout for output: row r * W + k,
    rows of unused output slots zero (vLLM drops them with the slots). output and the acceptance are host
    tensors; the logprobs are computed and returned on the logits' device."""
    if not options.wants_logprobs:
        return None
    device = logits.device
    mode = sampler.logprobs_mode
    emitted = emitted_tokens(logits, processed, step, output, mode)
    params = options.sampling_params(top_k_one_is_greedy=False)
    values = emitted_logprob_values(emitted.source, emitted.rows.to(device), emitted.requests.to(device), params, mode)
    gathered = gather_emitted_logprobs(sampler, values, emitted.token_ids.to(device), emitted.requests,
                                       options.num_logprobs, options.logprob_token_ids)
    slots = (emitted.requests * output.shape[1] + emitted.columns).to(device)
    width = gathered.logprob_token_ids.shape[1]
    token_ids = torch.zeros(output.numel(), width, dtype=gathered.logprob_token_ids.dtype, device=device)
    values_out = torch.zeros(output.numel(), width, dtype=gathered.logprobs.dtype, device=device)
    ranks = torch.zeros(output.numel(), dtype=gathered.selected_token_ranks.dtype, device=device)
    token_ids[slots], values_out[slots], ranks[slots] = gathered.logprob_token_ids, gathered.logprobs, gathered.selected_token_ranks
    return LogprobsTensors(token_ids, values_out, ranks)


def emitted_logit_values(
    logits: torch.Tensor,
    emitted_rows: torch.Tensor,
    emitted_requests: torch.Tensor,
    params: TreeSamplingParams,
    logprobs_mode: str,
) -> torch.Tensor:
    """[M, V] float32 the logits vLLM's sampler reports logprobs from (before any log-softmax), for M
    emitted tokens, exactly as plain decoding computes them at the same positions: the rows emitted_rows
    [M] of `logits` (each token's node row) of the requests emitted_requests [M] (batch indices into
    `params`).

    Modes (vLLM's `logprobs_mode`): raw_*: the model's logits; processed_*: after temperature, top-k and
    top-p (greedy requests: the raw logits, as in vLLM's greedy path)."""
    rows = logits.index_select(0, emitted_rows).to(torch.float32)
    if logprobs_mode.startswith("processed") and not bool(params.is_greedy.all()):
        per_token = TreeSamplingParams(
            temperature=params.temperature[emitted_requests],
            top_k=None if params.top_k is None else params.top_k[emitted_requests],
            top_p=None if params.top_p is None else params.top_p[emitted_requests],
            min_p=None if params.min_p is None else params.min_p[emitted_requests],
        )
        processed = process_logits(rows.unsqueeze(1), per_token).squeeze(1)
        rows = torch.where(per_token.is_greedy.unsqueeze(1), rows, processed)
    return rows


def emitted_logprob_values(
    logits: torch.Tensor,
    emitted_rows: torch.Tensor,
    emitted_requests: torch.Tensor,
    params: TreeSamplingParams,
    logprobs_mode: str,
) -> torch.Tensor:
    """`emitted_logit_values`, log-softmaxed in the *_logprobs modes: the [M, V] distribution V1's
    sampler gathers from."""
    rows = emitted_logit_values(logits, emitted_rows, emitted_requests, params, logprobs_mode)
    return rows.log_softmax(dim=-1) if logprobs_mode.endswith("logprobs") else rows


def gather_emitted_logprobs(
    sampler: Any,
    values: torch.Tensor,
    token_ids: torch.Tensor,
    requests: torch.Tensor,
    num_logprobs: int | None,
    token_ids_by_request: dict[int, list[int]],
) -> LogprobsTensors:
    """vLLM's logprob rows for M emitted tokens, gathered by vLLM's own sampler from values [M, V]
    (`emitted_logprob_values`); token_ids [M] int64: the emitted tokens; requests [M] (host): their
    batch indices. num_logprobs: the batch's top n (vLLM's `max_num_logprobs`: the vocabulary size for
    logprobs=-1; None: no request asked for top logprobs); token_ids_by_request: the token ids the
    requests asking for `logprob_token_ids` want scored, by batch index.

    A row of a request in token_ids_by_request is `Sampler.gather_specific_token_logprobs`' (the token,
    then those ids, -inf padded), any other row `Sampler.gather_logprobs`' (the token, then the top n);
    both padded to the wider of the two. Plain decoding's sampler gives every row the former as soon as
    one request of the batch asks for ids (a top-n request beside it then gets no top n); here every
    request gets what it asked for, the same rows whenever a batch does not mix the two."""
    top = None if num_logprobs is None else sampler.gather_logprobs(values, num_logprobs, token_ids)
    scored = {row: token_ids_by_request[r] for row, r in enumerate(requests.tolist()) if r in token_ids_by_request}
    if not scored:
        assert top is not None, "no request asked for logprobs"
        return top
    specific = sampler.gather_specific_token_logprobs(values, scored, token_ids)
    if top is None:
        return specific
    width = max(top.logprobs.shape[1], specific.logprobs.shape[1])
    wants_ids = torch.zeros(values.shape[0], 1, dtype=torch.bool, device=values.device)
    wants_ids[list(scored)] = True

    def padded(tensors: LogprobsTensors) -> tuple[torch.Tensor, torch.Tensor]:
        pad = width - tensors.logprobs.shape[1]
        ids = torch.nn.functional.pad(tensors.logprob_token_ids.to(top.logprob_token_ids.dtype), (0, pad))
        return ids, torch.nn.functional.pad(tensors.logprobs, (0, pad), value=float("-inf"))

    (top_ids, top_values), (specific_ids, specific_values) = padded(top), padded(specific)
    return LogprobsTensors(
        torch.where(wants_ids, specific_ids, top_ids),
        torch.where(wants_ids, specific_values, top_values),
        top.selected_token_ranks,
    )
