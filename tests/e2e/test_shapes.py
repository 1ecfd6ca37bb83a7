"""Greedy method 'ddtree' equals plain decoding on other architectures than the standard pairs':
head sizes 32 / 128 / 256, GQA 4:1, MHA and MQA, draft blocks of 4 and 16, a 2-layer draft reading
three target layers, tied embeddings, bf16, and a Llama target (DFlash drafts are target-agnostic).

Each case builds a focused pair (deep, off-chain acceptance) unless its embeddings are tied (the
focused construction shapes the LM head separately from the embedding), then compares greedy tokens of
plain decoding and DDTree at budget block_size - 1 and 24 on the standard prompts.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import prompts, run_engine
from tests.e2e.pairs import PairShape, build_pair

MAX_TOKENS = 24

CASES = {
    "head128-gqa4": (PairShape(hidden=256, heads=8, kv_heads=2, head_dim=128), {}),
    "mha": (PairShape(heads=4, kv_heads=4), {}),
    "mqa-head256": (PairShape(heads=2, kv_heads=1, head_dim=256), {}),
    "block4": (PairShape(block_size=4), {}),
    "block16": (PairShape(block_size=16), {}),
    "draft2-three-layers": (PairShape(draft_layers=2, target_layers=6, target_layer_ids=(0, 2, 5)), {}),
    "head32-tied": (PairShape(head_dim=32, tie_word_embeddings=True), {}),
    "bf16": (PairShape(), {"dtype": "bfloat16"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_plain_on_other_shapes(tmp_path, case):
    from vllm import SamplingParams

    shape, llm_kwargs = CASES[case]
    target, draft = build_pair(str(tmp_path), focused=not shape.tie_word_embeddings, shape=shape)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = run_engine(target, None, prompts(), params, **llm_kwargs)
    for budget in (shape.block_size - 1, 24):
        spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": budget, "ddtree_adaptive": False}
        tree = run_engine(target, spec, prompts(), params, **llm_kwargs)
        assert tree.token_ids == plain.token_ids, f"budget {budget}"


def test_greedy_equals_plain_on_a_llama_target(tmp_path):
    """The standard focused pair's target re-saved as LlamaForCausalLM (same weights, no q/k norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM
    from vllm import SamplingParams

    target, draft = build_pair(str(tmp_path), focused=True)
    qwen = Qwen3ForCausalLM.from_pretrained(target)
    qc = qwen.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=qc.vocab_size, hidden_size=qc.hidden_size, intermediate_size=qc.intermediate_size,
        num_hidden_layers=qc.num_hidden_layers, num_attention_heads=qc.num_attention_heads,
        num_key_value_heads=qc.num_key_value_heads, head_dim=qc.head_dim, tie_word_embeddings=False,
    ))
    no_qk_norm = {k: v for k, v in qwen.state_dict().items() if ".q_norm." not in k and ".k_norm." not in k}
    llama.load_state_dict(no_qk_norm, strict=True)
    llama.config.architectures = ["LlamaForCausalLM"]
    llama_dir = str(tmp_path / "llama")
    llama.save_pretrained(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = run_engine(llama_dir, None, prompts(), params)
    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": 24, "ddtree_adaptive": False}
    tree = run_engine(llama_dir, spec, prompts(), params)
    assert tree.token_ids == plain.token_ids
    assert tree.tokens_per_step > 1.5
