"""Structured outputs under a reasoning parser: the grammar starts where vLLM starts it.

With `reasoning_parser` set (and `enable_in_reasoning` off) vLLM leaves a structured request
unconstrained until its reasoning ends, then masks every later token with the grammar fed the tokens
after the end. Method 'ddtree' decides that per tree node with vLLM's own code on the node's path
(`node_reasoning`), so a tree may hold reasoning nodes, the end token and grammar-masked nodes below it.

The embedded trained pair has no thinking tokens, so the test brings a reasoning parser of its own
(`newline_reasoning`, a `reasoning_parser_plugin`): the reasoning is the rest of the prompt's last line
and ends at the first output token holding a newline (never in the prompt), which the code prompts cut
mid-line reach within a few tokens. A regex grammar then asks for one short code
line. Plain decoding and method 'ddtree' (budget 16, fixed trees) serve the same greedy requests and
seeded sampled ones under xgrammar, then greedy requests carrying vLLM's request-level reasoning inputs
(as the chat server sends them): `reasoning_ended` (the grammar applies from the first token) and
`reasoning_parser_kwargs` (the reasoning ends at the first token holding ":"), which reach the runner
through the scheduler patch. Checked: greedy tokens equal plain decoding's, every output of the first
batch is the reasoning (no newline) then the end token then a grammar match (stopped) or prefix, the
request-level inputs change the outputs, and trees still accept more than one token per step. The
same greedy requests under tensor parallelism 2 (multiprocess executor: each worker imports the plugin
and gets the inputs with the pickled scheduler output) equal plain decoding's too.

Without an engine: every node's mask across an end token and a grammar-filtered tree's masks against
fresh grammars, and an end token the parser calls content (vLLM's engine parsers' implicit ends) fed
to the grammar as its first token.
"""

from __future__ import annotations

import pytest
import regex

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.e2e.newline_reasoning import PARSER, PLUGIN

REGEX = r" *(return|self\.[a-z_]{1,12} =|[a-z_]{1,12} =) [a-z_.()]{1,24}\n"
NUM_PROMPTS = 8
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "reasoning_parser": PARSER, "reasoning_parser_plugin": PLUGIN}
MAX_TOKENS = 48


def _params(seed: int | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sampling = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex=REGEX), **sampling)


@pytest.fixture(scope="module")
def runs(pair_dirs):
    from vllm import LLM

    from vllm_ddtree.demo import heldout_prompts

    target, draft = pair_dirs["trained"]
    texts = heldout_prompts(NUM_PROMPTS, 40, as_text=True)
    params = [_params() for _ in texts] + [_params(seed=i) for i in range(len(texts))]
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False}
    results = {}
    for name, config in (("plain", None), ("ddtree", spec)):
        llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
                  max_num_seqs=32, seed=0, speculative_config=config, disable_log_stats=False,
                  structured_outputs_config=STRUCTURED_OUTPUTS_CONFIG)
        try:
            outs = llm.generate(texts + texts, params, use_tqdm=False)
            metrics = {m.name: m.value for m in llm.get_metrics()
                       if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
            results[name] = {"outputs": [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs],
                             "metrics": metrics, "inputs": _with_reasoning_inputs(llm, texts[: NUM_PROMPTS // 2])}
        finally:
            llm.llm_engine.engine_core.shutdown()
    return results


REASONING_INPUTS = {"reasoning_ended": (True, None), "parser kwargs": (None, {"ends": ":"})}


def _with_reasoning_inputs(llm, texts: list[str]) -> dict[str, list[list[int]]]:
    """Greedy outputs of `texts` sent with each of REASONING_INPUTS (reasoning_ended,
    reasoning_parser_kwargs) set on the engine request, as vLLM's chat server sets them."""
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    for name, (ended, kwargs) in REASONING_INPUTS.items():
        for k, text in enumerate(texts):
            request = engine.input_processor.process_inputs(f"{name}/{k}", {"prompt_token_ids": tokenizer.encode(text)}, _params(),
                                                            supported_tasks=engine.get_supported_tasks())
            request.reasoning_ended, request.reasoning_parser_kwargs = ended, kwargs
            engine.add_request(request.request_id, request, request.params)
    outputs = {name: [[] for _ in texts] for name in REASONING_INPUTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                name, k = out.request_id.split("/")  # vLLM may suffix the id: "<name>/<k>-<suffix>"
                outputs[name][int(k.split("-")[0])] = list(out.outputs[0].token_ids)
    return outputs


def test_greedy_equals_plain_decoding_under_a_reasoning_parser(runs):
    ours, plain = runs["ddtree"]["outputs"][:NUM_PROMPTS], runs["plain"]["outputs"][:NUM_PROMPTS]
    assert ours == plain


def test_request_level_reasoning_inputs_are_honoured(runs):
    """reasoning_ended and reasoning_parser_kwargs reach the runner: greedy equals plain decoding with
    each, and each changes the output (the grammar starts elsewhere)."""
    assert runs["ddtree"]["inputs"] == runs["plain"]["inputs"]
    default = [tokens for _, tokens, _ in runs["plain"]["outputs"][: NUM_PROMPTS // 2]]
    for name, outputs in runs["plain"]["inputs"].items():
        assert all(outputs) and outputs != default, name


def _reasoning_then_grammar(text: str, reason: str) -> bool:
    """The reasoning (no newline), the end token (newlines and maybe indentation), then the grammar."""
    end = regex.match(r"[^\n]*\n[\n ]*", text)
    if end is None:
        return reason == "length"  # still reasoning
    rest = text[end.end() :]
    return regex.fullmatch(REGEX, rest, partial=reason == "length") is not None  # cut by max_tokens: a prefix


@pytest.mark.parametrize("engine", ["plain", "ddtree"])
def test_outputs_reason_then_follow_the_grammar(runs, engine):
    outputs = runs[engine]["outputs"]
    assert not [o for o in outputs if not _reasoning_then_grammar(o[0], o[2])]
    assert sum(reason == "stop" for _, _, reason in outputs) >= NUM_PROMPTS // 2


def test_trees_accept_across_the_reasoning_end(runs):
    metrics = runs["ddtree"]["metrics"]
    tokens_per_step = 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_drafts"]
    print(f"tokens per verify step: {tokens_per_step:.2f}")
    assert tokens_per_step > 1.5


def _regex_grammars(pair_dirs):
    """(tokenizer, xgrammar backend, the REGEX structured-output params, a factory of fresh grammars for
    them) on the trained pair's tokenizer."""
    from transformers import AutoTokenizer
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    from vllm.v1.structured_output.request import get_structured_output_key

    from tests.e2e.test_structured_outputs import VOCAB, _fake_vllm_config

    target, _ = pair_dirs["trained"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    backend = XgrammarBackend(_fake_vllm_config(8), tokenizer=tokenizer, vocab_size=VOCAB)
    structured = StructuredOutputsParams(regex=REGEX)

    def grammar():
        return backend.compile_grammar(*get_structured_output_key(structured), stop_token_ids={0})

    return tokenizer, backend, structured, grammar


def _assert_node_masks(masks, num_nodes: int, fed: dict[int, list[int]], grammar, backend) -> None:
    """Node i of `fed` is masked by a fresh grammar fed fed[i]; every other node is left unmasked."""
    import torch

    full = torch.full_like(masks[0], -1)
    for node in range(num_nodes):
        if node not in fed:
            assert torch.equal(masks[node], full), node
            continue
        fresh = grammar()
        assert fresh.accept_tokens("r", fed[node])
        expected = backend.allocate_token_bitmask(1)
        fresh.fill_bitmask(expected, 0)
        assert torch.equal(masks[node], expected[0]), node


def test_node_bitmasks_start_at_the_reasoning_end(pair_dirs):
    """A tree mixing reasoning nodes, end tokens and nodes after them, against vLLM's rule: a node
    still reasoning is unmasked; a node at or below an end token is masked by a fresh grammar fed the
    path's tokens after the end; a node the grammar forbids is never entered (left unmasked)."""
    from types import SimpleNamespace

    import torch

    from vllm_ddtree.core import DraftTree
    from vllm_ddtree.vllm.node_grammar import _filtered_tree, _node_bitmasks, _RequestGrammar
    from vllm_ddtree.vllm.node_reasoning import ReasoningGates

    tokenizer, backend, structured, grammar = _regex_grammars(pair_dirs)

    config = SimpleNamespace(structured_outputs_config=SimpleNamespace(reasoning_parser=PARSER, reasoning_parser_plugin="", enable_in_reasoning=False))
    gate = ReasoningGates(config, tokenizer).gate(SimpleNamespace(structured_outputs=structured), [5, 6, 7], (None, None))
    assert gate is not None
    x, end, self_, paren, ret = 88, 199, 279, 8, 2079
    # node: 0 root, 1 x, 2 end, 3 end under 1, 4 self under 2, 5 '(' under 2 (forbidden), 6 return under 3, 7 x under 1
    tokens = [x, x, end, end, self_, paren, ret, x]
    parents = [-1, 0, 0, 1, 2, 2, 3, 1]
    depths = [0, 1, 1, 2, 2, 2, 3, 2]
    tree = DraftTree(token_ids=torch.tensor([tokens]), parents=torch.tensor([parents]), depths=torch.tensor([depths]),
                     ranks=torch.zeros(1, 8, dtype=torch.long), valid=torch.ones(1, 8, dtype=torch.bool),
                     num_nodes=torch.tensor([8]), max_depth=3)
    entry = _RequestGrammar(grammar(), backend, gate=gate, ended=False)
    masks = _node_bitmasks("r", entry, [x], SimpleNamespace(tree=tree), 0, 8)
    after_end = {2: [], 3: [], 4: [self_], 6: [ret]}  # node -> the path's tokens after the end token
    # unmasked: reasoning (0, 1, 7) or forbidden after the end (5)
    _assert_node_masks(masks, 8, after_end, grammar, backend)
    assert not any(torch.equal(masks[node], torch.full_like(masks[0], -1)) for node in after_end)
    assert entry.grammar.accept_tokens("r", [ret])  # the walk left the grammar where it began

    # A grammar-filtered tree from the same reasoning state: every candidate enters while reasoning,
    # only grammar paths after an end token, and its verify masks are the walk's.
    entry = _RequestGrammar(grammar(), backend, gate=gate, ended=False)
    candidates = [x, end, self_, paren, ret]
    gen = torch.Generator().manual_seed(0)
    top_logprobs = torch.randn(4, len(candidates), generator=gen).log_softmax(-1).sort(-1, descending=True).values
    top_token_ids = torch.stack([torch.tensor(candidates)[torch.randperm(len(candidates), generator=gen)] for _ in range(4)])
    filtered, bitmask = _filtered_tree("r", entry, [x], False, {0}, x, top_logprobs, top_token_ids, 12)
    count = int(filtered.num_nodes[0])
    assert count == 13
    walked = _node_bitmasks("r", entry, [x], SimpleNamespace(tree=filtered), 0, count)
    assert torch.equal(bitmask, walked)
    node_tokens, node_parents = filtered.token_ids[0].tolist(), filtered.parents[0].tolist()
    for node in range(1, count):
        path, at = [], node
        while at > 0:
            path.insert(0, node_tokens[at])
            at = node_parents[at]
        if end in path[:-1]:  # after the end token: a grammar path
            assert grammar().accept_tokens("r", path[path.index(end) + 1 :]), path


@pytest.fixture(scope="module")
def tensor_parallel(runs, pair_dirs):
    """The greedy requests and the request-level inputs on a TP=2 ddtree engine (after `runs`' engines)."""
    from vllm import LLM

    from vllm_ddtree.demo import heldout_prompts

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    target, draft = pair_dirs["trained"]
    texts = heldout_prompts(NUM_PROMPTS, 40, as_text=True)
    llm = LLM(model=target, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=2048, max_num_seqs=32, seed=0, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 16, "ddtree_adaptive": False},
              structured_outputs_config=STRUCTURED_OUTPUTS_CONFIG)
    try:
        outs = llm.generate(texts, [_params() for _ in texts], use_tqdm=False)
        return {"outputs": [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs],
                "inputs": _with_reasoning_inputs(llm, texts[: NUM_PROMPTS // 2])}
    finally:
        llm.llm_engine.engine_core.shutdown()
        mp.undo()


def test_tensor_parallel_equals_plain_decoding_under_a_reasoning_parser(runs, tensor_parallel):
    assert tensor_parallel["outputs"] == runs["plain"]["outputs"][:NUM_PROMPTS]
    assert tensor_parallel["inputs"] == runs["plain"]["inputs"]


def test_an_implicit_end_token_is_fed_to_the_grammar(pair_dirs):
    """A parser that calls its end token content (vLLM's engine parsers report such "implicit" ends, e.g.
    a tool-call start): the end token itself is the grammar's first token, so a node below it is
    masked by the grammar after it, and an end token the grammar rejects is never entered."""
    from types import SimpleNamespace

    import torch

    from vllm_ddtree.core import DraftTree
    from vllm_ddtree.vllm.node_grammar import _node_bitmasks, _RequestGrammar

    tokenizer, backend, structured, grammar = _regex_grammars(pair_dirs)

    x, paren, ret, space = 88, 8, 2079, 221
    implicit_ends = {ret, paren}  # content end tokens: 'return' starts the grammar, '(' is rejected by it
    gate = SimpleNamespace(grammar_start=lambda before, token: 0 if token in implicit_ends else None)
    # node: 0 root, 1 x, 2 return, 3 '(' , 4 ' ' under 2, 5 return under 1
    tokens, parents, depths = [x, x, ret, paren, space, ret], [-1, 0, 0, 0, 2, 1], [0, 1, 1, 1, 2, 2]
    tree = DraftTree(token_ids=torch.tensor([tokens]), parents=torch.tensor([parents]), depths=torch.tensor([depths]),
                     ranks=torch.zeros(1, 6, dtype=torch.long), valid=torch.ones(1, 6, dtype=torch.bool),
                     num_nodes=torch.tensor([6]), max_depth=2)
    masks = _node_bitmasks("r", _RequestGrammar(grammar(), backend, gate=gate, ended=False), [x], SimpleNamespace(tree=tree), 0, 6)
    consumed = {2: [ret], 4: [ret, space], 5: [ret]}
    # unmasked: reasoning (0, 1) or an end token the grammar rejects (3)
    _assert_node_masks(masks, 6, consumed, grammar, backend)
