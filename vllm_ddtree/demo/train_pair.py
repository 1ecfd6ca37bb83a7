"""Train the embedded demo pair: a tiny Qwen3 target and its DFlash block draft, on CPU.

    python -m vllm_ddtree.demo.train_pair --out DIR [--scale 0.01] [--resume]

Smoke runs may also shrink what ``--scale`` leaves alone: ``--set FIELD=VALUE ...`` overrides recipe
fields (model sizes, vocab, lengths), ``--corpus-files N`` trains on a seeded sample of N files.

Phases (all seeded; every schedule is a STEP COUNT, never elapsed time, so a rerun with the same
interpreter, thread count and library versions repeats the same computation):

1. corpus + tokenizer: the running interpreter's standard-library ``*.py`` files (directories
   ``site-packages``, ``test``, ``tests``, ``idle_test``, ``__pycache__`` skipped), split BY FILE with
   a seeded shuffle; byte-level BPE (``tokenizers``) trained on the train files only; vocab 4096 with
   ``<|endoftext|>`` = 0 (eos, one after every file), plus ``<|mask|>`` = 4096 (the DFlash mask token).
2. target: ``Qwen3ForCausalLM`` (4 layers, hidden 256), next-token CE on random windows of the train
   stream, bf16 autocast, AdamW, warmup + cosine.
3. generations: the target continues random train-stream prefixes (half the batches greedy, half
   T=0.7) with a KV-cached fp32 decoder, recording the DFlash context features (outputs of target
   layers ``target_layer_ids``, i.e. HF ``hidden_states[id + 1]``) as bf16.
4. draft: a 2-layer DFlash draft trained on those generations with the DFlash objective (random
   anchors; block ``[x_a, MASK x (B-1)]`` at positions a..a+B-1 sees context features at positions < a
   and is bidirectional inside; CE at block positions k=1..B-1 weighted ``exp(-(k-1)/gamma)``), in two
   cycles: ``draft_steps`` on generations A, then a warm restart of ``draft_cycle2_steps`` at
   ``draft_cycle2_lr`` on a fresh set of generations B (more target text, same schedule shape).
5. evaluation (pure PyTorch): held-out target loss; teacher-forced draft accuracy per depth; chain
   and DDTree acceptance (T=0 stepping) on held-out prompts.

Corpus and tokenizer: ``pair_corpus``; the models (whose draft forward computes exactly what vLLM
0.32's ``qwen3_dflash.py`` computes, so a draft trained here accepts as well inside vLLM): ``pair_model``;
the acceptance evaluation: ``pair_eval``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vllm_ddtree.demo.pair_corpus import (EXCLUDED_DIRS, MASK, list_corpus_files, read_text, sample_files,
                                          save_hf_tokenizer, sha256_texts, split_files, stdlib_dir,
                                          train_tokenizer)
from vllm_ddtree.demo.pair_eval import acceptance_eval, eval_prompts
from vllm_ddtree.demo.pair_model import CachedTarget, DFlashDraft, draft_logits



@dataclass
class Recipe:
    """Every knob of the run. Target + draft cycle 1 were sized for about 60 min on 2 idle cores
    (from shorter runs, not verified end to end); draft cycle 2 adds about 25 min."""

    seed: int = 0
    heldout_frac: float = 0.05
    bpe_vocab: int = 4096  # includes <|endoftext|>; <|mask|> is added after (vocab = 4097)
    # target
    hidden: int = 256
    target_layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_steps: int = 2200
    target_batch: int = 8
    target_seq: int = 512
    target_lr: float = 3e-3
    target_wd: float = 0.1
    # generations for the draft
    gen_sequences: int = 8192
    gen_prefix: int = 64
    gen_len: int = 256  # prefix + generated tokens
    gen_batch: int = 128
    gen_temperature: float = 0.7
    draft_val_frac: float = 0.05
    # draft
    draft_layers: int = 2
    block_size: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 2])
    draft_steps: int = 4000
    draft_batch: int = 16
    draft_anchors: int = 32
    draft_lr: float = 2e-3
    draft_cycle2_steps: int = 3000
    draft_cycle2_lr: float = 1e-3
    draft_wd: float = 0.01
    loss_gamma: float = 4.0  # DFlash/SpecForge: 4 for block 8
    # One k_norm shared by all draft layers. vLLM 0.32's CPU ``ops.rms_norm`` ignores the per-layer
    # weights of the grouped context-K norm in ``precompute_and_store_context_kv`` and applies layer
    # 0's k_norm to every layer's context K; with tied weights CPU and GPU compute the same draft.
    tie_k_norm: bool = True
    # shared optimiser schedule
    warmup_frac: float = 0.03
    final_lr_frac: float = 0.05
    grad_clip: float = 1.0
    # evaluation
    eval_prompts: int = 40
    eval_new_tokens: int = 128
    eval_budgets: list[int] = field(default_factory=lambda: [8, 16, 32, 64])

    def scaled(self, scale: float) -> "Recipe":
        """Same recipe with all step/sample counts multiplied by ``scale`` (smoke tests)."""
        if scale == 1.0:
            return self
        r = Recipe(**asdict(self))
        r.target_steps = max(2, int(self.target_steps * scale))
        r.draft_steps = max(2, int(self.draft_steps * scale))
        r.draft_cycle2_steps = max(2, int(self.draft_cycle2_steps * scale))
        r.gen_sequences = max(2 * self.gen_batch // 8, int(self.gen_sequences * scale))
        r.gen_batch = min(self.gen_batch, r.gen_sequences // 2)
        r.eval_prompts = max(4, int(self.eval_prompts * scale))
        return r


# Recipe fields that determine phases 1-2 (corpus, tokenizer, target); ``--resume`` checks these and
# the corpus sample (``--corpus-files``).
TARGET_PHASE_FIELDS = (
    "seed", "heldout_frac", "bpe_vocab", "hidden", "target_layers", "heads", "kv_heads", "head_dim",
    "intermediate", "rope_theta", "max_position_embeddings", "target_steps", "target_batch", "target_seq",
    "target_lr", "target_wd", "warmup_frac", "final_lr_frac", "grad_clip",
)
# ... and those that also determine generations A and draft cycle 1; ``--resume`` reuses a saved cycle 1.
CYCLE1_FIELDS = TARGET_PHASE_FIELDS + (
    "gen_sequences", "gen_prefix", "gen_len", "gen_batch", "gen_temperature", "draft_val_frac", "draft_layers",
    "block_size", "target_layer_ids", "draft_steps", "draft_batch", "draft_anchors", "draft_lr", "draft_wd",
    "loss_gamma", "tie_k_norm",
)

RecipeValue = int | float | bool | list[int]


def recipe_override(text: str) -> tuple[str, RecipeValue]:
    """``FIELD=VALUE`` (VALUE in JSON, e.g. ``hidden=64``, ``eval_budgets=[8,16]``) -> (field, value).

    FIELD is a ``Recipe`` field and VALUE has its default's type exactly (``true`` is no int), except
    that an int is accepted for a float field; a list's items have the type of the default's items."""
    name, _, raw = text.partition("=")
    defaults = asdict(Recipe())
    if name not in defaults:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIELD=VALUE with FIELD one of {', '.join(defaults)}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE is not JSON") from None
    default = defaults[name]
    if type(default) is float and type(value) is int:
        value = float(value)
    same = type(value) is type(default) and (
        not isinstance(value, list) or all(type(v) is type(default[0]) for v in value))
    if not same:
        raise argparse.ArgumentTypeError(f"{text!r}: {name} takes a value like {json.dumps(default)}")
    return name, value


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lr_at(step: int, total: int, peak: float, recipe: Recipe) -> float:
    """Linear warmup over ``warmup_frac`` of the steps, then cosine down to ``final_lr_frac``."""
    warm = max(1, int(recipe.warmup_frac * total))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    lo = peak * recipe.final_lr_frac
    return lo + 0.5 * (peak - lo) * (1.0 + math.cos(math.pi * t))


# --------------------------------------------------------------------------------------------
# 2. target
# --------------------------------------------------------------------------------------------


def target_config(r: Recipe, vocab: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=r.hidden,
        intermediate_size=r.intermediate,
        num_hidden_layers=r.target_layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        head_dim=r.head_dim,
        max_position_embeddings=r.max_position_embeddings,
        rope_theta=r.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )


def param_groups(model: nn.Module, wd: float) -> list[dict]:
    """Weight decay on matrices except embeddings (so the unused <|mask|> row is not shrunk)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def random_windows(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def train_target(model, stream: torch.Tensor, r: Recipe, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(param_groups(model, r.target_wd), lr=r.target_lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    ema, t0, hist = None, time.time(), []
    for step in range(r.target_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r.target_steps, r.target_lr, r)
        w = random_windows(stream, r.target_batch, r.target_seq, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0 or step == r.target_steps - 1:
            el = time.time() - t0
            hist.append({"step": step, "loss_ema": round(ema, 4), "elapsed_s": round(el, 1)})
            log(f"target step {step}/{r.target_steps} loss(ema) {ema:.3f} {el:.0f}s")
    model.eval()
    return {"steps": r.target_steps, "final_train_loss_ema": ema, "train_s": time.time() - t0,
            "tokens_seen": r.target_steps * r.target_batch * r.target_seq, "history": hist}


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq: int) -> tuple[float, int]:
    """Mean next-token CE (nats) over all non-overlapping ``seq``-token held-out windows, fp32."""
    n = (len(stream) - 1) // seq
    total, count = 0.0, 0
    for i in range(0, n, 16):
        rows = [stream[j * seq : j * seq + seq + 1] for j in range(i, min(n, i + 16))]
        w = torch.stack(rows)
        logits = model(input_ids=w[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count, n


@torch.no_grad()
def generate_training_data(target: CachedTarget, stream: torch.Tensor, r: Recipe, seed: int) -> dict:
    """Target continuations of random train-stream prefixes with their context features.
    Batches alternate greedy / T=``gen_temperature`` sampling."""
    gen = torch.Generator().manual_seed(seed)
    n_batches = r.gen_sequences // r.gen_batch
    ids = torch.empty(n_batches * r.gen_batch, r.gen_len, dtype=torch.int32)
    fdim = len(r.target_layer_ids) * r.hidden
    feats = torch.empty(n_batches * r.gen_batch, r.gen_len, fdim, dtype=torch.bfloat16)
    t0 = time.time()
    for b in range(n_batches):
        greedy = b % 2 == 0
        seqs = random_windows(stream, r.gen_batch, r.gen_prefix - 1, gen)  # gen_prefix tokens each
        sl = slice(b * r.gen_batch, (b + 1) * r.gen_batch)
        cache = target.new_cache(r.gen_batch, r.gen_len)
        logits, f = target.forward(seqs, 0, cache)
        ids[sl, : r.gen_prefix] = seqs.to(torch.int32)
        feats[sl, : r.gen_prefix] = f.to(torch.bfloat16)
        for pos in range(r.gen_prefix, r.gen_len):
            last = logits[:, -1]
            if greedy:
                nxt = last.argmax(-1)
            else:
                probs = torch.softmax(last / r.gen_temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            ids[sl, pos] = nxt.to(torch.int32)
            logits, f = target.forward(nxt[:, None], pos, cache)
            feats[sl, pos] = f[:, 0].to(torch.bfloat16)
        if b % 8 == 0 or b == n_batches - 1:
            log(f"generation batch {b + 1}/{n_batches} {time.time() - t0:.0f}s")
    return {"ids": ids, "feats": feats, "gen_s": time.time() - t0, "greedy_frac": (n_batches + 1) // 2 / n_batches}


# --------------------------------------------------------------------------------------------
# 3. DFlash draft
# --------------------------------------------------------------------------------------------



def depth_weights(B: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1, normalised to sum 1."""
    w = torch.exp(-(torch.arange(1, B, dtype=torch.float32) - 1) / gamma)
    return w / w.sum()



def train_draft(draft: DFlashDraft, embed, lm_head, data: dict, n_train: int, r: Recipe, mask_id: int, seed: int,
                steps: int, peak_lr: float) -> dict:
    """One cycle: ``steps`` AdamW steps, warmup + cosine from ``peak_lr`` (fresh optimiser state)."""
    gen = torch.Generator().manual_seed(seed)
    B = r.block_size
    w = depth_weights(B, r.loss_gamma)
    lo, hi = r.gen_prefix - 1, r.gen_len - B  # anchors so all B-1 labels are generated tokens
    opt = torch.optim.AdamW(draft.parameters(), lr=peak_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=r.draft_wd)
    draft.train()
    ema, t0, hist = None, time.time(), []
    labels_off = torch.arange(1, B)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, r)
        rows = torch.randint(0, n_train, (r.draft_batch,), generator=gen)
        anchors = (torch.randperm(hi - lo + 1, generator=gen)[: r.draft_anchors] + lo).sort().values
        ids = data["ids"][rows].long()
        feats = data["feats"][rows]
        labels = ids[:, anchors[:, None] + labels_off[None]]  # [S, A, B-1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft_logits(draft, embed, lm_head, ids, feats, anchors, mask_id)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(labels.shape) * w).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), r.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            el = time.time() - t0
            hist.append({"step": step, "loss_ema": round(ema, 4), "elapsed_s": round(el, 1)})
            log(f"draft step {step}/{steps} loss(ema) {ema:.3f} {el:.0f}s")
    draft.eval()
    return {"steps": steps, "peak_lr": peak_lr, "final_train_loss_ema": ema, "train_s": time.time() - t0,
            "blocks_seen": steps * r.draft_batch * r.draft_anchors, "history": hist}


@torch.no_grad()
def draft_val(draft, embed, lm_head, data: dict, rows: range, r: Recipe, mask_id: int) -> dict:
    """Teacher-forced per-depth top-1 accuracy and CE on held-out generations (all anchors, fp32)."""
    B = r.block_size
    anchors = torch.arange(r.gen_prefix - 1, r.gen_len - B + 1)
    correct = torch.zeros(B - 1)
    ce = torch.zeros(B - 1)
    n = 0
    for i in range(rows.start, rows.stop, 8):
        sel = torch.arange(i, min(rows.stop, i + 8))
        ids = data["ids"][sel].long()
        feats = data["feats"][sel].float()
        logits = draft_logits(draft, embed, lm_head, ids, feats, anchors, mask_id)
        labels = ids[:, anchors[:, None] + torch.arange(1, B)[None]]
        correct += (logits.argmax(-1) == labels).float().sum((0, 1))
        ce += F.cross_entropy(logits.permute(0, 3, 1, 2), labels, reduction="none").sum((0, 1))
        n += labels.shape[0] * labels.shape[1]
    return {"sequences": len(rows), "top1_acc_per_depth": [round(x, 4) for x in (correct / n).tolist()],
            "ce_per_depth": [round(x, 4) for x in (ce / n).tolist()]}


# --------------------------------------------------------------------------------------------
# 4. saving
# --------------------------------------------------------------------------------------------


def save_draft(draft: DFlashDraft, r: Recipe, vocab: int, mask_id: int, out_dir: str) -> None:
    """z-lab DFlash checkpoint: model.safetensors without embed/lm_head + config.json that vLLM
    0.32 maps to ``DFlashQwen3ForCausalLM`` (architectures ["DFlashDraftModel"])."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.detach().float().contiguous().clone() for k, v in draft.state_dict().items()}  # untie
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=r.hidden, intermediate_size=r.intermediate,
        num_hidden_layers=r.draft_layers, num_attention_heads=r.heads, num_key_value_heads=r.kv_heads,
        head_dim=r.head_dim, max_position_embeddings=r.max_position_embeddings, rope_theta=r.rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
    ).to_dict()
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["dtype"] = "float32"
    cfg["block_size"] = r.block_size
    cfg["num_target_layers"] = r.target_layers
    cfg["dflash_config"] = {"mask_token_id": mask_id, "target_layer_ids": list(r.target_layer_ids)}
    for k in ("id2label", "label2id"):
        cfg.pop(k, None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def make_heldout_snippets(heldout: list[tuple[str, list[int]]], n: int, length: int, seed: int) -> list[dict]:
    """Prompt snippets from held-out files, ``encodings/`` excluded (code-page tables are trivially
    predictable): one per eligible file in order, then random extra files."""
    rng = random.Random(seed)
    ok = [(f, ids) for f, ids in heldout if not f.startswith("encodings/") and len(ids) >= length + 16]
    picks = list(ok)
    rng.shuffle(picks)
    while len(picks) < n:
        picks.append(ok[rng.randrange(len(ok))])
    out = []
    for f, ids in picks[:n]:
        s = rng.randrange(0, len(ids) - length)
        out.append({"file": f, "start": s, "ids": ids[s : s + length]})
    return out


def _generations(target: "CachedTarget", stream: torch.Tensor, r: Recipe, seed: int, name: str) -> tuple[dict, float, dict]:
    """Generations for one draft cycle; the last ``draft_val_frac`` of the sequences are held out."""
    t0 = time.time()
    data = generate_training_data(target, stream, r, seed)
    n_seq = data["ids"].shape[0]
    data["n_val"] = max(1, int(round(r.draft_val_frac * n_seq)))
    elapsed = time.time() - t0
    log(f"generations {name}: {n_seq} sequences in {elapsed:.0f}s")
    return data, elapsed, {"sequences": n_seq, "generated_tokens": n_seq * (r.gen_len - r.gen_prefix),
                           "greedy_batch_frac": data["greedy_frac"], "val_sequences": data["n_val"], "seed": seed}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (target/, draft/, records)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply step/sample counts (smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (fixed for reproducibility; 1 is far more robust on a busy machine)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse OUT/target if a previous run with the same recipe and corpus finished its "
                         "target phase, and draft cycle 1 as well if that run finished it")
    ap.add_argument("--set", type=recipe_override, nargs="+", action="extend", default=[], metavar="FIELD=VALUE",
                    help="override recipe fields before --scale applies (smoke runs: model sizes, vocab, lengths)")
    ap.add_argument("--corpus-files", type=int, default=None, metavar="N",
                    help="train on a seeded random N of the corpus files (smoke runs; default: all)")
    args = ap.parse_args(argv)

    r = Recipe(**{"seed": args.seed, **dict(args.set)}).scaled(args.scale)
    torch.set_num_threads(args.threads)
    torch.manual_seed(r.seed)
    out = os.path.abspath(args.out)
    tdir, ddir = os.path.join(out, "target"), os.path.join(out, "draft")
    os.makedirs(tdir, exist_ok=True)
    times: dict[str, float] = {}
    record: dict = {"command": "python -m vllm_ddtree.demo.train_pair " + " ".join(sys.argv[1:] if argv is None else argv),
                    "recipe": asdict(r), "scale": args.scale, "threads": args.threads,
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "loadavg_at_start": os.getloadavg()}

    # 1. corpus + tokenizer ------------------------------------------------------------------
    t0 = time.time()
    root = stdlib_dir()
    files = sample_files(list_corpus_files(root), args.corpus_files, r.seed)
    train_files, held_files = split_files(files, r.heldout_frac, r.seed)
    train_texts = [read_text(root, f) for f in train_files]
    held_texts = [read_text(root, f) for f in held_files]
    tok = train_tokenizer(train_texts, r.bpe_vocab)
    vocab = tok.get_vocab_size()
    mask_id = tok.token_to_id(MASK)
    save_hf_tokenizer(tok, tdir, r.max_position_embeddings)

    def encode(texts):
        return [e.ids + [0] for e in tok.encode_batch(texts)]

    train_ids = encode(train_texts)
    held_ids = encode(held_texts)
    train_stream = torch.tensor([t for ids in train_ids for t in ids], dtype=torch.long)
    held_stream = torch.tensor([t for ids in held_ids for t in ids], dtype=torch.long)
    times["corpus_tokenizer_s"] = time.time() - t0
    corpus = {"root": "<python stdlib: os.path.dirname(os.__file__)>", "python": sys.version.split()[0],
              "excluded_dirs": sorted(EXCLUDED_DIRS), "split_seed": r.seed, "heldout_frac": r.heldout_frac,
              "sha256_all_texts_sorted": sha256_texts([read_text(root, f) for f in files]),
              "train": train_files, "heldout": held_files}
    with open(os.path.join(out, "corpus_files.json"), "w") as f:
        json.dump(corpus, f, indent=1)
    record["corpus"] = {"files": len(files), "train_files": len(train_files), "heldout_files": len(held_files),
                        "train_bytes": sum(len(t.encode()) for t in train_texts),
                        "heldout_bytes": sum(len(t.encode()) for t in held_texts),
                        "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
                        "vocab": vocab, "mask_token_id": mask_id, "eos_token_id": 0}
    log(f"corpus {len(files)} files ({len(train_files)} train / {len(held_files)} held-out), "
        f"{len(train_stream)} / {len(held_stream)} tokens, vocab {vocab}, {times['corpus_tokenizer_s']:.1f}s")

    # 2. target -----------------------------------------------------------------------------
    from transformers import Qwen3ForCausalLM

    t0 = time.time()
    phase_file = os.path.join(out, "target_phase.json")
    resumed = False
    if args.resume and os.path.exists(phase_file):
        with open(phase_file) as f:
            saved = json.load(f)
        # a phase file without "corpus_files" predates --corpus-files: its run used the whole corpus
        same_corpus = saved.get("corpus_files") == args.corpus_files
        if same_corpus and all(saved["recipe"][k] == v for k, v in asdict(r).items() if k in TARGET_PHASE_FIELDS):
            model = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
            for key in ("target_params", "target_train", "target_heldout"):
                record[key] = saved[key]
            times["target_s"] = saved["target_s"]
            record["target_resumed_from_previous_run"] = True
            resumed = True
            log("target phase resumed from a previous run with the same recipe and corpus")
    if not resumed:
        torch.manual_seed(r.seed)
        model = Qwen3ForCausalLM(target_config(r, vocab))
        record["target_params"] = sum(p.numel() for p in model.parameters())
        record["target_train"] = train_target(model, train_stream, r, r.seed + 1)
        loss, nwin = heldout_loss(model, held_stream, 256)
        record["target_heldout"] = {"loss_nats_per_token": round(loss, 4), "ppl": round(math.exp(loss), 3),
                                    "bits_per_byte": round(loss * len(held_stream) / math.log(2) / record["corpus"]["heldout_bytes"], 4),
                                    "windows_256": nwin}
        model.config.architectures = ["Qwen3ForCausalLM"]
        model.config.dtype = "float32"
        model.save_pretrained(tdir, safe_serialization=True)
        times["target_s"] = time.time() - t0
        with open(phase_file, "w") as f:
            json.dump({"recipe": asdict(r), "corpus_files": args.corpus_files, "target_s": times["target_s"],
                       **{k: record[k] for k in ("target_params", "target_train", "target_heldout")}}, f)
    log(f"target held-out loss {record['target_heldout']['loss_nats_per_token']:.4f} nats/token ({times['target_s']:.0f}s)")

    # 3 + 4. generations A -> draft cycle 1; generations B -> draft cycle 2 (warm restart) ----------
    target = CachedTarget(model, r.target_layer_ids)
    embed = model.model.embed_tokens.weight.detach()
    lm_head = model.lm_head.weight.detach()
    torch.manual_seed(r.seed + 3)
    draft = DFlashDraft(r)
    record["draft_params"] = sum(p.numel() for p in draft.parameters())
    cycle1_file, cycle1_dir = os.path.join(out, "draft_cycle1.json"), os.path.join(out, "draft_cycle1")
    saved = None
    if resumed and os.path.exists(cycle1_file):  # a saved cycle 1 fits only the target it was trained on
        with open(cycle1_file) as f:
            saved = json.load(f)
        if any(saved["recipe"][k] != v for k, v in asdict(r).items() if k in CYCLE1_FIELDS):
            saved = None
    if saved is not None:
        from safetensors.torch import load_file

        draft.load_state_dict(load_file(os.path.join(cycle1_dir, "model.safetensors")))
        record.update(generation_a=saved["generation_a"], draft_cycle1=saved["draft_cycle1"])
        times.update(generation_a_s=saved["generation_a_s"], draft_cycle1_s=saved["draft_cycle1_s"])
        record["draft_cycle1_resumed_from_previous_run"] = True
        log("draft cycle 1 resumed from a previous run with the same recipe")
    else:
        data, times["generation_a_s"], record["generation_a"] = _generations(target, train_stream, r, r.seed + 2, "A")
        t0 = time.time()
        record["draft_cycle1"] = train_draft(draft, embed, lm_head, data, data["ids"].shape[0] - data["n_val"], r,
                                             mask_id, r.seed + 4, r.draft_steps, r.draft_lr)
        times["draft_cycle1_s"] = time.time() - t0
        del data
        save_draft(draft, r, vocab, mask_id, cycle1_dir)
        with open(cycle1_file, "w") as f:
            json.dump({"recipe": asdict(r), **{k: record[k] for k in ("generation_a", "draft_cycle1")},
                       **{k: times[k] for k in ("generation_a_s", "draft_cycle1_s")}}, f)
    data, times["generation_b_s"], record["generation_b"] = _generations(target, train_stream, r, r.seed + 7, "B")
    n_seq, n_val = data["ids"].shape[0], data["n_val"]
    t0 = time.time()
    record["draft_cycle2"] = train_draft(draft, embed, lm_head, data, n_seq - n_val, r, mask_id, r.seed + 8,
                                         r.draft_cycle2_steps, r.draft_cycle2_lr)
    times["draft_cycle2_s"] = time.time() - t0
    save_draft(draft, r, vocab, mask_id, ddir)
    # sum of the phases (a --resume run adds the times of the phases it reused)
    t_train = sum(times[k] for k in ("corpus_tokenizer_s", "target_s", "generation_a_s", "draft_cycle1_s",
                                     "generation_b_s", "draft_cycle2_s"))
    log(f"draft trained; training pipeline {t_train:.0f}s")

    # 5. evaluation ---------------------------------------------------------------------------
    t0 = time.time()
    draft.float()
    record["draft_val"] = draft_val(draft, embed, lm_head, data, range(n_seq - n_val, n_seq), r, mask_id)
    del data
    held_pairs = list(zip(held_files, held_ids))
    prompts = eval_prompts(held_pairs, r.eval_prompts, r.seed + 5)
    record["acceptance_t0"] = acceptance_eval(model, draft, prompts, r, mask_id)
    times["eval_s"] = time.time() - t0
    snippets = make_heldout_snippets(held_pairs, 64, 256, r.seed + 6)
    with open(os.path.join(out, "heldout_prompts.json"), "w") as f:
        json.dump({"note": "held-out stdlib snippets (encodings/ excluded), 256 target-tokenizer ids each",
                   "snippets": snippets}, f)
    times["training_pipeline_s"] = t_train
    times["total_s"] = t_train + times["eval_s"]
    record["times"] = {k: round(v, 1) for k, v in times.items()}
    record["loadavg_at_end"] = os.getloadavg()
    with open(os.path.join(out, "training_record.json"), "w") as f:
        json.dump(record, f, indent=1)
    acc = record["acceptance_t0"]
    log(f"draft val acc/depth {record['draft_val']['top1_acc_per_depth']}")
    log(f"T=0 tau all {json.dumps({k: v['tau'] for k, v in acc['all'].items()})}")
    log(f"T=0 tau excl. encodings {json.dumps({k: v['tau'] for k, v in acc['excl_encodings'].items()})}")
    log(f"times {record['times']}")


if __name__ == "__main__":
    main()
