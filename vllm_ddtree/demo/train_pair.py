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

The draft forward here is written to compute exactly what vLLM 0.32's ``qwen3_dflash.py`` computes at
inference (see ``DFlashDraft``), so a draft trained here accepts as well inside vLLM.
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
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

EOT = "<|endoftext|>"
MASK = "<|mask|>"
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


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
# 1. corpus and tokenizer
# --------------------------------------------------------------------------------------------


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def list_corpus_files(root: str) -> list[str]:
    """Sorted relative paths of every ``*.py`` under ``root`` outside the excluded directories."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def sample_files(files: list[str], n: int | None, seed: int) -> list[str]:
    """``files`` itself when ``n`` is None (the recipe's corpus), else a seeded random ``n`` of them
    (smoke runs), sorted."""
    if n is None:
        return files
    return sorted(random.Random(seed).sample(files, n))


def split_files(files: list[str], frac: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, heldout), each sorted; the held-out set is a seeded random ``frac`` of the files."""
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    n_held = max(1, round(frac * len(files)))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def read_text(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE, ``<|endoftext|>`` = id 0, then ``<|mask|>`` appended as id ``vocab``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([MASK])
    assert tok.token_to_id(EOT) == 0 and tok.token_to_id(MASK) == vocab
    return tok


def save_hf_tokenizer(tok, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json loadable by ``AutoTokenizer`` and vLLM."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[MASK],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(out_dir)
    # transformers 5 writes its own class name; the classic alias loads in 4.x and 5.x alike.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


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


# --------------------------------------------------------------------------------------------
# Functional Qwen3 pieces shared by the target decoder and the draft (HF / vLLM conventions)
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF/vLLM Qwen3 RMSNorm: normalise in fp32, cast back, scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [..., head_dim] for NeoX-style (rotate-half) RoPE, as HF and vLLM Qwen3."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    f = positions.float()[..., None] * inv
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class CachedTarget:
    """KV-cached fp32 decoder over an HF ``Qwen3ForCausalLM``'s weights that also returns the DFlash
    context features (residual stream after each layer in ``feature_layers``)."""

    def __init__(self, model, feature_layers: list[int]):
        cfg = model.config
        self.cfg = cfg
        self.embed = model.model.embed_tokens.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.norm = model.model.norm.weight.detach()
        self.layers = [
            {k: v.detach() for k, v in layer.state_dict().items()} for layer in model.model.layers
        ]
        self.feature_layers = feature_layers
        self.theta = cfg.rope_parameters["rope_theta"]

    def new_cache(self, batch: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.layers]

    def forward(self, ids: torch.Tensor, start: int, cache: list):
        """ids [B, T] at positions start..start+T-1, causal over the cached positions < start and
        ids; writes K/V at start..start+T-1 of ``cache`` (from ``new_cache``).
        Returns (logits [B, T, V], features [B, T, len(feature_layers) * d])."""
        cfg, (B, T) = self.cfg, ids.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = rope_cos_sin(torch.arange(start, start + T), hd, self.theta)
        x = F.embedding(ids, self.embed)
        feats = []
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["input_layernorm.weight"])
            q = rms_norm((h @ w["self_attn.q_proj.weight"].T).view(B, T, nh, hd), w["self_attn.q_norm.weight"])
            k = rms_norm((h @ w["self_attn.k_proj.weight"].T).view(B, T, nkv, hd), w["self_attn.k_norm.weight"])
            v = (h @ w["self_attn.v_proj.weight"].T).view(B, T, nkv, hd)
            q = apply_rope(q.transpose(1, 2), cos, sin)
            kc, vc = cache[i]
            kc[:, :, start : start + T] = apply_rope(k.transpose(1, 2), cos, sin)
            vc[:, :, start : start + T] = v.transpose(1, 2)
            k, v = kc[:, :, : start + T], vc[:, :, : start + T]
            # causal with an offset: query t (absolute start+t) sees keys <= start+t
            mask = None
            if T > 1:
                kpos = torch.arange(k.shape[2])
                mask = kpos[None, :] <= (torch.arange(start, start + T)[:, None])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, nh * hd) @ w["self_attn.o_proj.weight"].T
            h = rms_norm(x, w["post_attention_layernorm.weight"])
            x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
            if i in self.feature_layers:
                feats.append(x)
        logits = rms_norm(x, self.norm) @ self.lm_head.T
        return logits, torch.cat(feats, dim=-1)


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


class DraftLayer(nn.Module):
    """One Qwen3 decoder layer; parameter names equal the checkpoint's ``layers.i.*``."""

    def __init__(self, d: int, nh: int, nkv: int, hd: int, inter: int):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * hd, d, bias=False)
        self.self_attn.q_norm = _Norm(hd)
        self.self_attn.k_norm = _Norm(hd)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, inter, bias=False)
        self.mlp.up_proj = nn.Linear(d, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, d, bias=False)
        self.input_layernorm = _Norm(d)
        self.post_attention_layernorm = _Norm(d)


class _Norm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight)


class DFlashDraft(nn.Module):
    """DFlash draft with the exact computation of vLLM 0.32 ``qwen3_dflash.py``.

    Inputs per sequence: context features ``feats`` [S, T, k*d] (target layer outputs, HF
    ``hidden_states[id+1]`` = vLLM aux capture at id+1) at positions 0..T-1, and A anchors a_j.
    Block j is ``[x_{a_j}, MASK x (B-1)]`` at positions a_j..a_j+B-1, embedded with the TARGET's
    embedding.

      c = hidden_norm(fc(feats))                                   (combine_hidden_states + hidden_norm)
      per layer:  context K = RoPE(k_norm(W_k c)), V = W_v c        (precompute_and_store_context_kv:
                                                                     no input_layernorm on c)
                  u = input_layernorm(x); Q, K, V of the block from u (q_norm/k_norm, RoPE at block pos)
                  block j attends (non-causally) to context positions < a_j and to its own B rows
                  x = x + o_proj(attn); x = x + mlp(post_attention_layernorm(x))
      out = norm(x) -> TARGET lm_head; block row k (k >= 1) predicts x_{a_j + k}.
    """

    def __init__(self, r: Recipe):
        super().__init__()
        d = r.hidden
        self.r = r
        self.fc = nn.Linear(len(r.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = _Norm(d)
        self.layers = nn.ModuleList(
            DraftLayer(d, r.heads, r.kv_heads, r.head_dim, r.intermediate) for _ in range(r.draft_layers)
        )
        self.norm = _Norm(d)
        if r.tie_k_norm:
            for layer in self.layers[1:]:
                layer.self_attn.k_norm = self.layers[0].self_attn.k_norm
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor, feats: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """block_emb [S, N, d] (N = A*B block rows), block_pos [N] or [S, N], feats [S, T, k*d]
        (positions 0..T-1), mask [N, T + N] or [S, N, T + N] bool (True = attend).
        Returns final hidden states [S, N, d] (before lm_head)."""
        r = self.r
        S, N, _ = block_emb.shape
        T = feats.shape[1]
        nh, nkv, hd = r.heads, r.kv_heads, r.head_dim
        c = self.hidden_norm(self.fc(feats))
        cos_c, sin_c = rope_cos_sin(torch.arange(T), hd, r.rope_theta)
        cos_b, sin_b = rope_cos_sin(block_pos, hd, r.rope_theta)
        if block_pos.dim() == 2:  # per-sequence positions -> broadcast over heads
            cos_b, sin_b = cos_b[:, None], sin_b[:, None]
        if mask.dim() == 3:
            mask = mask[:, None]
        x = block_emb
        for layer in self.layers:
            a = layer.self_attn
            kc = apply_rope(a.k_norm(a.k_proj(c).view(S, T, nkv, hd)).transpose(1, 2), cos_c, sin_c)
            vc = a.v_proj(c).view(S, T, nkv, hd).transpose(1, 2)
            u = layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(u).view(S, N, nh, hd)).transpose(1, 2), cos_b, sin_b)
            kb = apply_rope(a.k_norm(a.k_proj(u).view(S, N, nkv, hd)).transpose(1, 2), cos_b, sin_b)
            vb = a.v_proj(u).view(S, N, nkv, hd).transpose(1, 2)
            k = torch.cat([kc, kb], dim=2)
            v = torch.cat([vc, vb], dim=2)
            o = F.scaled_dot_product_attention(q, k, v.to(q.dtype), attn_mask=mask, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(S, N, nh * hd))
            h = layer.post_attention_layernorm(x)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        return self.norm(x)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, B: int, mask_id: int, T: int):
    """Block token ids [S, A*B], positions [A*B] and attention mask [A*B, T + A*B] for anchors
    shared across the S sequences. Context column t is visible to block j iff t < a_j."""
    A = anchors.numel()
    blk = torch.full((ids.shape[0], A, B), mask_id, dtype=torch.long)
    blk[:, :, 0] = ids[:, anchors].long()
    pos = (anchors[:, None] + torch.arange(B)[None]).reshape(-1)
    ctx_ok = torch.arange(T)[None, :] < anchors[:, None]  # [A, T]
    ctx_ok = ctx_ok.repeat_interleave(B, dim=0)  # [A*B, T]
    blk_id = torch.arange(A).repeat_interleave(B)
    own = blk_id[:, None] == blk_id[None, :]  # [A*B, A*B]
    return blk.reshape(ids.shape[0], A * B), pos, torch.cat([ctx_ok, own], dim=1)


def depth_weights(B: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1, normalised to sum 1."""
    w = torch.exp(-(torch.arange(1, B, dtype=torch.float32) - 1) / gamma)
    return w / w.sum()


def draft_logits(draft: DFlashDraft, embed: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor,
                 feats: torch.Tensor, anchors: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Logits [S, A, B-1, V] of block rows 1..B-1 for anchors shared across the batch."""
    B = draft.r.block_size
    T = feats.shape[1]
    blk, pos, mask = block_inputs(ids, anchors, B, mask_id, T)
    hidden = draft(F.embedding(blk, embed), pos, feats, mask)
    S = ids.shape[0]
    hidden = hidden.view(S, anchors.numel(), B, -1)[:, :, 1:]
    return hidden @ lm_head.T.to(hidden.dtype)


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
# 4. acceptance evaluation (T=0 stepping, chain and DDTree)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# 5. saving
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


def sha256_texts(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


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
