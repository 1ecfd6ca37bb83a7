"""Pure-PyTorch reference for greedy DFlash / DDTree stepping on the demo pair (no vLLM, no vllm_ddtree.core).

It exists to check the vLLM numbers with code that shares nothing with them but the checkpoints: the
target's weights load through `transformers` and run in float32 through the training code's
`CachedTarget`, the draft through the training code's `DFlashDraft`, and trees come from a heap
(`ddtree_accept`), not from the batched builder the vLLM path uses.

Rule (T=0): the target's greedy continuation is fixed, so a step from anchor position `a` (last
committed token) accepts the longest draft prefix (chain) or the deepest tree node on that
continuation's path (DDTree), plus one bonus token; the next anchor is `a + accepted + 1`. Steps are
counted as vLLM's spec-decode metrics count them: one draft per step while fewer than `max_tokens`
tokens are committed, so tokens per step = 1 + accepted / drafts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

CHAIN = 0  # "budget" key of the chain (top-1 at every depth) in ReferenceResult.accepted


@dataclass
class ReferenceResult:
    """accepted[budget] = accepted draft tokens per step (budget CHAIN = the chain), greedy ids per prompt."""

    accepted: dict[int, list[int]] = field(default_factory=dict)
    greedy_token_ids: list[list[int]] = field(default_factory=list)

    def tokens_per_step(self, budget: int) -> float:
        steps = self.accepted[budget]
        return 1.0 + sum(steps) / len(steps)

    def accepted_per_position(self, budget: int, depth: int) -> list[int]:
        """How many steps accepted at least k draft tokens, k = 1..depth (vLLM's per-position counter)."""
        return [sum(1 for a in self.accepted[budget] if a >= k) for k in range(1, depth + 1)]


def load_draft(draft_dir: str):
    """(DFlashDraft, Recipe, config dict) of a DFlash checkpoint in float32, eval mode, every norm at the
    config's epsilon."""
    from safetensors.torch import load_file

    from vllm_ddtree.demo.pair_model import DFlashDraft
    from vllm_ddtree.demo.train_pair import Recipe

    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    recipe = Recipe(
        hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], intermediate=cfg["intermediate_size"],
        rope_theta=cfg["rope_parameters"]["rope_theta"], draft_layers=cfg["num_hidden_layers"],
        block_size=cfg["block_size"], target_layer_ids=cfg["dflash_config"]["target_layer_ids"],
        tie_k_norm=False,  # load every layer's own k_norm as stored
    )
    draft = DFlashDraft(recipe, eps=cfg["rms_norm_eps"]).eval()
    draft.load_state_dict(load_file(os.path.join(draft_dir, "model.safetensors")))
    return draft, recipe, cfg


def load_pair(target_dir: str, draft_dir: str):
    """(CachedTarget, DFlashDraft, Recipe, mask token id) in float32, eval mode."""
    import torch
    from transformers import Qwen3ForCausalLM

    from vllm_ddtree.demo.pair_model import CachedTarget

    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft, recipe, cfg = load_draft(draft_dir)
    return CachedTarget(target, recipe.target_layer_ids), draft, recipe, cfg["dflash_config"]["mask_token_id"]


def greedy_reference(
    target_dir: str, draft_dir: str, prompt_ids: list[list[int]], max_tokens: int, budgets: list[int]
) -> ReferenceResult:
    """Greedy continuation of every prompt, and per-step acceptance of the chain and of each budget."""
    import torch

    from vllm_ddtree.demo.pair_eval import ddtree_accept
    from vllm_ddtree.demo.pair_model import draft_logits

    target, draft, recipe, mask_id = load_pair(target_dir, draft_dir)
    depth = recipe.block_size - 1
    result = ReferenceResult(accepted={b: [] for b in [CHAIN, *budgets]})
    with torch.no_grad():
        for prompt in prompt_ids:
            P, L = len(prompt), len(prompt) + max_tokens + depth
            cache = target.new_cache(1, L)
            logits, _ = target.forward(torch.tensor([prompt]), 0, cache)
            seq = list(prompt)
            for pos in range(P, L):
                seq.append(int(logits[0, -1].argmax()))
                if pos < L - 1:
                    logits, _ = target.forward(torch.tensor([[seq[-1]]]), pos, cache)
            result.greedy_token_ids.append(seq[P : P + max_tokens])
            _, features = target.forward(torch.tensor([seq]), 0, target.new_cache(1, L))
            # the block anchored at committed position a (its token known, context < a) predicts a+1 .. a+depth
            anchors = torch.arange(P, P + max_tokens)
            blocks = draft_logits(draft, target.embed, target.lm_head, torch.tensor([seq]), features, anchors, mask_id)[0]
            logq = torch.log_softmax(blocks.float(), -1)  # [anchor - P, depth, vocab]
            for budget, steps in result.accepted.items():
                a = P  # the prefill commits x_P; the first draft is anchored there
                while a - P + 1 < max_tokens:  # committed new tokens x_P .. x_a
                    truth = seq[a + 1 : a + 1 + depth]
                    q = logq[a - P]
                    if budget == CHAIN:
                        accepted = 0
                        while accepted < depth and int(q[accepted].argmax()) == truth[accepted]:
                            accepted += 1
                    else:
                        accepted = ddtree_accept(q, truth, budget)
                    steps.append(accepted)
                    a += accepted + 1
    return result
