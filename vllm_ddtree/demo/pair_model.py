"""The demo pair's models in plain PyTorch: a KV-cached Qwen3 decoder over an HF checkpoint's weights
(with the DFlash context features) and the DFlash draft, each computing exactly what vLLM 0.32 computes
(``qwen3.py``, ``qwen3_dflash.py``). Training (``train_pair``), the reference loop (``reference``) and the
widening test use them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vllm_ddtree.demo.train_pair import Recipe

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
        eps = cfg.rms_norm_eps  # one epsilon for every norm, as HF and vLLM Qwen3
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = rope_cos_sin(torch.arange(start, start + T), hd, self.theta)
        x = F.embedding(ids, self.embed)
        feats = []
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["input_layernorm.weight"], eps)
            q = rms_norm((h @ w["self_attn.q_proj.weight"].T).view(B, T, nh, hd), w["self_attn.q_norm.weight"], eps)
            k = rms_norm((h @ w["self_attn.k_proj.weight"].T).view(B, T, nkv, hd), w["self_attn.k_norm.weight"], eps)
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
            h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
            x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
            if i in self.feature_layers:
                feats.append(x)
        logits = rms_norm(x, self.norm, eps) @ self.lm_head.T
        return logits, torch.cat(feats, dim=-1)


class DraftLayer(nn.Module):
    """One Qwen3 decoder layer; parameter names equal the checkpoint's ``layers.i.*``."""

    def __init__(self, d: int, nh: int, nkv: int, hd: int, inter: int, eps: float = 1e-6):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * hd, d, bias=False)
        self.self_attn.q_norm = _Norm(hd, eps)
        self.self_attn.k_norm = _Norm(hd, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, inter, bias=False)
        self.mlp.up_proj = nn.Linear(d, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, d, bias=False)
        self.input_layernorm = _Norm(d, eps)
        self.post_attention_layernorm = _Norm(d, eps)


class _Norm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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

    def __init__(self, r: Recipe, eps: float = 1e-6):
        super().__init__()
        d = r.hidden
        self.r = r
        self.fc = nn.Linear(len(r.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = _Norm(d, eps)
        self.layers = nn.ModuleList(
            DraftLayer(d, r.heads, r.kv_heads, r.head_dim, r.intermediate, eps) for _ in range(r.draft_layers)
        )
        self.norm = _Norm(d, eps)
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
