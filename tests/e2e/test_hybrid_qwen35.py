"""Method 'ddtree' on Qwen3.5/3.6-shaped targets (Gated DeltaNet + full attention) in bf16: the text-only
class (vLLM runs it with 1-D positions) and the multimodal classes Qwen3.5/3.6 checkpoints ship as, dense
and MoE, run as language models only (M-RoPE positions); tiny focused pairs built here (`hybrid_pairs`).

The exactness bar in bf16: vLLM 0.32 runs GDN layers on CPU in bf16 only, where another batch layout
moves logits by about bf16's rounding, so two tokens that close can swap (plain decoding itself swaps them
when the batch beside a request changes; vLLM's DFlash chain too). Each prompt is compared with plain
decoding up to plain decoding's first near-tie (top-2 logprob margin below NEAR_TIE), or, where bf16 moves
logits by more (on the MoE pair vLLM's chain, too, departs from plain decoding at a clear margin), as far
as vLLM's DFlash chain agrees: ddtree's greedy output must agree that far. Beyond that: the tree commits
more tokens per verify step than the chain; the positions the target's forward receives put every tree
node at start + depth (in all three M-RoPE sections); image inputs are refused per request.

vLLM's Qwen3.5 model code is imported without torchvision here (`vllm/text_only_imports.py`).
Engines run one after another (reference runs first), each built and shut down before the next.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.conftest import CHUNK, KV_CACHE_BYTES, MAX_MODEL_LEN, MAX_TOKENS, Run, model_runner, prompts, run_engine
from tests.e2e.hybrid_pairs import build_qwen3_5_pair
from tests.e2e.test_hybrid_gdn import agreed_prefix

BUDGET = 32
CHAIN = 7  # the draft's block of 8 drafts at most 7 tokens
PROMPTS = prompts((3, 7, 12, 20, 45, 70, 100))  # the longest two are prefilled in chunks beside decoding trees
ENGINE = {"dtype": "bfloat16", "max_num_batched_tokens": CHUNK}
NEAR_TIE = 0.25
"""Plain decoding's top-2 logprob margins below this are near-ties: on these pairs another batch layout
moved a token's logprob by up to 0.1, a margin by up to 0.16 (the same tokens', tree run against plain
run)."""
VARIANTS = {"text": {}, "multimodal": {"multimodal": True}, "multimodal-moe": {"multimodal": True, "moe": True}}


def _greedy(logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def _record_forward_positions(runner, seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """Append, at every target forward of a step with branching trees: the positions the forward receives
    ([sections, rows]; 1-D positions as one section), start + depth of every node [R, N] (-1: padding) and
    every node's batch row [R, N]."""
    forward = runner._model_forward

    def recording_forward(*args, **kwargs):
        step = runner.step
        if step is not None and step.has_branching:
            positions = kwargs["positions"].numpy()
            expected = np.where(step.tree.valid.numpy(), step.starts.numpy()[:, None] + step.tree.depths.numpy(), -1)
            seen.append((np.atleast_2d(positions).copy(), expected, step.node_rows().numpy()))
        return forward(*args, **kwargs)

    runner._model_forward = recording_forward


def _record_draft_context_positions(drafter, seen: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Append, at every draft pass, (the target positions handed to the draft, first section [C]; the
    draft's context positions vLLM's DFlash input kernel laid out from them [C])."""
    set_inputs = drafter.set_inputs_first_pass

    def recording_set_inputs(*args, **kwargs):
        out = set_inputs(*args, **kwargs)
        count = kwargs["target_token_ids"].shape[0]
        target = np.atleast_2d(kwargs["target_positions"].numpy())[0, :count]
        seen.append((target.copy(), drafter._context_positions_buffer[:count].numpy().copy()))
        return out

    drafter.set_inputs_first_pass = recording_set_inputs


def _ddtree_engine(target: str, draft: str, **kwargs):
    from vllm import LLM

    return LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
               kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, seed=0,
               disable_log_stats=False, **ENGINE,
               speculative_config={"method": "ddtree", "model": draft, "ddtree_adaptive": False, **kwargs})


def _tree_run(target: str, draft: str, seen: list, seen_by_draft: list) -> Run:
    llm = _ddtree_engine(target, draft, num_speculative_tokens=BUDGET)
    runner = model_runner(llm)
    _record_forward_positions(runner, seen)
    _record_draft_context_positions(runner.drafter, seen_by_draft)
    try:
        outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
        assert runner.num_chain_fallbacks == 0, "scheduled drafts that were not the proposed trees"
        metrics = {m.name: getattr(m, "values", None) or getattr(m, "value", None) for m in llm.get_metrics()
                   if m.name.startswith("vllm:spec_decode")}
        return Run([list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].finish_reason for o in outputs], metrics)
    finally:
        llm.llm_engine.engine_core.shutdown()


def _plain_margins(target: str, plain_engine: dict) -> tuple[list[list[int]], list[list[float]]]:
    """Plain decoding's greedy tokens and, per token, the margin between its top-2 logprobs."""
    from vllm import LLM

    llm = LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, seed=0, **plain_engine)
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, _greedy(logprobs=2), use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    margins = [[float(np.subtract(*sorted((lp.logprob for lp in step.values()), reverse=True)[:2])) for step in o.logprobs]
               for o in outputs]
    return [list(o.token_ids) for o in outputs], margins


@pytest.fixture(scope="module", params=list(VARIANTS))
def runs(request, tmp_path_factory) -> dict[str, object]:
    """Greedy, bf16, on the variant's focused pair: plain decoding (with its top-2 margins), vLLM's DFlash
    chain and a fixed ddtree budget. vLLM's own runs need prefix caching off on CPU and, for the multimodal
    classes, language_model_only, both of which ddtree forces."""
    variant = VARIANTS[request.param]
    target, draft = build_qwen3_5_pair(str(tmp_path_factory.mktemp(f"qwen3_5_{request.param}")), focused=True, **variant)
    plain_engine = {"enable_prefix_caching": False, "language_model_only": bool(variant.get("multimodal")), **ENGINE}
    plain, margins = _plain_margins(target, plain_engine)
    seen: list = []
    seen_by_draft: list = []
    return {
        "plain": plain,
        "margins": margins,
        "chain": run_engine(target, {"method": "dflash", "model": draft, "num_speculative_tokens": CHAIN}, PROMPTS, _greedy(),
                            **plain_engine),
        "tree": _tree_run(target, draft, seen, seen_by_draft),
        "positions": seen,
        "draft positions": seen_by_draft,
        "sections": 3 if variant.get("multimodal") else 1,
    }


def before_first_near_tie(margins: list[list[float]]) -> list[int]:
    """Per prompt, how many leading tokens plain decoding chose by more than NEAR_TIE."""
    return [next((i for i, margin in enumerate(m) if margin < NEAR_TIE), len(m)) for m in margins]


def test_ddtree_agrees_with_plain_decoding_to_its_first_near_tie_or_as_far_as_the_chain(runs):
    """Per prompt: as far as plain decoding's first near-tie, or at least as far as vLLM's DFlash chain."""
    comparable = before_first_near_tie(runs["margins"])
    tree, chain = (agreed_prefix(runs[name].token_ids, runs["plain"]) for name in ("tree", "chain"))
    assert all(t >= min(c, ch) for t, c, ch in zip(tree, comparable, chain)), (tree, comparable, chain)
    assert sum(comparable) >= len(PROMPTS) * MAX_TOKENS // 4  # the bar spans a good part of the output


def test_tree_commits_more_tokens_per_step_than_the_chain(runs):
    assert runs["tree"].tokens_per_step > runs["chain"].tokens_per_step, (runs["tree"].tokens_per_step, runs["chain"].tokens_per_step)


def test_every_tree_node_reaches_the_forward_at_start_plus_depth_in_every_position_section(runs):
    seen = runs["positions"]
    assert len(seen) >= 5  # steps with branching trees were verified
    for sections, expected, rows in seen:
        assert sections.shape[0] == runs["sections"]  # M-RoPE: temporal, height and width positions
        valid = expected >= 0
        for section in sections:
            np.testing.assert_array_equal(section[rows[valid]], expected[valid])
    assert any((expected.max(axis=1) > expected[:, 0] + 1).any() for _, expected, _ in seen)  # depth, not only roots


def test_the_draft_lays_its_context_at_the_targets_first_position_section(runs):
    """vLLM's DFlash draft takes 1-D positions: from an M-RoPE target's [3, rows] positions its input kernel
    reads the first section, which our runner has put back to linear positions after the verify pass."""
    seen = runs["draft positions"]
    assert len(seen) >= 5
    for target, context in seen:
        np.testing.assert_array_equal(context, target)


def test_image_input_is_refused_per_request_and_the_engine_keeps_serving(tmp_path):
    """ddtree runs a multimodal Qwen3.5 class as a language model only: vLLM refuses an image request at
    admission, and the engine serves the next request."""
    from PIL import Image

    target, draft = build_qwen3_5_pair(str(tmp_path), focused=True, multimodal=True)
    llm = _ddtree_engine(target, draft, num_speculative_tokens=8)
    try:
        assert llm.llm_engine.vllm_config.model_config.multimodal_config.language_model_only
        image = {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": Image.new("RGB", (32, 32))}}
        with pytest.raises(ValueError, match="Multi-modal processor not available for text-only models"):
            llm.generate(image, _greedy(), use_tqdm=False)
        assert len(llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS
    finally:
        llm.llm_engine.engine_core.shutdown()
