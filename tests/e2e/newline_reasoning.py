"""A reasoning parser for the embedded trained pair (which has no thinking tokens), registered as
`newline_reasoning` when this file is imported, also as vLLM's `reasoning_parser_plugin` (`PLUGIN`:
worker processes import it there): the reasoning is the rest of the prompt's last line and ends at the
first output token holding a newline, or `ends` (a request's `reasoning_parser_kwargs`); the end token
is not content, and a prompt never ends the reasoning."""

from __future__ import annotations

import os

from vllm.reasoning import ReasoningParser, ReasoningParserManager

PARSER = "newline_reasoning"
PLUGIN = os.path.abspath(__file__)


@ReasoningParserManager.register_module(PARSER)
class NewlineReasoningParser(ReasoningParser):
    def __init__(self, tokenizer, *args, ends: str = "Ċ", **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.end_token_ids = {i for token, i in self.vocab.items() if ends in token}

    def is_reasoning_end(self, input_ids):
        return False

    def is_reasoning_end_streaming(self, input_ids, delta_ids):
        return any(token in self.end_token_ids for token in delta_ids)

    def extract_content_ids(self, input_ids):
        ends = [k for k, token in enumerate(input_ids) if token in self.end_token_ids]
        return input_ids[ends[0] + 1 :] if ends else []

    def extract_reasoning(self, model_output, request):
        return model_output, None

    def extract_reasoning_streaming(self, *args, **kwargs):
        return None
