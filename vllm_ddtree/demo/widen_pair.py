"""Widen the embedded pair to the cost of real models while computing the same function.

    python -m vllm_ddtree.demo.widen_pair --size 0.6b|1.7b [--out DIR] [--force]

Writes DIR/target (Qwen3ForCausalLM, tokenizer and generation config copied), DIR/draft (z-lab DFlash
format, as `pair/draft`), DIR/heldout_prompts.json (so `heldout_prompts(pair_dir=DIR)` and
`check_pair_vllm --pair DIR` work) and DIR/widen.json (what was built from what). Default DIR:
`$XDG_CACHE_HOME/vllm_ddtree/pairs/<size>` (~/.cache/...); a folder whose widen.json matches the
requested shape, the source pair's checksums and WIDEN_VERSION is left as it is. `widened_pair_paths`
does the same from Python.

Same function, exactly in real arithmetic (float32 differs by rounding only: more, zero, terms in sums):
- Hidden size H -> H': every hidden-size vector (embedding rows, residual stream, norm outputs, layer
  outputs, the draft's fc output) holds the original values in coordinates [0, H) and zeros in [H, H').
  The embedding and lm_head get zero columns; every projection writing the residual stream (o_proj,
  down_proj, fc) gets zero rows there, every projection reading it zero columns.
- RMSNorm over H': with zero padding, mean_{H'}(x^2) = (H/H') mean_H(x^2), so
      x_i / sqrt(mean_{H'} + eps') = sqrt(H'/H) x_i / sqrt(mean_H + eps' H'/H);
  eps' = eps H/H' and weight' = weight sqrt(H/H') give the original output (`rms_norm_rescale`).
- Qwen3 has ONE `rms_norm_eps` for every norm, also the per-head q_norm/k_norm over head_dim (which does
  not change). q_norm(g q) with eps' equals q_norm(q) with eps iff g^2 = eps'/eps = H/H', so q_proj and
  k_proj are scaled by sqrt(H/H') (`qk_gain`); q_norm/k_norm weights are untouched.
- Attention heads: head_dim stays the source's (RoPE and the softmax scale 1/sqrt(head_dim) depend on
  it) and so does the q/kv ratio g. Extra heads are appended: under GQA q head j reads kv head j // g,
  so the original q heads 0..nh-1 still read kv heads 0..nkv-1 and the extra q heads read only extra kv
  heads. Extra heads have zero q/k/v rows (so zero outputs) and zero o_proj columns.
- MLP: extra units have zero gate/up rows and zero down_proj columns (silu(0) * 0 = 0, times 0).
- Layers: the originals sit at `layer_positions` (interleaved); the others have every projection zero,
  so with Qwen3's pre-norm residual (x + o_proj(attn(norm(x))), then x + down(mlp(norm(x)))) each is the
  identity on the residual stream. Their norm weights are irrelevant (ones); their q_norm/k_norm are
  the source layer 0's, because vLLM's CPU DFlash path applies the first layer's k_norm to every
  layer's context K (the tiny draft's k_norms are tied for that reason; `widen_draft` checks it).
- The draft: widened the same way (its hidden size is the target's). Its fc reads the concatenation of
  the target's residual stream after the layers `target_layer_ids`: block j of fc's input moves from
  [j H, (j+1) H) to [j H', j H' + H), the rest is zero; the ids map to the layers' new indices.

Not widened: the vocabulary (4097): padded logits would need -inf, which weights cannot give, so the
LM head costs far less than a real model's (151,936 rows in Qwen3).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

WIDEN_VERSION = 1  # bump when the output for a given shape and source changes
SHARD_BYTES = 2 * 2**30  # a target above this is written as an indexed set of shards (loads in HF and vLLM)
COPIED_TARGET_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    """Widened dimensions; the head size and the q/kv ratio stay the source's."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    target_layers: int
    draft_layers: int


# Qwen3-0.6B: hidden 1024, 28 layers, 16/8 heads of 128 (q dim 2048), MLP 3072. Qwen3-1.7B: hidden 2048,
# 28 layers, 16/8 heads of 128, MLP 6144. With heads of 64, 1.7b takes 32/16 heads for the real q/kv
# projection sizes; 0.6b keeps the real head counts (q dim 1024). Drafts of 4 layers, as z-lab's DFlash
# drafts of Qwen3 targets (a few layers).
SIZES: dict[str, Shape] = {
    "0.6b": Shape(hidden=1024, heads=16, kv_heads=8, intermediate=3072, target_layers=28, draft_layers=4),
    "1.7b": Shape(hidden=2048, heads=32, kv_heads=16, intermediate=6144, target_layers=28, draft_layers=4),
}


@dataclass(frozen=True)
class Dims:
    """One model's dimensions (source or widened)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int

    @classmethod
    def of(cls, cfg: dict) -> Dims:
        return cls(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                   cfg["intermediate_size"], cfg["num_hidden_layers"])


def rms_norm_rescale(weight: torch.Tensor, eps: float, new_hidden: int) -> tuple[torch.Tensor, float]:
    """(weight', eps') of an RMSNorm over `new_hidden` coordinates whose extra ones are zero, giving the
    original norm's output on the original coordinates (derivation in the module docstring)."""
    return norm_weight(weight, new_hidden), eps * weight.numel() / new_hidden


def norm_weight(weight: torch.Tensor, new_hidden: int) -> torch.Tensor:
    """weight sqrt(H/H') on the original coordinates, zero on the extra ones (whose inputs are zero)."""
    out = torch.zeros(new_hidden, dtype=weight.dtype)
    out[: weight.numel()] = weight * math.sqrt(weight.numel() / new_hidden)
    return out


def qk_gain(hidden: int, new_hidden: int) -> float:
    """Factor on q_proj/k_proj so that q_norm/k_norm (head_dim, eps' = eps H/H') give the original output."""
    return math.sqrt(hidden / new_hidden)


def layer_positions(n_src: int, n_dst: int) -> list[int]:
    """New index of each source layer: interleaved, first at 0, strictly increasing."""
    if n_dst < n_src:
        raise ValueError(f"cannot narrow {n_src} layers to {n_dst}")
    return [i * n_dst // n_src for i in range(n_src)]


def pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` in the leading corner of a zero tensor of `shape`."""
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def check_widening(src: Dims, dst: Dims) -> None:
    grow = ("hidden", "heads", "kv_heads", "intermediate", "layers")
    if any(getattr(dst, f) < getattr(src, f) for f in grow):
        raise ValueError(f"every dimension must grow or stay: {src} -> {dst}")
    if dst.head_dim != src.head_dim:
        raise ValueError("head_dim must stay the source's (RoPE and the softmax scale depend on it)")
    if dst.heads * src.kv_heads != src.heads * dst.kv_heads:
        raise ValueError(f"the q/kv head ratio must stay {src.heads}/{src.kv_heads}: got {dst.heads}/{dst.kv_heads}")


def widen_layer(w: dict[str, torch.Tensor], src: Dims, dst: Dims) -> dict[str, torch.Tensor]:
    """A source decoder layer (names relative to the layer, e.g. 'self_attn.q_proj.weight') widened."""
    H, hd, g = dst.hidden, dst.head_dim, qk_gain(src.hidden, dst.hidden)
    out = {
        "self_attn.q_proj.weight": pad(w["self_attn.q_proj.weight"] * g, (dst.heads * hd, H)),
        "self_attn.k_proj.weight": pad(w["self_attn.k_proj.weight"] * g, (dst.kv_heads * hd, H)),
        "self_attn.v_proj.weight": pad(w["self_attn.v_proj.weight"], (dst.kv_heads * hd, H)),
        "self_attn.o_proj.weight": pad(w["self_attn.o_proj.weight"], (H, dst.heads * hd)),
        "self_attn.q_norm.weight": w["self_attn.q_norm.weight"].clone(),
        "self_attn.k_norm.weight": w["self_attn.k_norm.weight"].clone(),
        "mlp.gate_proj.weight": pad(w["mlp.gate_proj.weight"], (dst.intermediate, H)),
        "mlp.up_proj.weight": pad(w["mlp.up_proj.weight"], (dst.intermediate, H)),
        "mlp.down_proj.weight": pad(w["mlp.down_proj.weight"], (H, dst.intermediate)),
    }
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[name] = norm_weight(w[name], H)
    return out


def identity_layer(dst: Dims, q_norm: torch.Tensor, k_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """A decoder layer whose every projection is zero: the identity on the residual stream."""
    H, hd, I = dst.hidden, dst.head_dim, dst.intermediate
    return {
        "self_attn.q_proj.weight": torch.zeros(dst.heads * hd, H),
        "self_attn.k_proj.weight": torch.zeros(dst.kv_heads * hd, H),
        "self_attn.v_proj.weight": torch.zeros(dst.kv_heads * hd, H),
        "self_attn.o_proj.weight": torch.zeros(H, dst.heads * hd),
        "self_attn.q_norm.weight": q_norm.clone(),
        "self_attn.k_norm.weight": k_norm.clone(),
        "mlp.gate_proj.weight": torch.zeros(I, H),
        "mlp.up_proj.weight": torch.zeros(I, H),
        "mlp.down_proj.weight": torch.zeros(H, I),
        "input_layernorm.weight": torch.ones(H),
        "post_attention_layernorm.weight": torch.ones(H),
    }


def widened_layers(sd: dict[str, torch.Tensor], prefix: str, src: Dims, dst: Dims) -> Iterator[dict[str, torch.Tensor]]:
    """The widened model's layers in order, full names (`prefix` + 'layers.i.'), one layer at a time."""
    at = {p: i for i, p in enumerate(layer_positions(src.layers, dst.layers))}
    first = f"{prefix}layers.0.self_attn."
    q_norm, k_norm = sd[first + "q_norm.weight"], sd[first + "k_norm.weight"]
    for j in range(dst.layers):
        if j in at:
            head = f"{prefix}layers.{at[j]}."
            layer = widen_layer({k[len(head):]: v for k, v in sd.items() if k.startswith(head)}, src, dst)
        else:
            layer = identity_layer(dst, q_norm, k_norm)
        yield {f"{prefix}layers.{j}.{k}": v for k, v in layer.items()}


def widen_target(sd: dict[str, torch.Tensor], cfg: dict, shape: Shape) -> tuple[Callable[[], Iterator[dict]], dict]:
    """(a generator of the widened target's tensors in groups, its config) from the source's."""
    src = Dims.of(cfg)
    dst = Dims(shape.hidden, shape.heads, shape.kv_heads, src.head_dim, shape.intermediate, shape.target_layers)
    check_widening(src, dst)
    V = sd["model.embed_tokens.weight"].shape[0]

    def tensors() -> Iterator[dict[str, torch.Tensor]]:
        yield {
            "model.embed_tokens.weight": pad(sd["model.embed_tokens.weight"], (V, dst.hidden)),
            "lm_head.weight": pad(sd["lm_head.weight"], (V, dst.hidden)),
            "model.norm.weight": norm_weight(sd["model.norm.weight"], dst.hidden),
        }
        yield from widened_layers(sd, "model.", src, dst)

    return tensors, widened_config(cfg, dst)


def widen_draft(sd: dict[str, torch.Tensor], cfg: dict, shape: Shape, target_cfg: dict) -> tuple[dict, dict]:
    """(the widened draft's tensors, its config). `target_cfg` is the SOURCE target's config."""
    src = Dims.of(cfg)
    dst = Dims(shape.hidden, shape.heads, shape.kv_heads, src.head_dim, shape.intermediate, shape.draft_layers)
    check_widening(src, dst)
    if src.hidden != target_cfg["hidden_size"]:
        raise ValueError("the draft's hidden size must be the target's")
    k_norms = [sd[f"layers.{i}.self_attn.k_norm.weight"] for i in range(src.layers)]
    if any(not torch.equal(k, k_norms[0]) for k in k_norms):
        raise ValueError("the draft's k_norm weights differ across layers: vLLM's CPU path would apply layer 0's")
    ids = cfg["dflash_config"]["target_layer_ids"]
    H, Hn = src.hidden, dst.hidden
    fc = torch.zeros(Hn, len(ids) * Hn)
    for j in range(len(ids)):
        fc[:H, j * Hn : j * Hn + H] = sd["fc.weight"][:, j * H : (j + 1) * H]
    out = {
        "fc.weight": fc,
        "hidden_norm.weight": norm_weight(sd["hidden_norm.weight"], Hn),
        "norm.weight": norm_weight(sd["norm.weight"], Hn),
    }
    for layer in widened_layers(sd, "", src, dst):
        out.update(layer)
    new_cfg = widened_config(cfg, dst)
    positions = layer_positions(target_cfg["num_hidden_layers"], shape.target_layers)
    new_cfg["num_target_layers"] = shape.target_layers
    new_cfg["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": [positions[i] for i in ids]}
    return out, new_cfg


def widened_config(cfg: dict, dst: Dims) -> dict:
    new = dict(cfg)
    new.update(
        hidden_size=dst.hidden, num_attention_heads=dst.heads, num_key_value_heads=dst.kv_heads,
        intermediate_size=dst.intermediate, num_hidden_layers=dst.layers,
        # one eps for every norm (see qk_gain for the per-head ones)
        rms_norm_eps=cfg["rms_norm_eps"] * cfg["hidden_size"] / dst.hidden,
    )
    if "layer_types" in cfg:
        if set(cfg["layer_types"]) != {"full_attention"}:
            raise ValueError("only full-attention layers are widened")
        new["layer_types"] = ["full_attention"] * dst.layers
    new["max_window_layers"] = max(cfg.get("max_window_layers", 0), dst.layers)
    return new


def write_config(cfg: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def write_sharded(groups: Iterator[dict[str, torch.Tensor]], out_dir: str, shard_bytes: int = SHARD_BYTES) -> int:
    """Write tensor groups as model.safetensors, or as shards + model.safetensors.index.json when they
    exceed `shard_bytes` (HF's layout; peak memory about one shard). Returns the parameter count."""
    from safetensors.torch import save_file

    parts: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = params = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            save_file(shard, os.path.join(out_dir, f"part-{len(parts)}.tmp"), metadata={"format": "pt"})
            parts.append(list(shard))
            shard, size = {}, 0

    for group in groups:
        group_bytes = sum(t.numel() * t.element_size() for t in group.values())
        if shard and size + group_bytes > shard_bytes:
            flush()
        shard.update({k: v.contiguous() for k, v in group.items()})
        size += group_bytes
        params += sum(t.numel() for t in group.values())
    flush()
    if len(parts) == 1:
        os.replace(os.path.join(out_dir, "part-0.tmp"), os.path.join(out_dir, "model.safetensors"))
        return params
    weight_map = {}
    for i, names in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(os.path.join(out_dir, f"part-{i}.tmp"), os.path.join(out_dir, name))
        weight_map.update({n: name for n in names})
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in set(weight_map.values()))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return params


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _source_digest(pair_dir: str) -> dict[str, str]:
    files = [os.path.join(m, f) for m in ("target", "draft") for f in ("config.json", "model.safetensors")]
    return {f: _sha256(os.path.join(pair_dir, f)) for f in files}


def _read(model_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        return load_file(os.path.join(model_dir, "model.safetensors")), json.load(f)


def widen_pair(pair_dir: str, out_dir: str, shape: Shape, force: bool = False) -> dict:
    """Widen the pair in `pair_dir` (target/, draft/, heldout_prompts.json) into `out_dir`; returns the
    record also written as out_dir/widen.json (written last: a folder without it is incomplete)."""
    stamp = os.path.join(out_dir, "widen.json")
    want = {"version": WIDEN_VERSION, "shape": asdict(shape), "source": _source_digest(pair_dir)}
    if not force and os.path.exists(stamp):
        with open(stamp) as f:
            record = json.load(f)
        if all(record.get(k) == v for k, v in want.items()):
            return {**record, "skipped": True}
    start = time.perf_counter()
    target_sd, target_cfg = _read(os.path.join(pair_dir, "target"))
    draft_sd, draft_cfg = _read(os.path.join(pair_dir, "draft"))
    for sub in ("target", "draft"):
        shutil.rmtree(os.path.join(out_dir, sub), ignore_errors=True)
        os.makedirs(os.path.join(out_dir, sub))
    if os.path.exists(stamp):
        os.remove(stamp)

    tensors, cfg = widen_target(target_sd, target_cfg, shape)
    target_params = write_sharded(tensors(), os.path.join(out_dir, "target"))
    write_config(cfg, os.path.join(out_dir, "target"))
    for name in COPIED_TARGET_FILES:
        shutil.copy(os.path.join(pair_dir, "target", name), os.path.join(out_dir, "target", name))

    # the draft stays one model.safetensors (the reference's `load_pair` reads that file)
    draft_tensors, cfg = widen_draft(draft_sd, draft_cfg, shape, target_cfg)
    draft_params = write_sharded(iter([draft_tensors]), os.path.join(out_dir, "draft"), shard_bytes=2**62)
    write_config(cfg, os.path.join(out_dir, "draft"))
    shutil.copy(os.path.join(pair_dir, "heldout_prompts.json"), os.path.join(out_dir, "heldout_prompts.json"))

    record = {**want, "target_parameters": target_params, "draft_parameters": draft_params,
              "target_layer_ids": cfg["dflash_config"]["target_layer_ids"], "rms_norm_eps": cfg["rms_norm_eps"],
              "seconds": round(time.perf_counter() - start, 2)}
    with open(stamp, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return {**record, "skipped": False}


def default_out(size: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vllm_ddtree", "pairs", size)


def widened_pair_paths(size: str, out_dir: str | None = None) -> tuple[str, str]:
    """(target_dir, draft_dir) of the shipped pair widened to `size`, built on first use."""
    from vllm_ddtree.demo import PAIR_DIR

    out_dir = out_dir or default_out(size)
    widen_pair(PAIR_DIR, out_dir, SIZES[size])
    return os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")


def main(argv: list[str] | None = None) -> dict:
    from vllm_ddtree.demo import PAIR_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--out", default=None, help="output folder (default: ~/.cache/vllm_ddtree/pairs/<size>)")
    ap.add_argument("--pair", default=PAIR_DIR, help="source pair folder (default: the shipped pair)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the output is up to date")
    args = ap.parse_args(argv)
    out_dir = args.out or default_out(args.size)
    record = widen_pair(args.pair, out_dir, SIZES[args.size], force=args.force)
    state = "up to date" if record["skipped"] else f"written in {record['seconds']} s"
    print(f"{out_dir}: {state}; target {record['target_parameters'] / 1e6:.1f}M parameters, "
          f"draft {record['draft_parameters'] / 1e6:.1f}M, target_layer_ids {record['target_layer_ids']}, "
          f"rms_norm_eps {record['rms_norm_eps']:.3g}")
    return record


if __name__ == "__main__":
    main()
