"""History-dependent request options at every tree node, exactly as plain decoding applies them.

Plain decoding processes the logits of the token after position p with the request's output so far:
allowed_token_ids, bad words, min_tokens and logit_bias (the non-argmax-invariant logits processors),
then presence / frequency / repetition penalties, in that order (vLLM's
`Sampler.apply_logits_processors`). Tree node i sits where plain decoding would be after emitting the
committed output and then the tokens of the node's path (its ancestors at depths 1..d and itself), so
its history is `output_token_ids + path(i)`; its output position is len(output) + depth(i). Every node
is processed with its own history, and the sampling rule (temperature, top-k, top-p) then draws from
the processed logits, so each emitted token is a plain sample given the emitted prefix.

The processing runs only for batches in which a request uses such an option (`needs_node_processing`);
histories are built only for the requests with penalties or bad words.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import apply_all_penalties

from vllm_ddtree.vllm.tree_step import TreeStep


def needs_node_processing(metadata: Any) -> bool:
    """Whether some request of the batch uses an option that changes its logits before sampling."""
    return (
        metadata.allowed_token_ids_mask is not None
        or bool(metadata.bad_words_token_ids)
        or not metadata.no_penalties
        or any(_active(processor) for processor in metadata.logitsprocs.non_argmax_invariant)
    )


def _active(processor: Any) -> bool:
    if isinstance(processor, MinTokensLogitsProcessor):
        return bool(processor.min_toks)
    if isinstance(processor, LogitBiasLogitsProcessor):
        return bool(processor.biases)
    return True


def path_tokens(step: TreeStep, request: int) -> list[list[int]]:
    """The token path of every node of one request, root excluded, node itself included (parents
    precede children, so one pass in index order builds them)."""
    tree = step.tree
    count = int(tree.num_nodes[request])
    parents, tokens = tree.parents[request, :count].tolist(), tree.token_ids[request, :count].tolist()
    paths: list[list[int]] = [[]]
    for node in range(1, count):
        paths.append(paths[parents[node]] + [tokens[node]])
    return paths + [[]] * (tree.nodes_per_request - count)


def process_node_logits(node_logits: torch.Tensor, step: TreeStep, metadata: Any) -> torch.Tensor:
    """node_logits [R, N, V] (float32, modified in place): each node's logits after the request's
    history-dependent options, with the node's own history."""
    num_req, num_nodes, vocab = node_logits.shape
    flat = node_logits.view(num_req * num_nodes, vocab)
    if metadata.allowed_token_ids_mask is not None:
        node_logits.masked_fill_(metadata.allowed_token_ids_mask[:num_req].unsqueeze(1), float("-inf"))
    bad_words = {r: words for r, words in (metadata.bad_words_token_ids or {}).items() if r < num_req}
    penalized = not metadata.no_penalties
    histories: list[list[int]] = []
    if bad_words or penalized:
        histories = _histories(step, metadata.output_token_ids, set(bad_words) | (set(range(num_req)) if penalized else set()))
    if bad_words:
        apply_bad_words(flat, {r * num_nodes + i: words for r, words in bad_words.items() for i in range(num_nodes)}, histories)
    for processor in metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            _mask_stops_before_min_tokens(node_logits, step, processor)
        else:  # position-independent processors (e.g. logit bias): every node as a batch row
            for node in range(num_nodes):
                processor.apply(node_logits[:, node])
    if penalized:
        rows = torch.arange(num_req).repeat_interleave(num_nodes)
        flat.copy_(
            apply_all_penalties(
                flat,
                metadata.prompt_token_ids[rows],
                metadata.presence_penalties[rows],
                metadata.frequency_penalties[rows],
                metadata.repetition_penalties[rows],
                histories,
            )
        )
    return node_logits


def _histories(step: TreeStep, output_token_ids: list[list[int]], requests: set[int]) -> list[list[int]]:
    """[R * N] every node's history (output + path) for `requests`, empty for the others."""
    num_nodes = step.tree.nodes_per_request
    histories: list[list[int]] = []
    for request in range(step.tree.num_requests):
        if request not in requests:
            histories += [[]] * num_nodes
            continue
        output = list(output_token_ids[request])
        histories += [output + path for path in path_tokens(step, request)]
    return histories


def _mask_stops_before_min_tokens(node_logits: torch.Tensor, step: TreeStep, processor: MinTokensLogitsProcessor) -> None:
    """Stop tokens are masked at nodes whose output position len(output) + depth is below min_tokens;
    for a structured-output request, a node's stop tokens keep their (finite) logits where masking them
    would leave the node's row without mass (vLLM's `_mask_stop_token_logits`: a grammar that has ended
    admits only stop tokens)."""
    for request, (min_tokens, output, stop_token_ids, structured) in processor.min_toks.items():
        if request >= node_logits.shape[0] or not stop_token_ids:
            continue
        early = (step.tree.depths[request] < min_tokens - len(output)).nonzero().squeeze(1)
        if not early.numel():
            continue
        stops = torch.tensor(sorted(stop_token_ids), device=node_logits.device)
        early = early.to(node_logits.device)
        rows = node_logits[request]
        stop_logits = rows[early.unsqueeze(1), stops.unsqueeze(0)]  # [E, S], a copy
        rows[early.unsqueeze(1), stops.unsqueeze(0)] = float("-inf")
        if structured:
            restore = torch.isneginf(rows[early]).all(dim=-1, keepdim=True) & torch.isfinite(stop_logits)
            nodes, columns = restore.nonzero(as_tuple=True)
            rows[early[nodes], stops[columns]] = stop_logits[nodes, columns]
