"""Structured outputs at every tree node: each node's logits masked by the grammar state after its path.

Plain decoding masks the logits of the token after the committed output with the bitmask of the
grammar state that output reached (vLLM's `StructuredOutputManager.grammar_bitmask`, applied in place by
`apply_grammar_bitmask` before sampling). Tree node i sits where plain decoding would be after the
committed output and then the node's path (its ancestors at depths 1..d and itself), so its logits row
is masked with the bitmask of the state after output + path(i). Every later stage (history-dependent
options, sampling, logprobs) then reads the masked row, as plain decoding's sampler reads its masked
logits.

vLLM's scheduler knows drafts only as flat token lists, so it cannot compute per-node masks (it would
walk a tree's node list as one chain); the trees live in the runner. So the runner keeps its own grammar
per structured request (`NodeGrammars`), compiled by vLLM's own backend class (the one vLLM chose for
the request, `StructuredOutputsParams._backend`) from the request's structured-output key, the model's
tokenizer and the request's stop ids, exactly as `StructuredOutputManager._create_grammar` compiles the
scheduler's. Before each step it catches up with the request's committed output (the runner's
`CachedRequestState.output_token_ids`, so it holds in every executor and on every TP rank, and after
preemption); then one depth-first walk per tree fills every node's bitmask: a child is entered only
when its parent's bitmask allows its token (then it is accepted, its subtree filled, and rolled back).
Nodes the walk does not enter (their own token is forbidden, or an ancestor is a stop token that ended
the grammar) are never accepted by the acceptance walk (their parent's target token, drawn from masked
logits, cannot be their token), so their logits are left unmasked (finite, no NaN), as vLLM leaves a
terminated grammar's rows. The scheduler's grammar still advances with the committed tokens after each
step (vLLM's `update_from_output`), unchanged.

The same grammars keep forbidden draft candidates out of the trees (`filtered_trees`, called by the
drafter once it has the draft's top-k): a structured request's tree is rebuilt best-first among the
candidates its grammar admits at each node's path (`core.filtered_tree`), starting from the state after
this step's output, so the budget goes to nodes the acceptance walk can accept. Correctness does not
depend on it (the per-node masks alone make every emitted token the grammar-masked target's).

Under a reasoning parser (without `enable_in_reasoning`) the grammar starts where vLLM starts it
(`node_reasoning`): a node is masked only once the reasoning has ended on the committed output or on
its path (judged token by token by vLLM's own `_get_constraint_bounds`, as plain decoding commits
them), and the grammar consumes only the tokens after the end (the end token too when the parser calls
it content). Nodes before the end stay unmasked and every candidate enters their subtrees, except, on
vLLM releases that mask them in plain decoding (0.33: `StructuredOutputManager._masked_reasoning_ends`),
the implicit reasoning-end tokens the grammar rejects as its first content token: a reasoning node's row
allows every token but those (`_RequestGrammar.masked_while_reasoning`, asked of vLLM once per request,
`ReasoningGate.masked_reasoning_ends`; empty on 0.32, which masks nothing while reasoning).

Invariant: a grammar's state between steps is the state after the request's committed output
(`_RequestGrammar.consumed` tokens of it, of which the grammar consumed those after the reasoning's
end); the walk returns it there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.structured_output.backend_guidance import GuidanceBackend
from vllm.v1.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
from vllm.v1.structured_output.request import get_structured_output_key

from vllm_ddtree.core import DraftTree
from vllm_ddtree.core.filtered_tree import build_filtered_tree
from vllm_ddtree.vllm.node_reasoning import REASONING_ATTR, ReasoningGate, ReasoningGates
from vllm_ddtree.vllm.tree_step import TreeStep

logger = logging.getLogger("vllm.ddtree")

BACKENDS: dict[str, type[StructuredOutputBackend]] = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
"""The structured-output backends method 'ddtree' serves (tested); requests vLLM resolves to another
backend are refused at admission (`support.py`)."""


@dataclass
class _RequestGrammar:
    """One request's grammar; consumed: how many of its output tokens the grammar has accepted; broken:
    the grammar rejected a committed token (never expected: every emitted token was masked), so its
    nodes are left unmasked and vLLM's scheduler, whose grammar rejects the same token, ends the request."""

    grammar: StructuredOutputGrammar
    backend: StructuredOutputBackend
    consumed: int = 0
    broken: bool = False
    proposal: _ProposedMasks | None = None
    """The node bitmasks `filtered_trees` computed for the request's latest tree (used at most once)."""
    gate: ReasoningGate | None = None
    """Where the grammar starts under a reasoning parser; None: from the first output token."""
    ended: bool = True
    """Whether the reasoning has ended on the `consumed` output tokens (always, without a gate)."""
    masked_while_reasoning: tuple[int, ...] = ()
    """The tokens a row masks while the request reasons (`ReasoningGate.masked_reasoning_ends`)."""

    def grammar_tokens(self, before: list[int], ended: bool, tokens: list[int]) -> tuple[bool, list[int]]:
        """For `tokens` following the output tokens `before` in reasoning state `ended`: whether the
        reasoning has ended after them, and the ones the grammar consumes (those after the end)."""
        if ended or self.gate is None:
            return True, tokens
        for k, token in enumerate(tokens):
            skip = self.gate.grammar_start(before + tokens[:k], token)
            if skip is not None:
                return True, tokens[k + skip :]
        return False, []

    def reset(self) -> None:
        """Back to the state before any output token."""
        self.grammar.reset()
        self.consumed = 0
        self.ended = self.gate is None


@dataclass(frozen=True)
class _ProposedMasks:
    """A grammar-filtered tree's node bitmasks, as the verify step masks them, computed when the tree
    was built: valid for a verify step whose tree is a prefix of it (same tokens and parents, so the
    same paths; the scheduler may cut a tree) once the output is `output_length` tokens long (the state
    the tree was built from). bitmask [count, W]: a stop token's row all set (unconstrained)."""

    output_length: int
    token_ids: list[int]
    parents: list[int]
    bitmask: torch.Tensor

    def masks_for(self, step: TreeStep, index: int, count: int, output_length: int) -> torch.Tensor | None:
        """[count, W] for request `index` of `step`, or None unless the step verifies a prefix of this tree."""
        if output_length != self.output_length or count > len(self.token_ids):
            return None
        tree = step.tree
        if tree.token_ids[index, :count].tolist() != self.token_ids[:count] or tree.parents[index, :count].tolist() != self.parents[:count]:
            return None
        return self.bitmask[:count]


class NodeGrammars:
    """The runner's grammars of the structured requests it serves, by request id."""

    def __init__(self, vllm_config: Any) -> None:
        self._vllm_config = vllm_config
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._grammars: dict[str, _RequestGrammar] = {}
        self._reasoning_gates: ReasoningGates | None = None
        self._reasoning: dict[str, tuple[bool | None, dict | None]] = {}
        """(reasoning_ended, reasoning_parser_kwargs) of new requests, by id, until their grammar exists."""
        self._uncompiled: set[str] = set()
        """Requests whose grammar this runner could not compile (never expected: vLLM's scheduler
        compiled the same one before scheduling them); served unmasked, ended by vLLM's grammar."""

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._grammars.pop(req_id, None)
            self._reasoning.pop(req_id, None)
            self._uncompiled.discard(req_id)

    def note_new_requests(self, new_requests: Iterable[Any]) -> None:
        """Keep the reasoning inputs vLLM's scheduler sent with new requests (vLLM's `NewRequestData`,
        `REASONING_ATTR`; first sight only: a resumed request's grammar already exists)."""
        for new in new_requests:
            reasoning = getattr(new, REASONING_ATTR, None)
            if reasoning is not None and new.req_id not in self._grammars:
                self._reasoning.setdefault(new.req_id, reasoning)

    def mask_(self, logits: torch.Tensor, step: TreeStep, req_ids: list[str], requests: dict[str, Any]) -> None:
        """Mask in place the logits rows [rows, V] of every node of every structured request of the
        step (`step.node_logit_rows()`), each with the bitmask of the grammar state after the committed
        output and the node's path. req_ids [R]: the batch's requests in order; requests: the runner's
        `CachedRequestState` by id. A batch without structured requests costs one pass over req_ids."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        node_rows = None
        for index, req_id in enumerate(req_ids):
            state = requests[req_id]
            params = state.sampling_params
            if params is None or params.structured_outputs is None or params.structured_outputs.all_constraints_none():
                continue  # not a structured request for vLLM either (`StructuredOutputRequest.from_sampling_params`)
            entry = self._caught_up(req_id, params, state)
            if entry is None:
                continue
            if node_rows is None:
                node_rows = step.node_logit_rows()
            count = int(step.tree.num_nodes[index])
            proposal, entry.proposal = entry.proposal, None
            reused = None if proposal is None else proposal.masks_for(step, index, count, entry.consumed)
            output = [] if entry.ended else state.output_token_ids[: entry.consumed]  # read only while reasoning
            masks.append(reused if reused is not None else _node_bitmasks(req_id, entry, output, step, index, count))
            rows += node_rows[index, :count].tolist()
        if rows:
            _apply_bitmask_(logits, torch.cat(masks), torch.tensor(rows))

    def filtered_trees(
        self,
        trees: DraftTree,
        top_logprobs: torch.Tensor,
        top_token_ids: torch.Tensor,
        budget: int,
        req_ids: list[str],
        emitted: torch.Tensor,
        discarded: Any,
        requests: dict[str, Any],
    ) -> DraftTree:
        """The drafter's trees [R, budget + 1] with every structured request's tree rebuilt from only
        the candidates its grammar admits (`build_filtered_tree`), so no budget goes to nodes the
        acceptance walk could never accept; a stop token gets no children. top_logprobs,
        top_token_ids [R, L, K]: the draft's top-K per depth; emitted [R, W]: this step's output rows
        (-1 padded), which the next root's grammar state follows; discarded [R]: partial-prefill rows
        (their drafts are dropped by the scheduler). Other rows are returned unchanged; a grammar
        ends where it began (the state after the output before this step)."""
        if not self._grammars:
            return trees
        rebuilt: dict[int, DraftTree] = {}
        for index, req_id in enumerate(req_ids):
            entry = self._grammars.get(req_id)
            params = requests[req_id].sampling_params
            if entry is None or entry.broken or bool(discarded[index]):
                continue
            new = [token for token in emitted[index].tolist() if token >= 0]
            stops = params.all_stop_token_ids
            output = [] if entry.ended else requests[req_id].output_token_ids[: entry.consumed]  # read only while reasoning
            ended, consumed = entry.grammar_tokens(output, entry.ended, new)
            if any(token in stops for token in new) or entry.grammar.validate_tokens(consumed) != consumed:
                continue  # the request stops here (or its grammar disagrees: vLLM's scheduler ends it)
            entry.grammar.accept_tokens(req_id, consumed)
            try:
                tree, bitmask = _filtered_tree(req_id, entry, output + new, ended, stops, int(trees.token_ids[index, 0]),
                                               top_logprobs[index], top_token_ids[index], budget)
            finally:
                entry.grammar.rollback(len(consumed))
            rebuilt[index] = tree
            count = int(tree.num_nodes[0])
            entry.proposal = _ProposedMasks(entry.consumed + len(new), tree.token_ids[0, :count].tolist(), tree.parents[0, :count].tolist(), bitmask)
        if not rebuilt:
            return trees
        fields = {name: getattr(trees, name).clone() for name in ("token_ids", "parents", "depths", "ranks", "valid", "num_nodes")}
        for index, tree in rebuilt.items():
            for name, values in fields.items():
                values[index] = getattr(tree, name)[0]
        return DraftTree(**fields, max_depth=trees.max_depth)

    def _caught_up(self, req_id: str, params: Any, state: Any) -> _RequestGrammar | None:
        """The request's grammar at the state after its committed output (compiled on first use), None
        if broken. state: the runner's `CachedRequestState`."""
        entry = self._grammars.get(req_id)
        if entry is None:
            if req_id in self._uncompiled:
                return None
            try:
                entry = self._grammars[req_id] = self._compile(params)
                entry.gate = self._reasoning_gates.gate(params, state.prompt_token_ids or [], self._reasoning.pop(req_id, (None, None)))
                entry.ended = entry.gate is None
                if entry.gate is not None:  # the grammar is still at its start, as vLLM asks it
                    entry.masked_while_reasoning = entry.gate.masked_reasoning_ends(entry.grammar)
            except Exception:  # noqa: BLE001 - one request's grammar must not stop the engine
                self._grammars.pop(req_id, None)
                logger.exception("method 'ddtree': could not compile the grammar of request %s", req_id)
                self._uncompiled.add(req_id)
                return None
        if entry.broken:
            return None
        output = state.output_token_ids
        if entry.consumed > len(output):  # never expected (committed tokens stay): start over
            entry.reset()
        if entry.consumed < len(output):
            before = [] if entry.ended else list(output[: entry.consumed])  # read only while reasoning
            new = list(output[entry.consumed :])
            entry.consumed = len(output)
            entry.ended, new = entry.grammar_tokens(before, entry.ended, new)
            if new and not entry.grammar.accept_tokens(req_id, new):
                logger.error("method 'ddtree': the grammar of request %s rejected committed tokens %s", req_id, new)
                entry.broken = True
                return None
        return entry

    def _compile(self, params: Any) -> _RequestGrammar:
        """The request's grammar, compiled as `StructuredOutputManager._create_grammar` compiles it."""
        name = params.structured_outputs._backend or self._vllm_config.structured_outputs_config.backend
        backend = self._backends.get(name)
        if backend is None:
            model_config = self._vllm_config.model_config
            tokenizer = cached_tokenizer_from_config(model_config=model_config)
            backend = self._backends[name] = BACKENDS[name](self._vllm_config, tokenizer=tokenizer, vocab_size=model_config.get_vocab_size())
            if self._reasoning_gates is None:
                self._reasoning_gates = ReasoningGates(self._vllm_config, tokenizer)
        request_type, spec = get_structured_output_key(params.structured_outputs)
        grammar = backend.compile_grammar(request_type, spec, stop_token_ids=params.all_stop_token_ids)
        return _RequestGrammar(grammar, backend)


def _node_bitmasks(req_id: str, entry: _RequestGrammar, output: list[int], step: TreeStep, index: int, count: int) -> torch.Tensor:
    """[count, W] int32 bitmask of each of request `index`'s first `count` nodes (all bits set where
    unconstrained: after a stop; while reasoning, all but `entry.masked_while_reasoning`). Depth-first
    from the root (the state after the committed `output`); the grammar ends where it started."""
    grammar = entry.grammar
    bitmask = entry.backend.allocate_token_bitmask(count)
    bitmask.fill_(-1)
    words = bitmask.numpy()  # the same memory, read per word without torch's indexing overhead
    tree = step.tree
    parents, tokens = tree.parents[index, :count].tolist(), tree.token_ids[index, :count].tolist()
    children: list[list[int]] = [[] for _ in range(count)]
    for node in range(1, count):
        children[parents[node]].append(node)

    def fill(node: int, ended: bool, path: list[int]) -> None:
        if ended:
            if grammar.is_terminated():
                return
            grammar.fill_bitmask(bitmask, node)
        elif entry.masked_while_reasoning:  # otherwise the row is already all set
            _reasoning_row_(words[node], entry.masked_while_reasoning)
        for child in children[node]:
            token = tokens[child]
            if not _allows(words[node], token):
                continue
            child_ended, consumed = (True, [token]) if ended else entry.grammar_tokens(output + path, ended, [token])
            if consumed and not grammar.accept_tokens(req_id, consumed):
                continue  # an end token the parser calls content, which the grammar rejects
            fill(child, child_ended, path + [token])
            grammar.rollback(len(consumed))

    fill(0, entry.ended, [])
    return bitmask


def _filtered_tree(
    req_id: str, entry: _RequestGrammar, output: list[int], ended: bool, stops: set[int], root: int, top_logprobs: torch.Tensor,
    top_token_ids: torch.Tensor, budget: int
) -> tuple[DraftTree, torch.Tensor]:
    """One request's best-first tree among the candidates its grammar (at the root's state: after
    `output`, reasoning `ended` or not) admits, and its nodes' bitmasks [num_nodes, W] as the verify
    step applies them (`_ProposedMasks`); while reasoning, every candidate but
    `entry.masked_while_reasoning` is admitted."""
    grammar = entry.grammar
    bitmask = entry.backend.allocate_token_bitmask(budget + 1)  # row i: node i, filled as nodes are admitted
    words = bitmask.numpy()  # the same memory
    if ended:
        grammar.fill_bitmask(bitmask, 0)
    else:
        _reasoning_row_(words[0], entry.masked_while_reasoning)
    paths: list[list[int]] = [[]]
    consumed_paths: list[list[int]] = [[]]  # the tokens of each path the grammar consumes
    reasoning_ended = [ended]

    def admit(parent: int, token: int) -> bool:
        if reasoning_ended[parent] and not _allows(words[parent], token):
            return False
        if not reasoning_ended[parent] and token in entry.masked_while_reasoning:
            return False  # masked in its parent's row while reasoning
        parent_ended = reasoning_ended[parent]
        child_ended, consumed = (True, [token]) if parent_ended else entry.grammar_tokens(output + paths[parent], False, [token])
        node, path, consumed_path = len(paths), paths[parent] + [token], consumed_paths[parent] + consumed
        if token in stops:
            words[node] = 0  # nothing follows a stop token
        elif not child_ended:
            _reasoning_row_(words[node], entry.masked_while_reasoning)
        elif not parent_ended and grammar.validate_tokens(consumed_path) != consumed_path:
            return False  # an end token the parser calls content, which the grammar rejects
        else:
            grammar.accept_tokens(req_id, consumed_path)
            grammar.fill_bitmask(bitmask, node)
            grammar.rollback(len(consumed_path))
        paths.append(path)
        consumed_paths.append(consumed_path)
        reasoning_ended.append(child_ended)
        return True

    tree = build_filtered_tree(root, top_logprobs, top_token_ids, budget, admit)
    verify = bitmask[: len(paths)].clone()
    for node, path in enumerate(paths):
        if path and path[-1] in stops:  # as `_node_bitmasks` leaves it: unconstrained once the grammar ended
            if reasoning_ended[node]:
                verify[node] = -1
            else:
                _reasoning_row_(verify[node].numpy(), entry.masked_while_reasoning)
    return tree, verify


def _allows(bitmask_row: Any, token: int) -> bool:
    """Whether a packed int32 bitmask row (a numpy or torch row: bit t of word t // 32) allows token t."""
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


def _reasoning_row_(bitmask_row: Any, masked: tuple[int, ...]) -> None:
    """Fill a packed int32 bitmask row (numpy) as vLLM fills a row while the request reasons: every
    token allowed but `masked` (`StructuredOutputManager._fill_bitmasks` in vLLM 0.33)."""
    bitmask_row[:] = -1
    words = bitmask_row.view(np.uint32)
    for token in masked:
        words[token >> 5] &= ~np.uint32(1 << (token & 31))


def _apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[j], t] = -inf wherever bit t of bitmask[j] is clear (t below the bitmask's width and
    the logits' vocabulary), as xgrammar's `apply_token_bitmask_inplace` does."""
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    device = logits.device
    rows = rows.to(device)
    selected = logits.index_select(0, rows)
    selected[:, :vocab].masked_fill_(~allowed.to(device), float("-inf"))
    logits.index_copy_(0, rows, selected)
