"""A tiny synthetic Qwen3-Next target (Gated DeltaNet + full attention + MoE) and a DFlash draft for it.

What vLLM 0.32's CPU path needs of such a target: bf16 weights at run time, linear-attention head dims
of 128 (32 fails in the chunk kernel) and at least one MoE layer. Layers: three GDN layers then one full
attention layer (Qwen3-Next's 3:1 pattern); the last layer is MoE (4 experts, top 2, a shared expert),
the others dense MLPs.

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

    gen = torch.Generator().manual_seed(seed)
    target = Qwen3NextForCausalLM(_qwen3_next_config(linear_heads))
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:  # zero-centred RMSNorms (1 + w) and the gated GDN norm (w) keep their init
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if focused:
            u = torch.randn(HIDDEN, generator=gen)
            u /= u.norm()
            target.model.embed_tokens.weight.add_(4.0 * u)
            for name, p in target.named_parameters():
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
                    p.mul_(0.05)
            focus_head(target, u, gen)
    return save_target(target, out_dir, focused), write_draft(out_dir, focused, gen, PairShape(hidden=HIDDEN, target_layers=NUM_LAYERS, target_layer_ids=TARGET_LAYER_IDS))
