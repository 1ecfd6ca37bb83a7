"""The demo pair's acceptance evaluation in plain PyTorch (phase 5 of ``train_pair``): T=0 stepping
against the fp32 target's greedy continuation, chain and best-first DDTree, on held-out prompts."""
from __future__ import annotations

import heapq
import random
from typing import TYPE_CHECKING

import torch

from vllm_ddtree.demo.pair_model import CachedTarget, draft_logits

if TYPE_CHECKING:
    from vllm_ddtree.demo.train_pair import Recipe

def eval_prompts(heldout: list[tuple[str, list[int]]], n: int, seed: int, min_len: int = 64,
                 max_len: int = 128, reserve: int = 32) -> list[tuple[str, list[int]]]:
    """n (file, prompt ids) pairs: one per eligible held-out file in order, then random extra files;
    prompt length uniform in [min_len, max_len], random start."""
    rng = random.Random(seed)
    ok = [(f, ids) for f, ids in heldout if len(ids) >= max_len + reserve]
    picks = list(ok[:n])
    while len(picks) < n:
        picks.append(ok[rng.randrange(len(ok))])
    out = []
    for f, ids in picks:
        L = rng.randint(min_len, max_len)
        s = rng.randrange(0, len(ids) - L)
        out.append((f, ids[s : s + L]))
    return out


def ddtree_accept(logq: torch.Tensor, ref: list[int], budget: int) -> int:
    """Accepted depth of a best-first DDTree of ``budget`` nodes against the greedy reference.
    logq [D, V] per-depth log-probs; score(path) = sum_i logq_i(x_i); heap pushes next sibling
    and first child, so the tree is prefix-closed."""
    D = logq.shape[0]
    k = min(budget, logq.shape[1])
    vals, idx = logq.topk(k, dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    nodes = set()
    heap = [(-vals[0][0], (0,))]
    while heap and len(nodes) < budget:
        neg, ranks = heapq.heappop(heap)
        nodes.add(ranks)
        d = len(ranks)
        if ranks[-1] + 1 < k:  # next sibling
            heapq.heappush(heap, (neg + vals[d - 1][ranks[-1]] - vals[d - 1][ranks[-1] + 1], ranks[:-1] + (ranks[-1] + 1,)))
        if d < D:  # first child
            heapq.heappush(heap, (neg - vals[d][0], ranks + (0,)))
    path: tuple[int, ...] = ()
    depth = 0
    for d in range(D):
        if ref[d] not in idx[d]:
            break
        path = path + (idx[d].index(ref[d]),)
        if path not in nodes:
            break
        depth = d + 1
    return depth


@torch.no_grad()
def acceptance_eval(target_model, draft, prompts: list[tuple[str, list[int]]], r: Recipe, mask_id: int) -> dict:
    """Greedy reference continuation (fp32 target) then T=0 stepping: anchor a = first uncommitted
    position, draft from context < a, accept the longest matching prefix (chain) or the deepest
    tree node on the reference path (DDTree); tau = accepted + 1; next anchor a + tau."""
    tgt = CachedTarget(target_model, r.target_layer_ids)
    embed, lm_head = tgt.embed, tgt.lm_head
    D = r.block_size - 1
    per_prompt = []
    for f, p in prompts:
        P = len(p)
        L = P + r.eval_new_tokens + D
        cache = tgt.new_cache(1, L)
        logits, _ = tgt.forward(torch.tensor([p]), 0, cache)
        seq = list(p)
        for pos in range(P, L):
            nxt = int(logits[0, -1].argmax())
            seq.append(nxt)
            if pos < L - 1:
                logits, _ = tgt.forward(torch.tensor([[nxt]]), pos, cache)
        full = torch.tensor([seq])
        _, feats = tgt.forward(full, 0, tgt.new_cache(1, L))
        anchors = torch.arange(P, P + r.eval_new_tokens)
        lg = draft_logits(draft, embed, lm_head, full, feats, anchors, mask_id)[0]  # [A, D, V]
        logq = torch.log_softmax(lg.float(), dim=-1)
        steps = {"chain": [], **{f"tree{b}": [] for b in r.eval_budgets}}
        for name in steps:
            a = P
            while a < P + r.eval_new_tokens:
                ref = seq[a + 1 : a + 1 + D]
                j = a - P
                if name == "chain":
                    acc = 0
                    for d in range(D):
                        if int(logq[j, d].argmax()) != ref[d]:
                            break
                        acc += 1
                else:
                    acc = ddtree_accept(logq[j], ref, int(name[4:]))
                steps[name].append(acc)
                a += acc + 1
        per_prompt.append({"file": f, "prompt_len": P, "accepted": steps})

    def summarize(items):
        out = {}
        for name in ["chain"] + [f"tree{b}" for b in r.eval_budgets]:
            acc = [x for it in items for x in it["accepted"][name]]
            if not acc:
                continue
            t = torch.tensor(acc, dtype=torch.float32)
            out[name] = {"tau": round(float(t.mean() + 1), 4), "steps": len(acc)}
            if name == "chain":
                out[name]["p_accepted_ge_k"] = [round(float((t >= k).float().mean()), 4) for k in range(1, D + 1)]
                out[name]["histogram"] = [int((t == k).sum()) for k in range(D + 1)]
        return out

    return {
        "prompts": len(prompts),
        "new_tokens": r.eval_new_tokens,
        "all": summarize(per_prompt),
        "excl_encodings": summarize([x for x in per_prompt if not x["file"].startswith("encodings/")]),
        "per_prompt": [{"file": x["file"], "prompt_len": x["prompt_len"],
                        "chain_tau": round(1 + sum(x["accepted"]["chain"]) / len(x["accepted"]["chain"]), 3)}
                       for x in per_prompt],
    }
