"""The widened pair computes the tiny pair's function: target logits and greedy tokens through
transformers' Qwen3, the draft's outputs through the training code's DFlash model, in float32."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vllm_ddtree.demo import PAIR_DIR, heldout_prompts
from vllm_ddtree.demo.widen_pair import Shape, layer_positions, qk_gain, rms_norm_rescale, widen_pair

# +64 hidden, +2 q / +1 kv heads (ratio 2 kept), +128 MLP units, +2 target layers, +1 draft layer
SMALL = Shape(hidden=320, heads=6, kv_heads=3, intermediate=896, target_layers=6, draft_layers=3)


@pytest.fixture(scope="module")
def widened(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("widened"))
    widen_pair(PAIR_DIR, out, SMALL)
    return out


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_rms_norm_rescale_keeps_normalised_values():
    gen = torch.Generator().manual_seed(0)
    w, eps = torch.rand(256, generator=gen, dtype=torch.float64) + 0.5, 1e-6
    # mean square ~ eps, where a wrong eps' would show: scales 1e-3 (eps matters) and 1 (it does not)
    for scale in (1e-3, 1.0):
        x = torch.randn(8, 256, generator=gen, dtype=torch.float64) * scale
        w2, eps2 = rms_norm_rescale(w, eps, 320)
        x2 = torch.cat([x, torch.zeros(8, 64, dtype=torch.float64)], -1)
        y2 = _norm(x2, w2, eps2)
        torch.testing.assert_close(y2[:, :256], _norm(x, w, eps), rtol=1e-12, atol=0)
        assert torch.all(y2[:, 256:] == 0)
        # the per-head q/k norm (head_dim unchanged) sees eps' too; q_proj/k_proj scaled by qk_gain undo it
        q = x[:, :64]
        torch.testing.assert_close(_norm(q * qk_gain(256, 320), w[:64], eps2), _norm(q, w[:64], eps), rtol=1e-12, atol=0)


def test_unrescaled_eps_would_change_small_vectors():
    """The check above has power: keeping eps (weight rescaled alone) is off where mean(x^2) ~ eps."""
    w, eps = torch.ones(256, dtype=torch.float64), 1e-6
    x = torch.full((1, 256), 1e-3, dtype=torch.float64)
    x2 = torch.cat([x, torch.zeros(1, 64, dtype=torch.float64)], -1)
    wrong = _norm(x2, rms_norm_rescale(w, eps, 320)[0], eps)[:, :256]
    assert (wrong - _norm(x, w, eps)).abs().max() > 1e-2


def test_layer_positions_interleave():
    assert layer_positions(4, 28) == [0, 7, 14, 21]
    assert layer_positions(2, 2) == [0, 1]


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_widened_config(widened):
    with open(os.path.join(widened, "target", "config.json")) as f:
        target = json.load(f)
    with open(os.path.join(widened, "draft", "config.json")) as f:
        draft = json.load(f)
    assert (target["hidden_size"], target["num_hidden_layers"], target["head_dim"]) == (320, 6, 64)
    assert target["rms_norm_eps"] == pytest.approx(1e-6 * 256 / 320)
    assert draft["dflash_config"]["target_layer_ids"] == [layer_positions(4, 6)[i] for i in (1, 2)]
    assert draft["num_target_layers"] == 6 and draft["num_hidden_layers"] == 3
    assert os.path.exists(os.path.join(widened, "target", "tokenizer.json"))
    assert widen_pair(PAIR_DIR, widened, SMALL)["skipped"]  # up to date: nothing rewritten


@pytest.fixture(scope="module")
def target_pair(widened):
    with torch.no_grad():
        return _load(os.path.join(PAIR_DIR, "target")), _load(os.path.join(widened, "target"))


PROMPTS = heldout_prompts(3, 48)


def test_widened_target_logits_and_greedy_equal_tiny(target_pair):
    tiny, wide = target_pair
    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        a, b = tiny(ids, output_hidden_states=True), wide(ids, output_hidden_states=True)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(b.logits.argmax(-1), a.logits.argmax(-1))
        # the residual stream after original layer i is the widened one's after its new index, zero-padded
        # (HF's last hidden state is after the final norm: the last layer is left out)
        for i, j in enumerate(layer_positions(4, 6)[:-1]):
            torch.testing.assert_close(b.hidden_states[j + 1][..., :256], a.hidden_states[i + 1], rtol=1e-4, atol=1e-4)
            assert torch.all(b.hidden_states[j + 1][..., 256:] == 0)
        kw = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(wide.generate(ids, **kw), tiny.generate(ids, **kw))


def test_widened_draft_outputs_equal_tiny(widened, target_pair):
    from vllm_ddtree.demo.pair_model import draft_logits
    from vllm_ddtree.demo.reference import load_draft

    ids = torch.tensor(PROMPTS)
    anchors = torch.tensor([5, 17, 30, 40])
    logits = []
    with torch.no_grad():
        for model, draft_dir in zip(target_pair, (os.path.join(PAIR_DIR, "draft"), os.path.join(widened, "draft"))):
            draft, _, cfg = load_draft(draft_dir)  # every RMSNorm at the config's eps
            mask_id = cfg["dflash_config"]["mask_token_id"]
            hidden = model(ids, output_hidden_states=True).hidden_states
            feats = torch.cat([hidden[i + 1] for i in cfg["dflash_config"]["target_layer_ids"]], -1)
            embed, head = model.model.embed_tokens.weight, model.lm_head.weight
            logits.append(draft_logits(draft, embed, head, ids, feats, anchors, mask_id))
    tiny, wide = logits
    torch.testing.assert_close(wide, tiny, rtol=1e-4, atol=1e-4)
    assert torch.equal(wide.argmax(-1), tiny.argmax(-1))
