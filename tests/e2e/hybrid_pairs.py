"""Tiny synthetic Gated DeltaNet hybrid targets and a DFlash draft for each: Qwen3-Next (`build_hybrid_pair`,
Gated DeltaNet + full attention + MoE) and Qwen3.5/3.6 (`build_qwen3_5_pair`: the same layer pattern and
focusing, text-only or multimodal classes, dense or MoE).

What vLLM 0.32's CPU path needs of such a target: bf16 weights at run time, linear-attention head dims
of 128 (32 fails in the chunk kernel) and, for Qwen3-Next, at least one MoE layer. Layers: three GDN
layers then one full attention layer (the 3:1 pattern of both families); Qwen3-Next's last layer is MoE
(4 experts, top 2, a shared expert), the others dense MLPs.

focused=True builds the hybrid twin of `pairs.build_pair(focused=True)`: every embedding leans on one
direction u, the layers' output projections are scaled down (GDN out_proj, attention o_proj, MLP and
expert down projections), and the LM-head rows of the four FOCUS tokens are 6u plus context-dependent
noise, so the target's greedy token is always a FOCUS token chosen by the context, while the draft (tiny
layer outputs, mask embedding 6u) ranks the FOCUS tokens in a fixed order: its top-4 always holds the
target's token, its top-1 often does not. Trees then beat the chain.
"""

from __future__ import annotations

import torch

from tests.e2e.pairs import VOCAB, PairShape, focus_head, save_target, write_draft

HIDDEN = 128
NUM_LAYERS = 4
TARGET_LAYER_IDS = (1, 2)


def _qwen3_next_config(linear_heads: tuple[int, int]):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        layer_types=["linear_attention"] * (NUM_LAYERS - 1) + ["full_attention"],
        decoder_sparse_step=1,
        mlp_only_layers=list(range(NUM_LAYERS - 1)),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=HIDDEN,
        shared_expert_intermediate_size=HIDDEN,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )


def build_hybrid_pair(out_dir: str, focused: bool, seed: int = 0, linear_heads: tuple[int, int] = (1, 2)) -> tuple[str, str]:
    """Write target/ (Qwen3NextForCausalLM) and draft/ (DFlashDraftModel) under out_dir; returns their paths.
    linear_heads: the GDN layers' (key heads, value heads); (2, 4) shards over tensor parallelism 2."""
    from transformers import Qwen3NextForCausalLM

    return _write_pair(Qwen3NextForCausalLM(_qwen3_next_config(linear_heads)), out_dir, focused, seed)


MROPE_SECTION = [6, 5, 5]
"""Qwen3.5's M-RoPE sections (temporal, height, width) for the tiny pair's 32 rotary dims (head_dim 64,
partial_rotary_factor 0.5), interleaved as in Qwen3.5's checkpoints."""


def _qwen3_5_config(moe: bool, linear_heads: tuple[int, int]):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": linear_heads[0], "linear_num_value_heads": linear_heads[1],
        "layer_types": ["linear_attention"] * (NUM_LAYERS - 1) + ["full_attention"], "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": MROPE_SECTION, "mrope_interleaved": True},
    }
    if moe:
        return Qwen3_5MoeTextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                                    shared_expert_intermediate_size=HIDDEN)
    return Qwen3_5TextConfig(**common, intermediate_size=2 * HIDDEN)


def build_qwen3_5_pair(out_dir: str, focused: bool, moe: bool = False, multimodal: bool = False, seed: int = 0,
                       linear_heads: tuple[int, int] = (1, 2)) -> tuple[str, str]:
    """The Qwen3.5/3.6 twin of `build_hybrid_pair`: target/ is a text-only Qwen3_5ForCausalLM (every layer's
    MLP dense) or, with moe, Qwen3_5MoeForCausalLM (every layer's MLP MoE: 4 experts, top 2, a shared
    expert), three GDN layers then one full-attention layer, rotary positions M-RoPE (`MROPE_SECTION`).
    multimodal: the same language model inside Qwen3.5's multimodal class (Qwen3_5ForConditionalGeneration
    or Qwen3_5MoeForConditionalGeneration, the class Qwen3.5/3.6 checkpoints ship as) with a one-block
    vision tower; vLLM keeps its M-RoPE positions (it runs the text-only classes with 1-D ones)."""
    import transformers

    text = _qwen3_5_config(moe, linear_heads)
    if not multimodal:
        model = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
        return _write_pair(model(text), out_dir, focused, seed)
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=text.to_dict(), tie_word_embeddings=False, image_token_id=VOCAB - 12, video_token_id=VOCAB - 11,
        vision_start_token_id=VOCAB - 10, vision_end_token_id=VOCAB - 9,  # ids no prompt holds (`conftest.prompts`)
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN,
                       "num_position_embeddings": 64},
    )
    target = getattr(transformers, f"{name}ForConditionalGeneration")(config)
    return _write_pair(target, out_dir, focused, seed)


def _write_pair(target, out_dir: str, focused: bool, seed: int) -> tuple[str, str]:
    """Fill `target`'s weights (focused as the module docstring says), save it and a DFlash draft for it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:  # zero-centred RMSNorms (1 + w) and the gated GDN norm (w) keep their init
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if focused:
            u = torch.randn(HIDDEN, generator=gen)
            u /= u.norm()
            target.get_input_embeddings().weight.add_(4.0 * u)
            for name, p in target.named_parameters():
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
                    p.mul_(0.05)
            focus_head(target, u, gen)
    return save_target(target, out_dir, focused), write_draft(out_dir, focused, gen, PairShape(hidden=HIDDEN, target_layers=NUM_LAYERS, target_layer_ids=TARGET_LAYER_IDS))
