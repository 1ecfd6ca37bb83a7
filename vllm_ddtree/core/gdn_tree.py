"""Tree verification for a Gated DeltaNet (GDN) layer: the short causal convolution and the gated delta
rule run over a draft tree instead of a chain, batched over requests.

A GDN layer carries two pieces of per-request state between steps: the last W-1 inputs of its depthwise
causal convolution (W = kernel width) and a recurrent state S [Hv, dk, dv] per value head. On a chain,
token t reads the state left by token t-1. On a tree, node i must see exactly what sequential decoding
of its root-to-node path would: so
- its convolution window is the last W inputs of (committed history ++ x along root .. i): its nearest
  ancestors first, then the history once the path runs out;
- its recurrent state is the gated delta rule applied to its parent's state (the root's parent is the
  committed state).
The math per node (Qwen3-Next / FLA `fused_sigmoid_gating_delta_rule_update`, head h, k head h // (Hv/Hk)):
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    q = l2norm(q) / sqrt(dk),  k = l2norm(k)
    S = S_parent * exp(g);  S = S + k (beta (v - k^T S))^T;  o = q^T S
Everything is computed in float32. The scan goes depth by depth: the nodes of one depth (across the
batch) read their parents' states, which the previous depth wrote; a depth's nodes are updated together
in chunks sized to stay in cache (`CHUNK_STATE_BYTES`), so small layers take max_depth + 1 batched
updates and large ones (a full state per node is megabytes) one update per node, at a chain's cost per
token.

Tree tensors follow `DraftTree`: parents [R, N] (-1 for the root and padded nodes), depths [R, N]; a
padded node is treated as a root (its output and state are never read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


CHUNK_STATE_BYTES = 1 << 20
"""Nodes are updated in chunks of about this many bytes of float32 state, which stay in cache across the
update's passes (one node of a 32-head x 128 x 128 layer, 2 MiB, is its own chunk: chunks of several
such nodes fall out of cache and cost more per node; `benchmarks/gdn_tree_scan.py` times the sizes)."""


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), float32, shaped like `a`/`b` [..., Hv]: the log decay and the write strength."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, torch.sigmoid(b.float())


def ancestor_table(parents: torch.Tensor, span: int) -> torch.Tensor:
    """[R, N, span] long: column j is node i's j-th ancestor (j = 0: i itself), -1 above the root."""
    table = [torch.arange(parents.shape[1], device=parents.device).expand_as(parents)]
    for _ in range(1, span):
        above = table[-1]
        table.append(torch.where(above >= 0, parents.gather(1, above.clamp(min=0)), -1))
    return torch.stack(table, dim=2)


def tree_causal_conv1d(
    x: torch.Tensor,
    history: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """Depthwise causal convolution of every node over its ancestors, then the committed history.

    Args:
        x: [R, N, C] the layer's conv inputs, one row per node.
        history: [R, C, W-1] the committed inputs before the root, oldest first.
        parents, depths: [R, N] the trees.
        weight: [C, W] (the current input multiplies weight[:, W-1], as in `F.conv1d` over a causal pad).
        bias: [C] or None.
    Returns:
        [R, N, C] float32.
    """
    num_req, num_nodes, channels = x.shape
    width = weight.shape[1]
    # Window column u (0 .. W-1, oldest first) holds the (W-1-u)-th ancestor; past the root it reads
    # history column W-1 + depth - (W-1-u). Sources index cat(history, x) along time.
    distance = torch.arange(width - 1, -1, -1, device=x.device)  # [W]
    ancestors = ancestor_table(parents, width).flip(2)  # [R, N, W], oldest first
    from_history = (width - 1) + depths.unsqueeze(2) - distance
    source = torch.where(ancestors >= 0, (width - 1) + ancestors, from_history.clamp(min=0))
    timeline = torch.cat([history.float().transpose(1, 2), x.float()], dim=1)  # [R, W-1+N, C]
    windows = timeline.gather(1, source.view(num_req, -1, 1).expand(-1, -1, channels)).view(num_req, num_nodes, width, channels)
    out = torch.einsum("rnwc,cw->rnc", windows, weight.float())
    if bias is not None:
        out = out + bias.float()
    return F.silu(out) if silu else out


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a batch of trees.

    Args:
        q, k: [R, N, Hk, dk]; v: [R, N, Hv, dv] with Hv a multiple of Hk.
        g, beta: [R, N, Hv] log decay and write strength (see `gdn_gating`).
        parents, depths: [R, N] the trees.
        initial_state: [R, Hv, dk, dv] the committed state (the root's parent).
    Returns:
        (out [R, N, Hv, dv], states [R, N, Hv, dk, dv]), float32: node i's output and the state after it.
    """
    num_req, num_nodes, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = (q * k_dim**-0.5).repeat_interleave(v_heads // k_heads, dim=2).flatten(0, 1)
    k = k.repeat_interleave(v_heads // k_heads, dim=2).flatten(0, 1)  # [R*N, Hv, dk]
    initial = initial_state.float()
    v, g, beta = v.float().flatten(0, 1), g.float().flatten(0, 1), beta.float().flatten(0, 1)

    states = torch.empty(num_req * num_nodes, v_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    out = torch.empty(num_req * num_nodes, v_heads, v_dim, dtype=torch.float32, device=q.device)
    flat_parent = torch.where(parents >= 0, parents + num_nodes * torch.arange(num_req, device=q.device).view(-1, 1), -1).flatten()
    flat_depth = depths.flatten()
    request_of = torch.arange(num_req, device=q.device).repeat_interleave(num_nodes)
    nodes_per_chunk = max(1, CHUNK_STATE_BYTES // (4 * v_heads * k_dim * v_dim))
    for depth in range(int(flat_depth.max()) + 1):
        level = (flat_depth == depth).nonzero().squeeze(1)
        for nodes in level.split(nodes_per_chunk):
            parent = initial[request_of[nodes]] if depth == 0 else states[flat_parent[nodes]]
            decay = g[nodes].exp()[..., None]  # [n, Hv, 1]
            kn, qn = k[nodes], q[nodes]
            # With S = decay * S_p + k delta^T: k^T (decay S_p) = decay (k^T S_p), q^T S = decay (q^T S_p) + (q.k) delta.
            delta = (v[nodes] - decay * torch.einsum("nhk,nhkv->nhv", kn, parent)) * beta[nodes].unsqueeze(-1)
            out[nodes] = decay * torch.einsum("nhk,nhkv->nhv", qn, parent) + (qn * kn).sum(-1, keepdim=True) * delta
            states[nodes] = parent.mul_(decay.unsqueeze(-1)).add_(kn.unsqueeze(-1) * delta.unsqueeze(-2))
    return out.view(num_req, num_nodes, v_heads, v_dim), states.view(num_req, num_nodes, v_heads, k_dim, v_dim)
