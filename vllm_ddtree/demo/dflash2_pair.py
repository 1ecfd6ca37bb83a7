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


def _selector_scores(selector: dict[str, torch.Tensor], hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor,
                     anchors: torch.Tensor) -> torch.Tensor:
    """vLLM's `_score_edges`: [N, L, K, K] scores of candidate c at depth l after candidate p at depth l - 1
    (the anchor token at depth 0), from hidden [N, L, hidden], candidates and unary logits [N, L, K],
    anchors [N]."""
    predecessor, successor, projection = (selector[key] for key in SELECTOR_KEYS)
    previous = torch.cat([anchors[:, None, None].expand(-1, 1, candidates.shape[2]), candidates[:, :-1]], dim=1)
    return unary[:, :, None] + torch.einsum("nlpr,nlcr->nlpc", predecessor[previous] * (hidden @ projection.T)[:, :, None], successor[candidates])


@torch.no_grad()
def _selector_data(prompts: list[list[int]], continuation: int, top_k: int) -> dict[str, torch.Tensor]:
    """Every block of the embedded pair over the target's greedy continuations of `prompts`: the draft's
    mask-position outputs [N, L, hidden], its top-K candidates and their logits [N, L, K], the anchors [N]
    and the continuation's tokens [N, L] (what a selector should walk)."""
    import torch.nn.functional as F

    from vllm_ddtree.demo.pair_model import block_inputs
    from vllm_ddtree.demo.reference import load_pair

    target, draft, recipe, mask_id = load_pair(*demo_pair_paths())
    depth = recipe.block_size - 1
    rows: dict[str, list[torch.Tensor]] = {"hidden": [], "candidates": [], "unary": [], "anchors": [], "truth": []}
    for prompt in prompts:
        length = len(prompt) + continuation + depth
        cache = target.new_cache(1, length)
        logits, _ = target.forward(torch.tensor([prompt]), 0, cache)
        sequence = list(prompt)
        for position in range(len(prompt), length):
            sequence.append(int(logits[0, -1].argmax()))
            if position < length - 1:
                logits, _ = target.forward(torch.tensor([[sequence[-1]]]), position, cache)
        ids = torch.tensor([sequence])
        _, features = target.forward(ids, 0, target.new_cache(1, length))
        anchors = torch.arange(len(prompt) - 1, len(prompt) + continuation)
        blocks, positions, mask = block_inputs(ids, anchors, recipe.block_size, mask_id, length)
        hidden = draft(F.embedding(blocks, target.embed), positions, features, mask)[0].view(anchors.numel(), recipe.block_size, -1)[:, 1:]
        top = (hidden @ target.lm_head.T).topk(top_k, dim=-1)
        rows["hidden"].append(hidden)
        rows["candidates"].append(top.indices)
        rows["unary"].append(top.values)
        rows["anchors"].append(ids[0, anchors])
        rows["truth"].append(torch.stack([ids[0, anchors + k] for k in range(1, depth + 1)], dim=1))
    return {key: torch.cat(value) for key, value in rows.items()}


def train_selector(prompts: list[list[int]], continuation: int = 48, top_k: int = 8, rank: int = 16, steps: int = 25,
                   seed: int = 0, weight_decay: float = 1e-2) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A candidate selector for the embedded draft, trained on the target's greedy continuations of
    `prompts` (seeded; minutes on a shared CPU): at each depth whose previous and own true tokens are
    among the candidates, cross-entropy over the K successors of the previous true candidate (the anchor
    at depth 1), the draft frozen, an L2 penalty `weight_decay` on the scores' bilinear term. Starts as no
    re-ranking (successor codebook 0: scores = the head's logits). Returns the weights (SELECTOR_KEYS)
    and {"train_ce_before", "train_ce_after", "chain_accuracy_marginal", "chain_accuracy_selector"}
    (teacher-forced: the rate of depths whose true token the greedy step picks after the previous true
    token, by the head's logits vs by the selector)."""
    data = _selector_data(prompts, continuation, top_k)
    weights = _fit(data, rank, steps, seed, weight_decay)
    return weights, {"train_ce_before": _selector_ce(data, None), "train_ce_after": _selector_ce(data, weights), **chain_accuracy(data, weights)}


def _targets(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each depth's true candidate index [N, L], the previous depth's [N, L] (0: the anchor), where both
    are among the candidates [N, L])."""
    candidates, truth = data["candidates"], data["truth"]
    hit = candidates == truth[:, :, None]
    target_index = hit.float().argmax(-1)
    previous_index = torch.cat([torch.zeros_like(target_index[:, :1]), target_index[:, :-1]], dim=1)
    usable = hit.any(-1) & torch.cat([torch.ones_like(hit[:, :1, 0]), hit[:, :-1].any(-1)], dim=1)
    return target_index, previous_index, usable


def _rows(data: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """[N, L, K] scores of each depth's candidates after the previous depth's true candidate (the head's
    logits without a selector)."""
    if weights is None:
        return data["unary"]
    _, previous_index, _ = _targets(data)
    scores = _selector_scores(weights, data["hidden"], data["candidates"], data["unary"], data["anchors"])
    return scores.gather(2, previous_index[:, :, None, None].expand(-1, -1, 1, scores.shape[-1]))[:, :, 0]


@torch.no_grad()
def _selector_ce(data: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None) -> float:
    target_index, _, usable = _targets(data)
    return float(torch.nn.functional.cross_entropy(_rows(data, weights)[usable], target_index[usable]))


@torch.no_grad()
def chain_accuracy(data: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """{"chain_accuracy_marginal", "chain_accuracy_selector"}: the rate of depths whose true token is the
    best candidate after the previous true token, by the head's logits and by the selector."""
    candidates, truth = data["candidates"], data["truth"]
    return {
        f"chain_accuracy_{name}": float((candidates.gather(2, _rows(data, w).argmax(-1, keepdim=True))[:, :, 0] == truth).float().mean())
        for name, w in (("marginal", None), ("selector", weights))
    }


def _fit(data: dict[str, torch.Tensor], rank: int, steps: int, seed: int, weight_decay: float) -> dict[str, torch.Tensor]:
    """The selector's weights after `steps` Adam steps on `_selector_data` (see `train_selector`)."""
    with open(os.path.join(demo_pair_paths()[1], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    unary, width = data["unary"], data["hidden"].shape[-1]
    gen = torch.Generator().manual_seed(seed)
    selector = {
        SELECTOR_KEYS[0]: (0.1 * torch.randn(vocab, rank, generator=gen)).requires_grad_(),
        SELECTOR_KEYS[1]: torch.zeros(vocab, rank).requires_grad_(),
        SELECTOR_KEYS[2]: (0.1 * torch.randn(rank, width, generator=gen) / width**0.5).requires_grad_(),
    }
    target_index, _, usable = _targets(data)
    optimizer = torch.optim.Adam(list(selector.values()), lr=3e-3)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        rows = _rows(data, selector)
        penalty = (rows - unary).pow(2).mean()
        loss = torch.nn.functional.cross_entropy(rows[usable], target_index[usable]) + weight_decay * penalty
        loss.backward()
        optimizer.step()
    return {key: value.detach() for key, value in selector.items()}


def main(argv: list[str] | None = None) -> dict:
    """Train a selector for the embedded draft on the target's continuations of held-out snippets
    TRAIN_SNIPPETS (the benchmark measures on the first ones, EVAL_SNIPPETS), write the DFlash2 draft to
    --out (identity convolutions) with selector_record.json, print the record."""
    import argparse
    import time

    from vllm_ddtree.demo import heldout_prompts

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", required=True, help="where to write the DFlash2 draft (a cache directory)")
    parser.add_argument("--steps", type=int, default=25, help="Adam steps (more overfit the 24 snippets: 50 and 150 measured worse)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.time()
    snippets = heldout_prompts(64, 64)
    weights, stats = train_selector([snippets[i] for i in TRAIN_SNIPPETS], steps=args.steps, seed=args.seed)
    held_out = chain_accuracy(_selector_data([snippets[i] for i in EVAL_SNIPPETS], 48, 8), weights)
    write_dflash2_draft(args.out, selector_top_k=8, selector_rank=16, selector=weights)
    record = {"train": stats, "held_out": held_out, "steps": args.steps, "seed": args.seed, "seconds": round(time.time() - start, 1)}
    with open(os.path.join(args.out, "selector_record.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps(record, indent=2))
    return record


TRAIN_SNIPPETS = range(16, 40)
"""Held-out snippets (`demo.heldout_prompts`) whose continuations train the selector."""
EVAL_SNIPPETS = range(0, 8)
"""Held-out snippets the benchmark measures on (none trained on)."""


if __name__ == "__main__":
    main()
