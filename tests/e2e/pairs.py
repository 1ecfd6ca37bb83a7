"""Tiny synthetic Qwen3 target + DFlash draft pairs (z-lab checkpoint format), built in seconds.

- random pair: random weights; the draft almost never agrees with the target, so it checks that
  verification is exact whatever the draft proposes.
- focused pair: every token's embedding has a component along a direction `u`, and the LM-head rows
  of four FOCUS tokens are 6u (+0.1u per FOCUS index) plus noise orthogonal to `u`: the target's greedy
  token is always a FOCUS token, which one set by the noise part of its hidden state, i.e. by the
  context (attention and MLP outputs are scaled down, not removed: greedy outputs change when
  attention is switched off). The mask token's embedding is 6u and the draft's layer outputs are tiny,
  so at every depth the draft ranks the FOCUS tokens in the fixed order of their `u` component with
  well-spread probabilities: its top-1 is often wrong, its top-4 always holds the target's token, so a
  tree commits more tokens per step than DFlash's chain, mostly through non-rank-0 children (the e2e
  tests that rely on acceptance assert a floor on tokens per step). Its generation_config.json names
  EOS_TOKEN_ID (a FOCUS token), so requests without ignore_eos stop on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

VOCAB = 512
BLOCK_SIZE = 8
MASK_TOKEN_ID = VOCAB - 1
FOCUS = (11, 23, 37, 45)
EOS_TOKEN_ID = 23
HIDDEN = 128


@dataclass(frozen=True)
class PairShape:
    """Architecture of a synthetic pair; the defaults are the standard pairs'. The draft shares the
    target's hidden size, heads and vocab (DFlash reuses the target's embedding and LM head)."""

    hidden: int = HIDDEN
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    target_layers: int = 4
    draft_layers: int = 1
    block_size: int = BLOCK_SIZE
    target_layer_ids: tuple[int, ...] = (1, 2)
    tie_word_embeddings: bool = False


def _qwen3_config(num_layers: int, shape: PairShape):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=1e-6,
    )


def focus_head(target, u: torch.Tensor, gen: torch.Generator) -> None:
    """The focused target's LM head: FOCUS rows 6u plus context-dependent noise (orthogonal to u), the
    other rows shrunk; the mask token's embedding 6u (in place, under no_grad)."""
    head = target.lm_head.weight
    head.mul_(0.1)
    noise = torch.randn(len(FOCUS), head.shape[1], generator=gen) * 0.4
    along_u = 6.0 + 0.1 * torch.arange(len(FOCUS), dtype=torch.float32)
    head[list(FOCUS)] = torch.outer(along_u, u) + noise - torch.outer(noise @ u, u)
    target.get_input_embeddings().weight[MASK_TOKEN_ID] = 6.0 * u


def save_target(target, out_dir: str, focused: bool) -> str:
    """Save the target under out_dir/target (a focused one stops at EOS_TOKEN_ID); returns the path."""
    target_dir = os.path.join(out_dir, "target")
    target.save_pretrained(target_dir, safe_serialization=True)
    if focused:
        with open(os.path.join(target_dir, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": EOS_TOKEN_ID}, f)
    return target_dir


def write_draft(out_dir: str, focused: bool, gen: torch.Generator, shape: PairShape) -> str:
    """Write draft/ under out_dir: a DFlash draft (z-lab format) of `shape` reading the target layers
    shape.target_layer_ids, its weights drawn from `gen`; returns its path."""
    from transformers import Qwen3ForCausalLM

    draft = Qwen3ForCausalLM(_qwen3_config(shape.draft_layers, shape))
    weights = {
        k[len("model."):]: (torch.randn(v.shape, generator=gen) * 0.3 if v.dim() > 1 else torch.ones_like(v))
        for k, v in draft.state_dict().items()
        if k.startswith("model.") and "embed_tokens" not in k
    }
    weights["fc.weight"] = torch.randn(shape.hidden, len(shape.target_layer_ids) * shape.hidden, generator=gen) * 0.05
    weights["hidden_norm.weight"] = torch.ones(shape.hidden)
    if focused:
        for i in range(shape.draft_layers):
            for name in (f"layers.{i}.self_attn.o_proj.weight", f"layers.{i}.mlp.down_proj.weight"):
                weights[name].mul_(0.002)
    draft_dir = os.path.join(out_dir, "draft")
    os.makedirs(draft_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(draft_dir, "model.safetensors"))
    config = _qwen3_config(shape.draft_layers, shape).to_dict()
    config.update(
        architectures=["DFlashDraftModel"],
        block_size=shape.block_size,
        num_target_layers=shape.target_layers,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": list(shape.target_layer_ids)},
    )
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return draft_dir


def build_pair(out_dir: str, focused: bool, seed: int = 0, shape: PairShape = PairShape()) -> tuple[str, str]:
    """Write target/ and draft/ under out_dir; returns their paths."""
    from transformers import Qwen3ForCausalLM

    hidden = shape.hidden
    gen = torch.Generator().manual_seed(seed)
    target = Qwen3ForCausalLM(_qwen3_config(shape.target_layers, shape))
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if focused:
            u = torch.randn(hidden, generator=gen)
            u /= u.norm()
            target.model.embed_tokens.weight.add_(4.0 * u)
            for layer in target.model.layers:  # keep context effects, but below the shared direction
                layer.self_attn.o_proj.weight.mul_(0.05)
                layer.mlp.down_proj.weight.mul_(0.05)
            for norm in [target.model.norm] + [m for l in target.model.layers for m in (l.input_layernorm, l.post_attention_layernorm)]:
                norm.weight.fill_(1.0)
            focus_head(target, u, gen)
    target_dir = save_target(target, out_dir, focused)

    return target_dir, write_draft(out_dir, focused, gen, shape)
