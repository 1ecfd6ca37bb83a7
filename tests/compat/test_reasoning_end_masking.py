"""While a structured request reasons, a tree node's row masks what the installed vLLM masks in plain
decoding's rows: on vLLM 0.33 the implicit reasoning-end tokens the grammar rejects as first content
(`StructuredOutputManager._masked_reasoning_ends`), on 0.32 nothing.

The walk (`_node_bitmasks`) and the grammar-filtered tree (`_filtered_tree`) run here on a stand-in
grammar that accepts every token, under a gate whose only reasoning end is an implicit one (token END,
content); the e2e tests run them on xgrammar and vLLM's reasoning parsers.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from vllm_ddtree.core import DraftTree  # noqa: E402
from vllm_ddtree.vllm.node_grammar import _filtered_tree, _node_bitmasks, _RequestGrammar  # noqa: E402

END, ROOT, OTHER, THIRD = 37, 5, 3, 9
WORDS = 2  # a 64-token vocabulary


class AnyGrammar:
    """A grammar that accepts every token and never terminates; its rows allow every token."""

    def accept_tokens(self, request_id, tokens):
        return True

    def validate_tokens(self, tokens):
        return list(tokens)

    def rollback(self, num_tokens):
        pass

    def is_terminated(self):
        return False

    def fill_bitmask(self, bitmask, index):
        bitmask[index] = -1


class Backend:
    def allocate_token_bitmask(self, count):
        return torch.full((count, WORDS), -1, dtype=torch.int32)


GATE = SimpleNamespace(grammar_start=lambda before, token: 0 if token == END else None)  # END: an implicit end


def _entry(masked: tuple[int, ...]) -> _RequestGrammar:
    return _RequestGrammar(AnyGrammar(), Backend(), gate=GATE, ended=False, masked_while_reasoning=masked)


def _row_without(*tokens: int) -> torch.Tensor:
    row = np.full(WORDS, -1, dtype=np.int32)
    for token in tokens:
        row.view(np.uint32)[token >> 5] &= ~np.uint32(1 << (token & 31))
    return torch.from_numpy(row)


def _tree() -> DraftTree:
    # node: 0 root, 1 OTHER, 2 END, 3 THIRD under 1, 4 END under 1
    tokens, parents, depths = [ROOT, OTHER, END, THIRD, END], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2]
    return DraftTree(token_ids=torch.tensor([tokens]), parents=torch.tensor([parents]), depths=torch.tensor([depths]),
                     ranks=torch.zeros(1, 5, dtype=torch.long), valid=torch.ones(1, 5, dtype=torch.bool),
                     num_nodes=torch.tensor([5]), max_depth=2)


def test_reasoning_rows_mask_the_rejected_implicit_ends_and_their_subtrees_are_not_entered():
    masks = _node_bitmasks("r", _entry((END,)), [ROOT], SimpleNamespace(tree=_tree()), 0, 5)
    full = torch.full((WORDS,), -1, dtype=torch.int32)
    for node in (0, 1, 3):  # still reasoning: every token but END
        assert torch.equal(masks[node], _row_without(END)), node
    for node in (2, 4):  # END under a reasoning node: never accepted, left unmasked
        assert torch.equal(masks[node], full), node


def test_without_masked_ends_reasoning_rows_allow_every_token_as_on_vllm_0_32():
    masks = _node_bitmasks("r", _entry(()), [ROOT], SimpleNamespace(tree=_tree()), 0, 5)
    assert torch.equal(masks, torch.full((5, WORDS), -1, dtype=torch.int32))


@pytest.mark.parametrize("masked", [(END,), ()])
def test_filtered_trees_leave_out_masked_ends_and_keep_the_walks_masks(masked):
    candidates = [OTHER, END, THIRD]
    gen = torch.Generator().manual_seed(0)
    top_logprobs = torch.randn(3, len(candidates), generator=gen).log_softmax(-1).sort(-1, descending=True).values
    top_token_ids = torch.stack([torch.tensor(candidates)[torch.randperm(len(candidates), generator=gen)] for _ in range(3)])
    entry = _entry(masked)
    tree, bitmask = _filtered_tree("r", entry, [ROOT], False, {0}, ROOT, top_logprobs, top_token_ids, 6)
    count = int(tree.num_nodes[0])
    assert (END in tree.token_ids[0, 1:count].tolist()) == (not masked)
    assert torch.equal(bitmask, _node_bitmasks("r", entry, [ROOT], SimpleNamespace(tree=tree), 0, count))


def test_the_gate_asks_vllms_own_masking_where_the_release_has_it(monkeypatch):
    """On 0.32 (`available` false) no tokens; where the release has `_masked_reasoning_ends`, the gate
    hands vLLM's function its request view, holding the request's grammar, and returns its answer."""
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_ddtree.vllm import node_reasoning
    from vllm_ddtree.vllm.patching import installed_vllm_version
    from vllm_ddtree.vllm.surface import MASKED_REASONING_ENDS, available

    gate = object.__new__(node_reasoning.ReasoningGate)
    gate._manager = SimpleNamespace()
    gate._request = SimpleNamespace(grammar=None)
    gate._prompt = [1, 2]
    grammar = AnyGrammar()
    if installed_vllm_version() == "0.32.0":
        assert not available(MASKED_REASONING_ENDS) and gate.masked_reasoning_ends(grammar) == ()
    seen = []
    monkeypatch.setattr(node_reasoning, "available", lambda member: member is MASKED_REASONING_ENDS)
    monkeypatch.setattr(StructuredOutputManager, "_masked_reasoning_ends",
                        lambda manager, request: seen.append(request) or (END,), raising=False)
    assert gate.masked_reasoning_ends(grammar) == (END,)
    (request,) = seen
    assert request.structured_output_request.grammar is grammar and request.prompt_token_ids == [1, 2]
