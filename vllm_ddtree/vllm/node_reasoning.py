"""Where a structured request's grammar starts under a reasoning parser, decided as vLLM decides it.

With `structured_outputs_config.reasoning_parser` set (and `enable_in_reasoning` off), vLLM leaves a
structured request unconstrained while it reasons: `StructuredOutputManager._get_constraint_bounds`
says the grammar is constrained from the start (the prompt already ended the reasoning, the request
came with `reasoning_ended`, or no reasoner applies), or, for newly committed tokens, at which of them
the grammar starts (after the reasoning's end token, or at it when the parser reports an implicit end,
its end token being content). Plain decoding commits one token per step, so it asks that question
token by token; once a token ends the reasoning the request is latched (`reasoning_ended`) and every
later token is masked and fed to the grammar.

`ReasoningGate` asks vLLM's own `_get_constraint_bounds` (and `_get_reasoner`: the parser class of the
engine's config, built per request with the request's `reasoning_parser_kwargs`) the same questions
about a tree node's path: a token at depth d is judged with the prompt, the committed output and the
path up to it as the request's tokens, exactly the tokens plain decoding would hold when it committed
that token. The request-level inputs (`reasoning_ended`, `reasoning_parser_kwargs`) live on vLLM's
scheduler-side `Request` only; a declared patch (`patches._schedule`) hands them to the runner with
each new request (`REASONING_ATTR` on vLLM's `NewRequestData`), in every executor (the scheduler
output is pickled for worker processes, the attribute with it).

While a request reasons, vLLM 0.33 also masks, in plain decoding's rows, the implicit reasoning-end
tokens (an engine-based parser's content tokens that end the reasoning, e.g. a tool-call start) that the
grammar rejects as its first token, so that one sampled there cannot make the output invalid
(`StructuredOutputManager._masked_reasoning_ends`, a set fixed per request: the grammar does not advance
while reasoning). `ReasoningGate.masked_reasoning_ends` asks vLLM's own function for that set where the
installed release has it (`surface.MASKED_REASONING_ENDS`, a 0.33 and 0.34 entry) and answers none on 0.32,
which masks nothing while reasoning; `node_grammar` masks it in every reasoning node's row.

Invariant: a reasoner's verdict on a token depends only on the request's tokens up to it (vLLM's parsers
are stateless here: an end token among the new ids; `tests/e2e/test_reasoning_structured.py`), so
judging tree paths, rejected ones included, changes nothing for the committed output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.reasoning import ReasoningParserManager
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.request import StructuredOutputRequest

from vllm_ddtree.vllm.surface import MASKED_REASONING_ENDS, available

REASONING_ATTR = "ddtree_reasoning"
"""The attribute of vLLM's `NewRequestData` carrying (reasoning_ended, reasoning_parser_kwargs) of a
new structured request to a method 'ddtree' runner (set by `patches._schedule`)."""


@dataclass
class _RequestView:
    """What `_get_constraint_bounds` reads of vLLM's `Request`."""

    structured_output_request: StructuredOutputRequest
    prompt_token_ids: list[int]
    all_token_ids: list[int]


class ReasoningGate:
    """One structured request's reasoning, judged by vLLM's `StructuredOutputManager` code.

    constrained_from_start: the grammar applies from the first output token (no reasoning to wait for);
    otherwise `grammar_start(tokens, token)` tells, for `token` committed after `tokens` (prompt +
    output + path before it), whether it ends the reasoning and where the grammar starts."""

    def __init__(self, manager: Any, params: Any, prompt_token_ids: list[int], reasoning: tuple[bool | None, dict | None]) -> None:
        reasoning_ended, parser_kwargs = reasoning
        self._manager = manager
        self._request = StructuredOutputRequest(params.structured_outputs, reasoning_ended=reasoning_ended, reasoning_parser_kwargs=parser_kwargs)
        self._prompt = list(prompt_token_ids)
        start = StructuredOutputManager._get_constraint_bounds(manager, self._view(self._prompt), ())
        self.constrained_from_start = start.constraint_start == 0

    def _view(self, all_token_ids: list[int]) -> _RequestView:
        return _RequestView(self._request, self._prompt, all_token_ids)

    def masked_reasoning_ends(self, grammar: Any) -> tuple[int, ...]:
        """The tokens masked in the request's rows while it reasons, as the installed vLLM masks them in
        plain decoding: on 0.33 the implicit reasoning-end tokens `grammar` (the request's, at its start)
        rejects as first content; on 0.32 none."""
        if not available(MASKED_REASONING_ENDS):
            return ()
        self._request.grammar = grammar
        return tuple(StructuredOutputManager._masked_reasoning_ends(self._manager, self._view(self._prompt)))

    def grammar_start(self, output: list[int], token: int) -> int | None:
        """For `token` committed after the prompt and `output` (the committed output and the node's path
        before it) while reasoning: None if the reasoning goes on, else how many of [token] the grammar
        skips (1: the end token itself is not content; 0: an implicit end, the token is content)."""
        view = self._view(self._prompt + output + [token])
        bounds = StructuredOutputManager._get_constraint_bounds(self._manager, view, [token], spec_tokens_committed=True)
        return None if bounds.grammar_start > 1 else bounds.grammar_start


class ReasoningGates:
    """The engine's reasoning settings as vLLM's `StructuredOutputManager` reads them, and a
    `ReasoningGate` per structured request when a reasoning parser applies."""

    def __init__(self, vllm_config: Any, tokenizer: Any) -> None:
        config = vllm_config.structured_outputs_config
        parser = config.reasoning_parser
        if parser and config.reasoning_parser_plugin and len(config.reasoning_parser_plugin) > 3:
            ReasoningParserManager.import_reasoning_parser(config.reasoning_parser_plugin)  # as vLLM's manager does
        self._manager = _ManagerView(
            enable_in_reasoning=config.enable_in_reasoning,
            reasoner_cls=ReasoningParserManager.get_reasoning_parser(parser) if parser else None,
            tokenizer=tokenizer,
        )

    @property
    def active(self) -> bool:
        """Whether structured requests may reason before their grammar starts."""
        return self._manager.reasoner_cls is not None and not self._manager.enable_in_reasoning

    def gate(self, params: Any, prompt_token_ids: list[int], reasoning: tuple[bool | None, dict | None]) -> ReasoningGate | None:
        """The request's gate, None when its grammar applies from the first output token."""
        if not self.active:
            return None
        gate = ReasoningGate(self._manager, params, prompt_token_ids, reasoning)
        return None if gate.constrained_from_start else gate


@dataclass
class _ManagerView:
    """What `_get_constraint_bounds` and `_get_reasoner` read of vLLM's `StructuredOutputManager`."""

    enable_in_reasoning: bool
    reasoner_cls: Any
    tokenizer: Any

    def _get_reasoner(self, request: Any) -> Any:
        return StructuredOutputManager._get_reasoner(self, request)
