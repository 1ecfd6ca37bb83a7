"""The embedded DFlash draft (``demo/pair/draft``) in DFlash2 form, for vLLM's ``DFlash2DraftModel``.

DFlash2 adds, per decoder layer, two grouped local convolutions over the block's positions (around the
attention and around the MLP) and, per draft, a candidate selector: low-rank codebooks that score each
candidate after each candidate of the previous position (vLLM 0.32, ``models/qwen3_dflash2.py``). A
convolution whose base kernel is 1 at tap 0 and 0 elsewhere, with a zero kernel projection, is the
identity, so the converted draft drafts as the DFlash one does; ``conv_noise`` perturbs both (seeded) so
the convolutions do work. The selector's weights are given, or random (seeded, entries of scale
``selector_scale``): a random selector re-ranks each position's candidates by the previous one.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from vllm_ddtree.demo import demo_pair_paths

SELECTOR_KEYS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight")
"""The selector's weights (vLLM's names under the draft model): [vocab, rank], [vocab, rank], [rank, hidden]."""


def write_dflash2_draft(
    out_dir: str,
    seed: int = 0,
    selector_top_k: int = 4,
    selector_rank: int = 16,
    conv_kernel_size: int = 3,
    conv_group_size: int = 64,
    conv_noise: float = 0.0,
    selector_scale: float = 0.5,
    selector: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write the DFlash2 form of the embedded draft to `out_dir` (config.json, model.safetensors) and
    return it. selector: SELECTOR_KEYS -> tensors (default: random)."""
    draft_dir = demo_pair_paths()[1]
    with open(os.path.join(draft_dir, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(draft_dir, "model.safetensors"))
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    groups = hidden // conv_group_size
    gen = torch.Generator().manual_seed(seed)
    for layer in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, conv_kernel_size, hidden)
            base[:, 0] = 1.0
            base += conv_noise * torch.randn(base.shape, generator=gen)
            weights[f"layers.{layer}.{conv}.base_kernel"] = base
            weights[f"layers.{layer}.{conv}.kernel_projection.weight"] = conv_noise * torch.randn(2 * conv_kernel_size * groups, hidden, generator=gen)
    if selector is None:
        shapes = ((vocab, selector_rank), (vocab, selector_rank), (selector_rank, hidden))
        selector = {key: selector_scale * torch.randn(shape, generator=gen) for key, shape in zip(SELECTOR_KEYS, shapes)}
    weights.update({key: selector[key].float().contiguous() for key in SELECTOR_KEYS})
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] = {
        **config["dflash_config"],
        "conv_kernel_size": conv_kernel_size,
        "conv_group_size": conv_group_size,
        "selector_rank": selector_rank,
        "selector_top_k": selector_top_k,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    return out_dir
