"""Structured outputs under method 'ddtree': every tree node masked by the grammar state after its path.

Offline, on the embedded trained pair (structured outputs need its tokenizer) with held-out code as
text prompts, budget 16, once per backend method 'ddtree' serves (xgrammar, vLLM's default, and
guidance). Per backend, one plain engine and one ddtree engine (the plain one first: `engine_runs`
rule) serve the same script: one `generate` call per grammar kind (JSON schema, JSON object, regex,
choice, EBNF grammar), greedy, then one mixed batch (every kind, an unconstrained request, a regex
request with logprobs, a penalised request with logprobs, a penalised JSON-schema request with logprobs,
and seeded sampled requests of every kind).
Checked: greedy tokens equal plain decoding's under the same grammar, every output is valid, the
logprobs of a grammar-masked request and of a penalised one equal plain decoding's, and trees still
accept more than one token per step where the draft is informative (each kind's tokens per step are
printed; `-s`).

The runner's per-node masks are also checked without an engine: every node's bitmask equals the
bitmask of a fresh grammar fed the node's path (`test_node_bitmasks_equal_the_grammar_after_each_path`).
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from tests.e2e.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN, model_runner

BUDGET = 16
MAX_TOKENS = 128
NUM_PROMPTS = 4
BACKENDS = ["xgrammar", "guidance"]  # the backends method 'ddtree' serves (`support.SERVED_BACKENDS`)
PENALTIES = {"presence_penalty": 0.8, "repetition_penalty": 1.3, "ignore_eos": True}
VOCAB = 4097  # the trained pair's
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "size": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}
REGEX = r"(    (self\.)?[a-z_]{1,12} = [a-z_.]{1,16}\([a-z_, ]{0,16}\)\n){1,3}"
CHOICES = ["return self", "return None", "raise NotImplementedError", "pass"]
EBNF = 'root ::= "def " name "(self" arg? arg? "):"\nname ::= [a-z_]{1,12}\narg ::= ", " name'
EBNF_EQUIVALENT = r"def [a-z_]{1,12}\(self(, [a-z_]{1,12}){0,2}\):"


def _kinds() -> dict:
    from vllm.sampling_params import StructuredOutputsParams

    return {
        "json schema": StructuredOutputsParams(json=SCHEMA),
        "json object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=EBNF),
    }


def _meets(kind: str, text: str) -> bool:
    """Whether a finished output's text is what its grammar kind promises."""
    if kind == "json schema":
        value = json.loads(text)
        return (set(value) == {"name", "size", "tags"} and isinstance(value["name"], str) and type(value["size"]) is int
                and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and all(isinstance(t, str) for t in value["tags"]))
    if kind == "json object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(EBNF_EQUIVALENT, text) is not None


@pytest.fixture(scope="module")
def valid(pair_dirs, served):
    return grammar_checker(pair_dirs["trained"][0], disable_any_whitespace=True, backend=served["backend"])


def grammar_checker(target: str, disable_any_whitespace: bool, backend: str = "xgrammar"):
    """check(kind, (text, token_ids, finish_reason)): a fresh grammar of the kind, compiled by vLLM's
    `backend` class with an engine's settings, accepts every token; an output that stopped also ended
    the grammar and meets `_meets`; one cut by max_tokens is a grammar prefix."""
    from transformers import AutoTokenizer
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.request import get_structured_output_key
    from vllm.v1.structured_output.utils import choice_as_grammar

    from vllm_ddtree.vllm.node_grammar import BACKENDS

    tokenizer = AutoTokenizer.from_pretrained(target)
    compiler = BACKENDS[backend](_fake_vllm_config(0, disable_any_whitespace), tokenizer=tokenizer, vocab_size=VOCAB)
    kinds = _kinds()
    if backend == "xgrammar":  # as vLLM's admission rewrites a choice for xgrammar
        kinds["choice"] = StructuredOutputsParams(grammar=choice_as_grammar(CHOICES))

    def check(kind: str, output: tuple) -> bool:
        text, token_ids, reason = output
        grammar = compiler.compile_grammar(*get_structured_output_key(kinds[kind]), stop_token_ids={tokenizer.eos_token_id})
        if not grammar.accept_tokens("check", token_ids):
            return False
        return reason == "length" or (reason == "stop" and grammar.is_terminated() and _meets(kind, text))

    return check


def _greedy(structured, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=structured, **kw)


def _spec_counters(llm) -> dict[str, int]:
    return {m.name: m.value for m in llm.get_metrics() if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}


def _serve(llm, texts: list[str]) -> dict:
    from vllm import SamplingParams

    result: dict = {"kinds": {}}
    for kind, structured in _kinds().items():
        before = _spec_counters(llm)
        outs = llm.generate(texts, _greedy(structured), use_tqdm=False)
        after = _spec_counters(llm)
        delta = {name: after[name] - before.get(name, 0) for name in after}
        result["kinds"][kind] = {
            "outputs": [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs],
            "tokens_per_step": (1 + delta["vllm:spec_decode_num_accepted_tokens"] / delta["vllm:spec_decode_num_drafts"]
                                if delta.get("vllm:spec_decode_num_drafts") else None),  # None: no verify step (plain decoding)
        }
    kinds = _kinds()
    mixed_params = [_greedy(structured) for structured in kinds.values()]
    mixed_params += [_greedy(None, ignore_eos=True), _greedy(kinds["regex"], logprobs=3), _greedy(None, logprobs=3, **PENALTIES),
                     _greedy(kinds["json schema"], logprobs=3, repetition_penalty=1.3, presence_penalty=0.5)]
    mixed_params += [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=MAX_TOKENS, structured_outputs=s) for i, s in enumerate(kinds.values())]
    mixed_texts = [texts[i % len(texts)] for i in range(len(mixed_params))]
    outs = llm.generate(mixed_texts, mixed_params, use_tqdm=False)
    result["mixed"] = [(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
    result["logprobs"] = {
        name: [{token: lp.logprob for token, lp in position.items()} for position in outs[len(kinds) + offset].outputs[0].logprobs]
        for name, offset in (("regex", 1), ("penalties", 2), ("json schema + penalties", 3))
    }
    return result


@pytest.fixture(scope="module", params=BACKENDS)
def served(pair_dirs, request):
    from vllm import LLM

    from vllm_ddtree.demo import heldout_prompts

    target, draft = pair_dirs["trained"]
    texts = heldout_prompts(NUM_PROMPTS, 48, as_text=True)
    results = {}
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET, "ddtree_adaptive": False}
    for name, config in (("plain", None), ("ddtree", spec)):
        llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
                  max_num_seqs=16, seed=0, speculative_config=config, disable_log_stats=False,
                  structured_outputs_config={"backend": request.param, "disable_any_whitespace": True})
        try:
            results[name] = _serve(llm, texts)
            runner = model_runner(llm)
            assert getattr(runner, "num_chain_fallbacks", 0) == 0, "the scheduler's drafts were not the proposed trees"
        finally:
            llm.llm_engine.engine_core.shutdown()
    return {**results, "backend": request.param}


@pytest.mark.parametrize("kind", ["json schema", "json object", "regex", "choice", "grammar"])
def test_greedy_under_a_grammar_equals_plain_decoding_and_is_valid(served, valid, kind):
    ours, plain = served["ddtree"]["kinds"][kind]["outputs"], served["plain"]["kinds"][kind]["outputs"]
    assert ours == plain
    assert all(valid(kind, output) for output in ours), ours
    assert any(reason == "stop" for _, _, reason in ours)


def test_mixed_batch_equals_plain_decoding_and_samples_are_valid(served, valid):
    kinds = list(_kinds())
    ours, plain = served["ddtree"]["mixed"], served["plain"]["mixed"]
    greedy = len(kinds) + 4
    assert ours[:greedy] == plain[:greedy]
    for kind, output in zip(kinds, ours[greedy:]):
        assert valid(kind, output), (kind, output)
    assert ours[len(kinds)][0] != ours[0][0]  # the unconstrained request is not held by a neighbour's grammar


@pytest.mark.parametrize("request_kind", ["regex", "penalties", "json schema + penalties"])
def test_logprobs_equal_plain_decoding(served, request_kind):
    """Raw logprobs (the default mode) of a grammar-masked request (masked logits, as plain decoding
    reports them), of a penalised one (its tokens follow the penalties) and of one with both (the
    grammar's mask first, then the penalties, at every node)."""
    ours, plain = served["ddtree"]["logprobs"][request_kind], served["plain"]["logprobs"][request_kind]
    assert len(ours) == len(plain) > 0
    for mine, theirs in zip(ours, plain):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t] - theirs[t]) < 1e-4 or mine[t] == theirs[t] for t in mine)


def test_trees_still_accept_under_grammars(served):
    """Tokens per verify step (vLLM's metric; None: no step verified drafts, i.e. the grammar admitted
    none of the draft's candidates at any step, so every tree was its root alone)."""
    per_kind = {kind: run["tokens_per_step"] and round(run["tokens_per_step"], 2) for kind, run in served["ddtree"]["kinds"].items()}
    print(f"tokens per step under each grammar kind ({served['backend']}):", per_kind)
    assert per_kind["regex"] > 1.5 and per_kind["grammar"] > 1.5 and per_kind["json schema"] > 1.5


def _fake_vllm_config(budget: int, disable_any_whitespace: bool = False):
    """What vLLM's xgrammar and guidance backends read of a VllmConfig."""
    return SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=disable_any_whitespace, disable_additional_properties=False),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3")),
        speculative_config=SimpleNamespace(num_speculative_tokens=budget),
    )


def test_node_bitmasks_equal_the_grammar_after_each_path(pair_dirs):
    """A tree whose nodes mix allowed and forbidden tokens (a forbidden node's subtree is never masked),
    against a fresh grammar fed each allowed node's path; the walk leaves the grammar where it began."""
    import torch
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    from vllm.v1.structured_output.request import get_structured_output_key

    from vllm_ddtree.core import DraftTree
    from vllm_ddtree.vllm.node_grammar import _node_bitmasks, _RequestGrammar

    target, _ = pair_dirs["trained"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    backend = XgrammarBackend(_fake_vllm_config(8), tokenizer=tokenizer, vocab_size=VOCAB)
    key = get_structured_output_key(_kinds()["regex"])

    def grammar():
        return backend.compile_grammar(*key, stop_token_ids={0})

    encode = lambda text: tokenizer.encode(text)  # noqa: E731
    committed = encode("    ")
    first, other, bad = encode("self")[0], encode("x")[0], encode("(")[0]
    # node: 0 root, 1 'self', 2 'x', 3 '(' (forbidden after the indent), 4 '.' under 1, 5 'y' under 2, 6 'z' under 3
    tokens = [committed[-1], first, other, bad, encode(".")[0], encode("y")[0], encode("z")[0]]
    parents = [-1, 0, 0, 0, 1, 2, 3]
    depths = [0, 1, 1, 1, 2, 2, 2]
    tree = DraftTree(token_ids=torch.tensor([tokens]), parents=torch.tensor([parents]), depths=torch.tensor([depths]),
                     ranks=torch.zeros(1, 7, dtype=torch.long), valid=torch.ones(1, 7, dtype=torch.bool),
                     num_nodes=torch.tensor([7]), max_depth=2)
    entry = _RequestGrammar(grammar(), backend)
    assert entry.grammar.accept_tokens("r", committed)
    masks = _node_bitmasks("r", entry, committed, SimpleNamespace(tree=tree), 0, 7)
    full = torch.full_like(masks[0], -1)
    for node in range(7):
        path, at = [], node
        while at > 0:
            path.insert(0, tokens[at])
            at = parents[at]
        fresh = grammar()
        if not fresh.accept_tokens("r", committed + path):
            assert torch.equal(masks[node], full), node  # never reached by the acceptance walk: left unmasked
            continue
        expected = backend.allocate_token_bitmask(1)
        fresh.fill_bitmask(expected, 0)
        assert torch.equal(masks[node], expected[0]), node
    assert torch.equal(masks[3], full) and torch.equal(masks[6], full)
    again = backend.allocate_token_bitmask(1)
    entry.grammar.fill_bitmask(again, 0)
    assert torch.equal(again[0], masks[0])


def test_refusals_name_the_option_and_the_alternative():
    from vllm.sampling_params import SamplingParams

    from vllm_ddtree.vllm.support import UnsupportedRequestError, check_request

    params = SamplingParams(structured_outputs=_kinds()["regex"])
    params.structured_outputs._backend = "outlines"
    with pytest.raises(UnsupportedRequestError, match="structured outputs with the 'outlines' backend.*use method 'dflash'"):
        check_request(params)
    params.structured_outputs._backend = "xgrammar"
    check_request(params)  # under a reasoning parser too: tests/e2e/test_reasoning_structured.py


def test_preempted_structured_requests_equal_plain_decoding(pair_dirs):
    """A KV cache too small for the batch: vLLM preempts and recomputes requests mid-generation; the
    runner's grammars keep following each request's committed output across it."""
    from vllm.sampling_params import StructuredOutputsParams

    from tests.e2e.conftest import run_engine
    from vllm_ddtree.demo import heldout_prompts

    target, draft = pair_dirs["trained"]
    requests = heldout_prompts(7, 32, as_text=True)
    params = _greedy(StructuredOutputsParams(regex=r"([a-z_ .=()]{1,40}\n){2,40}"), ignore_eos=True)
    params.max_tokens = 200
    small = {"kv_cache_memory_bytes": 3_000_000, "max_model_len": 256, "skip_tokenizer_init": False, "max_num_batched_tokens": 512}
    plain = run_engine(target, None, requests, params, **small)
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 7, "ddtree_adaptive": False}
    ddtree = run_engine(target, spec, requests, params, **small)
    assert ddtree.metrics["vllm:num_preemptions"] > 0
    assert ddtree.token_ids == plain.token_ids
    assert ddtree.tokens_per_step > 1.5


def test_filtered_tree_admits_only_grammar_paths_and_its_masks_are_the_walks(pair_dirs):
    """`_filtered_tree` over a draft top-k mixing allowed, forbidden and stop tokens: every node's path
    is grammar-valid, nothing follows a stop token, and the bitmasks it keeps for the verify step equal
    the depth-first walk's (`_node_bitmasks`) on the same tree."""
    import torch
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
    from vllm.v1.structured_output.request import get_structured_output_key

    from vllm_ddtree.vllm.node_grammar import _filtered_tree, _node_bitmasks, _RequestGrammar

    target, _ = pair_dirs["trained"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    backend = XgrammarBackend(_fake_vllm_config(8), tokenizer=tokenizer, vocab_size=VOCAB)
    key = get_structured_output_key(_kinds()["grammar"])
    eos = tokenizer.eos_token_id
    entry = _RequestGrammar(backend.compile_grammar(*key, stop_token_ids={eos}), backend)
    committed = tokenizer.encode("def f(self")
    assert entry.grammar.accept_tokens("r", committed)
    candidates = [tokenizer.encode(text)[0] for text in ("):", ")", ",", " x", "(", "y", "z")] + [eos]
    gen = torch.Generator().manual_seed(0)
    top_logprobs = torch.randn(5, len(candidates), generator=gen).log_softmax(-1).sort(-1, descending=True).values
    top_token_ids = torch.stack([torch.tensor(candidates)[torch.randperm(len(candidates), generator=gen)] for _ in range(5)])
    tree, bitmask = _filtered_tree("r", entry, committed, True, {eos}, committed[-1], top_logprobs, top_token_ids, 12)
    count = int(tree.num_nodes[0])
    tokens, parents = tree.token_ids[0].tolist(), tree.parents[0].tolist()
    paths: list[list[int]] = [[]]
    for node in range(1, count):
        paths.append(paths[parents[node]] + [tokens[node]])
        assert eos not in paths[node][:-1]
        fresh = backend.compile_grammar(*key, stop_token_ids={eos})
        assert fresh.accept_tokens("r", committed + paths[node]), paths[node]
    assert 2 < count <= 13 and any(path and path[-1] == eos for path in paths)
    assert torch.equal(bitmask, _node_bitmasks("r", entry, committed, SimpleNamespace(tree=tree), 0, count))


def test_default_adaptive_budget_under_grammars_equals_plain_decoding(pair_dirs):
    """The default configuration (adaptive budget, B = 32: the policy picks each step's shape, from no
    speculation through chains to trees, and grammar-filtered trees are built at whatever shape it
    picks) under every grammar kind in one batch."""
    from tests.e2e.conftest import run_engine
    from vllm_ddtree.demo import heldout_prompts

    target, draft = pair_dirs["trained"]
    texts = heldout_prompts(NUM_PROMPTS, 48, as_text=True)
    kinds = _kinds()
    requests = [texts[i % NUM_PROMPTS] for i in range(len(kinds))]
    params = [_greedy(structured) for structured in kinds.values()]
    options = {"skip_tokenizer_init": False, "max_num_batched_tokens": 2048}
    plain = run_engine(target, None, requests, params, **options)
    ours = run_engine(target, {"method": "ddtree", "model": draft, "num_speculative_tokens": 32}, requests, params, **options)
    assert ours.token_ids == plain.token_ids


def test_an_untested_backend_is_refused_at_admission(pair_dirs):
    """An engine configured for the outlines backend: its structured requests are refused when admitted
    (a validation error naming the backend and the alternative), its other requests served."""
    from vllm import LLM

    from vllm_ddtree.vllm.support import UnsupportedRequestError

    target, draft = pair_dirs["trained"]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, seed=0,
              structured_outputs_config={"backend": "outlines"},
              speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": 8})
    try:
        with pytest.raises(UnsupportedRequestError, match="structured outputs with the 'outlines' backend.*use method 'dflash' or plain decoding"):
            llm.generate(["def f("], _greedy(_kinds()["regex"]), use_tqdm=False)
        assert llm.generate(["def f("], _greedy(None), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.engine_core.shutdown()
