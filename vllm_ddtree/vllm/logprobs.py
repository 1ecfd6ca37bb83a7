"""Logprobs of a step's emitted tokens, as plain decoding reports them.

Token k of a request's output was drawn at the k-th node of its accepted path, so its logprobs come
from that node's logits row (raw modes) or that row after the node's history-dependent options
(processed modes), computed as vLLM's sampler computes them at the same position and gathered by
vLLM's sampler itself (`Sampler.gather_logprobs`, `Sampler.gather_specific_token_logprobs`), in vLLM's
layout for the step's output rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_ddtree.core import TreeSamplingParams, process_logits

if TYPE_CHECKING:
    from vllm_ddtree.vllm.options import RequestOptions
    from vllm_ddtree.vllm.tree_step import TreeStep


def emitted_logprobs(
    sampler: Any, options: RequestOptions, logits: torch.Tensor, processed: torch.Tensor | None, step: TreeStep, output: torch.Tensor
) -> LogprobsTensors | None:
    """Logprobs of every emitted token of `step` (None unless a request of the batch asked for them: top
    n, the whole vocabulary or `logprob_token_ids`; options: the batch's; sampler: vLLM's).
    logits: the step's logits rows; processed [R, N, V]: the nodes' logits after their history-dependent
    options, or None; output [R, W]: the step's output rows (accepted drafts + bonus, -1 padded). Rows
    follow vLLM's layout for output: row r * W + k, rows of unused output slots zero (vLLM drops them
    with the slots). output and the acceptance are host tensors; the logprobs are computed and returned
    on the logits' device."""
    if not options.wants_logprobs:
        return None
    assert step.acceptance is not None
    device = logits.device
    emitted = output >= 0
    requests, columns = emitted.nonzero(as_tuple=True)
    nodes = step.acceptance.accepted_nodes[requests, columns]
    mode = sampler.logprobs_mode
    if processed is not None and mode.startswith("processed"):
        source, rows = processed.flatten(0, 1), requests * step.tree.nodes_per_request + nodes
    else:
        source, rows = logits, step.node_logit_rows()[requests, nodes]
    params = options.sampling_params(top_k_one_is_greedy=False)
    values = emitted_logprob_values(source, rows.to(device), requests.to(device), params, mode)
    gathered = gather_emitted_logprobs(sampler, values, output[emitted].long().to(device), requests,
                                       options.num_logprobs, options.logprob_token_ids)
    slots = emitted.flatten().nonzero().squeeze(1).to(device)
    width = gathered.logprob_token_ids.shape[1]
    token_ids = torch.zeros(emitted.numel(), width, dtype=gathered.logprob_token_ids.dtype, device=device)
    values_out = torch.zeros(emitted.numel(), width, dtype=gathered.logprobs.dtype, device=device)
    ranks = torch.zeros(emitted.numel(), dtype=gathered.selected_token_ranks.dtype, device=device)
    token_ids[slots], values_out[slots], ranks[slots] = gathered.logprob_token_ids, gathered.logprobs, gathered.selected_token_ranks
    return LogprobsTensors(token_ids, values_out, ranks)


def emitted_logprob_values(
    logits: torch.Tensor,
    emitted_rows: torch.Tensor,
    emitted_requests: torch.Tensor,
    params: TreeSamplingParams,
    logprobs_mode: str,
) -> torch.Tensor:
    """[M, V] the distribution vLLM's sampler reports logprobs from, for M emitted tokens, exactly as
    plain decoding computes it at the same positions: the step's logits rows emitted_rows [M] (each
    token's node row) of the requests emitted_requests [M] (batch indices into `params`).

    Modes (vLLM's `logprobs_mode`): raw_logprobs / raw_logits: the model's logits, log-softmaxed or
    not; processed_logprobs / processed_logits: after temperature, top-k and top-p (greedy requests:
    the raw logits, as in vLLM's greedy path)."""
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
