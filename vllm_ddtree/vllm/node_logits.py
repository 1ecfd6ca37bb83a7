"""History-dependent request options at every tree node, exactly as plain decoding applies them.

Plain decoding processes the logits of the token after position p with the request's output so far,
in vLLM's V1 order: allowed_token_ids, bad words, min_tokens, logit_bias, then presence / frequency /
repetition penalties. Tree node i sits where plain decoding would be after emitting the committed
output and then the tokens of the node's path (its ancestors at depths 1..d and itself), so its
history is `output_token_ids + path(i)`; its output position is len(output) + depth(i). Every node is
processed with its own history, and the sampling rule (temperature, top-k, top-p, min_p) then draws
from the processed logits, so each emitted token is a plain sample given the emitted prefix.

Runner-neutral: torch on a `DraftTree` and a `RequestOptions` record (`options.py`), whichever runner
layer read it. Padded nodes are processed as roots (empty path); nothing reads them.
"""

from __future__ import annotations

import torch

from vllm_ddtree.core import DraftTree
from vllm_ddtree.core.gdn_tree import ancestor_table
from vllm_ddtree.vllm.options import MinTokens, Penalties, RequestOptions


def process_node_logits(node_logits: torch.Tensor, tree: DraftTree, options: RequestOptions) -> torch.Tensor:
    """node_logits [R, N, V] (float32, modified in place and returned): each node's logits after its
    request's history-dependent options, applied with the node's own history."""
    if options.disallowed is not None:
        node_logits.masked_fill_(options.disallowed.unsqueeze(1), float("-inf"))
    if options.bad_words:
        _ban_bad_words(node_logits, tree, options)
    for request, min_tokens in options.min_tokens.items():
        _mask_stops_before_min_tokens(node_logits[request], tree.depths[request], min_tokens)
    for request, biases in options.logit_bias.items():
        tokens = torch.tensor(list(biases), device=node_logits.device)
        node_logits[request, :, tokens] += torch.tensor(list(biases.values()), dtype=torch.float32, device=node_logits.device)
    if options.penalties is not None:
        _apply_penalties(node_logits, tree, options.penalties)
    return node_logits


def path_tokens(tree: DraftTree, request: int) -> list[list[int]]:
    """The token path of every node of one request, root excluded, node itself included (parents
    precede children, so one pass in index order builds them); padded nodes' paths are empty."""
    count = int(tree.num_nodes[request])
    parents, tokens = tree.parents[request, :count].tolist(), tree.token_ids[request, :count].tolist()
    paths: list[list[int]] = [[]]
    for node in range(1, count):
        paths.append(paths[parents[node]] + [tokens[node]])
    return paths + [[]] * (tree.nodes_per_request - count)


def _ban_bad_words(node_logits: torch.Tensor, tree: DraftTree, options: RequestOptions) -> None:
    """A bad word's last token gets -inf at every node whose history ends with the word's other tokens
    (a one-token word: at every node)."""
    requests, nodes, tokens = [], [], []
    for request, words in options.bad_words.items():
        longest = max(len(word) for word in words) - 1
        output = options.output_token_ids[request]
        committed = list(output[max(len(output) - longest, 0):])
        for node, path in enumerate(path_tokens(tree, request)):
            history = committed + path  # the node's history, as far back as a word reaches
            recent = history[max(len(history) - longest, 0):]
            for word in words:
                prefix = len(word) - 1
                if prefix <= len(recent) and recent[len(recent) - prefix:] == word[:-1]:
                    requests.append(request)
                    nodes.append(node)
                    tokens.append(word[-1])
    if tokens:
        node_logits[requests, nodes, tokens] = float("-inf")


def _mask_stops_before_min_tokens(rows: torch.Tensor, depths: torch.Tensor, option: MinTokens) -> None:
    """rows [N, V] of one request (in place): stops -inf at the nodes whose depth is below
    `option.tokens_left`; with `keep_if_all_masked`, a node whose row that leaves all -inf keeps its
    finite stop logits."""
    early = (depths < option.tokens_left).nonzero().squeeze(1).to(rows.device)
    if not early.numel() or not option.stop_token_ids:
        return
    cells = early.unsqueeze(1), torch.tensor(option.stop_token_ids, device=rows.device).unsqueeze(0)
    stop_logits = rows[cells]  # [E, S], a copy
    rows[cells] = float("-inf")
    if option.keep_if_all_masked:
        keep = torch.isneginf(rows[early]).all(dim=-1, keepdim=True) & torch.isfinite(stop_logits)
        rows[cells] = torch.where(keep, stop_logits, float("-inf"))


def _apply_penalties(node_logits: torch.Tensor, tree: DraftTree, penalties: Penalties) -> None:
    """Every node's penalties with its history's token counts: the committed output's plus its path's.

    Float ops as vLLM's (V1's `apply_all_penalties` on CPU and V2's kernel alike), so the results are
    bit-equal: a seen token's (prompt or history) positive logit times the float32 reciprocal of the
    repetition penalty, any other seen logit times the penalty; then minus frequency x count, then
    minus presence x (count > 0). A request without penalties (0, 0, 1) comes out unchanged.

    Only the columns a request can have seen (its prompt's, its output's and its tree's tokens) are
    computed: vLLM multiplies every other logit by 1 and subtracts 0 from it, which leaves its value
    (a -0.0 logit under a negative penalty becomes +0.0 there, an equal value)."""
    paths = _path_token_ids(tree).to(node_logits.device, torch.int64)  # [R, N, span], -1 off the path
    tree_tokens = tree.token_ids.to(node_logits.device, torch.int64)
    for request in range(node_logits.shape[0]):
        seen_anywhere = penalties.prompt_mask[request] | (penalties.output_counts[request] > 0)
        seen_anywhere[tree_tokens[request]] = True
        columns = seen_anywhere.nonzero().squeeze(1)  # [S] ascending token ids
        path = paths[request]
        slots = torch.where(path >= 0, torch.searchsorted(columns, path.clamp(min=0)), len(columns))  # S: off the path
        counts = torch.zeros(path.shape[0], len(columns) + 1, dtype=torch.int32, device=node_logits.device)
        counts.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.int32))
        counts = counts[:, :-1] + penalties.output_counts[request, columns]  # [N, S]
        seen = counts > 0
        scale = torch.where(penalties.prompt_mask[request, columns] | seen, penalties.repetition[request], 1.0)
        logits = node_logits[request][:, columns]  # [N, S], a copy
        logits.mul_(torch.where(logits > 0, 1.0 / scale, scale))
        logits.sub_(penalties.frequency[request] * counts)
        logits.sub_(penalties.presence[request] * seen)
        node_logits[request][:, columns] = logits


def _path_token_ids(tree: DraftTree) -> torch.Tensor:
    """[R, N, span] the tokens on each node's path (root excluded), the node's first, -1 past the path."""
    span = max(tree.max_depth, 1)
    ancestors = ancestor_table(tree.parents, span)  # [R, N, span]: the node, its parent, ...
    tokens = tree.token_ids.gather(1, ancestors.clamp(min=0).flatten(1)).view(ancestors.shape)
    on_path = torch.arange(span, device=tokens.device) < tree.depths.unsqueeze(2)  # from depth 1 down to the node
    return torch.where(on_path, tokens, -1)
