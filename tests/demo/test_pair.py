"""The shipped demo pair (vllm_ddtree/demo/pair/) is complete, small, loadable and well formed."""

from __future__ import annotations

import json
import os

import pytest

from vllm_ddtree.demo import PAIR_DIR, demo_pair_paths, heldout_prompts

MAX_PAIR_BYTES = 40 * 10**6
TARGET, DRAFT = demo_pair_paths()


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def test_pair_files_exist():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(TARGET, name)), name
    for name in ("config.json", "model.safetensors"):
        assert os.path.isfile(os.path.join(DRAFT, name)), name
    for name in ("README.md", "training_record.json", "corpus_files.json", "heldout_prompts.json"):
        assert os.path.isfile(os.path.join(PAIR_DIR, name)), name


def test_pair_is_at_most_40_mb():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(PAIR_DIR) for f in fs)
    assert total <= MAX_PAIR_BYTES, total


def test_draft_config_has_the_dflash_fields_vllm_reads():
    t, d = _json(os.path.join(TARGET, "config.json")), _json(os.path.join(DRAFT, "config.json"))
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["block_size"] == 8
    ids = d["dflash_config"]["target_layer_ids"]
    assert len(ids) >= 1 and all(0 <= i < t["num_hidden_layers"] for i in ids)
    assert d["dflash_config"]["mask_token_id"] < t["vocab_size"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
        assert d[key] == t[key], key
    assert d["rope_parameters"]["rope_theta"] == t["rope_parameters"]["rope_theta"]
    assert t["architectures"] == ["Qwen3ForCausalLM"] and t["tie_word_embeddings"] is False
    assert t["eos_token_id"] == 0


def test_draft_checkpoint_has_no_embedding_or_lm_head():
    from safetensors import safe_open

    with safe_open(os.path.join(DRAFT, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= keys
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)


def test_draft_k_norm_is_shared_by_all_layers():
    """vLLM 0.32 CPU applies layer 0's k_norm to every layer's context K; tied weights make it exact."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(os.path.join(DRAFT, "model.safetensors"))
    n = _json(os.path.join(DRAFT, "config.json"))["num_hidden_layers"]
    for i in range(1, n):
        assert torch.equal(sd[f"layers.{i}.self_attn.k_norm.weight"], sd["layers.0.self_attn.k_norm.weight"])


def test_tokenizer_round_trips_text_and_knows_eos_and_mask():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    text = 'def f(x):\n    """Doc: naïve café."""\n    return {x: [1, 2]}  # ok\n'
    assert tok.decode(tok(text)["input_ids"]) == text
    mask_id = _json(os.path.join(DRAFT, "config.json"))["dflash_config"]["mask_token_id"]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.convert_tokens_to_ids("<|mask|>") == mask_id
    assert len(tok) == _json(os.path.join(TARGET, "config.json"))["vocab_size"]


def test_heldout_prompts_are_deterministic_token_ids_and_text():
    a, b = heldout_prompts(4, 32), heldout_prompts(4, 32)
    assert a == b and len(a) == 4 and all(len(p) == 32 for p in a)
    texts = heldout_prompts(4, 32, as_text=True)
    assert all(isinstance(t, str) and t for t in texts)
    with pytest.raises(ValueError):
        heldout_prompts(4, 10**6)


def test_target_loads_in_transformers_and_gives_finite_logits():
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ids = torch.tensor(heldout_prompts(2, 48))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 48, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # a trained model predicts held-out code far better than uniform (log 4097 = 8.3 nats)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert loss.item() < 4.0
