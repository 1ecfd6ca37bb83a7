"""Method 'ddtree' on hybrid targets whose recurrent layers are Gated DeltaNet (Qwen3-Next) on CPU.

vLLM verifies a chain in a GDN layer with one recurrent-state slot per draft position (the spec columns
of the request's block-table row in the layer's KV cache group) and one rolling conv buffer per request
(column 0); `vllm_ddtree.core.gdn_state` states that layout. Here a tree step runs in that layout:
- verify (`tree_spec_forward`, replacing vLLM's CPU `_spec_forward` for the spec-decode requests of a
  'ddtree' step): node i's conv window is its ancestors then the committed history, its recurrent state
  is computed from its parent's and stored in spec column i (`core.gdn_tree`). Every spec-decode request
  of a 'ddtree' engine takes this path, chains and zero-draft decodes included, so the conv buffer always
  holds window token k at column W-2+k whatever the step's width, and the next step reads the history
  at column num_accepted - 1. That is vLLM's own layout: vLLM 0.32's chain path keeps it for windows of
  num_speculative_tokens + 1 tokens (a 'ddtree' step's width varies, hence this path for all of them);
  vLLM 0.33's writes `B[:, :W-2+q] = [history[1:], window]` for every width q, which is
  `core.write_conv_window_` column for column, and runs its native kernel only on full-length windows,
  where it appends at the same columns (`mamba/ops/cpu/gdn_attention.py`, `_spec_forward`; read from the
  0.33.0 wheel; `_spec_forward`'s signature and the helpers imported below are in the recorded surfaces);
- after the walk (`compact_gdn_states`, next to the attention KV compaction): the accepted path's conv
  inputs and its last state move to where vLLM's num_accepted logic reads them next step.
Prefills and other non-speculative rows stay on vLLM's path. The trees reach the layers on their
attention metadata (`attach_gdn_trees` sets `GDNTREES_ATTR` on each GDN metadata object of the step).
The layer's caches and conv weight are read through vLLM's own helpers (`_conv_buffer_view`,
`_unpacked_conv_weight`: the weight is packed in place on CPUs with bf16 dot products and vLLM keeps an
unpacked copy for its spec path), so both paths read them alike.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _conv_buffer_view, _unpacked_conv_weight
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

from vllm_ddtree.core import (
    DraftTree,
    TreeAcceptance,
    compact_conv_windows_,
    compact_recurrent_states_,
    gdn_gating,
    read_conv_history,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    write_conv_window_,
)

GDNTREES_ATTR = "ddtree_trees"
"""Attribute of a step's `GDNAttentionMetadata` holding its spec-decode requests' `GDNTrees`."""


@dataclass(frozen=True)
class GDNTrees:
    """The trees of a step's spec-decode requests, in the order of vLLM's GDN spec metadata
    (`spec_query_start_loc`): parents, depths [S, N] (`DraftTree` conventions)."""

    parents: torch.Tensor
    depths: torch.Tensor


def kv_cache_group_kinds(kv_cache_config: Any) -> tuple[int, list[int]]:
    """(the attention group's index, the GDN groups' indices); raises unless the groups are exactly one
    attention group (target and draft attention) plus recurrent-state groups."""
    attention = [g for g, group in enumerate(kv_cache_config.kv_cache_groups) if isinstance(group.kv_cache_spec, AttentionSpec)]
    recurrent = [g for g, group in enumerate(kv_cache_config.kv_cache_groups) if isinstance(group.kv_cache_spec, MambaSpec)]
    if len(attention) != 1 or len(attention) + len(recurrent) != len(kv_cache_config.kv_cache_groups):
        raise NotImplementedError(
            "method 'ddtree' needs the target and draft attention in one KV cache group, plus Gated DeltaNet "
            f"state groups for hybrid targets; got {[type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]} "
            "(sliding-window and other hybrid layouts are not supported)"
        )
    return attention[0], recurrent


def attach_gdn_trees(attn_metadata: dict[str, Any], tree: DraftTree, num_reqs: int) -> None:
    """Give every GDN metadata object of the step the trees of its spec-decode requests (none without)."""
    for metadata in {id(m): m for m in attn_metadata.values()}.values():
        if isinstance(metadata, GDNAttentionMetadata) and metadata.spec_sequence_masks_cpu is not None:
            rows = metadata.spec_sequence_masks_cpu[:num_reqs].nonzero().squeeze(1)
            setattr(metadata, GDNTREES_ATTR, GDNTrees(tree.parents[rows], tree.depths[rows]))


def tree_spec_forward(
    layer: Any,
    metadata: GDNAttentionMetadata,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_buf: torch.Tensor,
    ssm_state: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The GDN core for the spec-decode tokens of a 'ddtree' step, as trees.

    mixed_qkv [T, C], b, a [T, Hv]: the spec tokens in `spec_query_start_loc` order (request j's window
    rows, node i at row i); conv_buf (num_slots, C, L), ssm_state (num_slots, Hv, dk, dv): the layer's
    caches. Returns the core attention output [T, Hv, dv] in mixed_qkv's dtype.
    """
    trees: GDNTrees = getattr(metadata, GDNTREES_ATTR)
    num_spec = metadata.num_spec_decodes
    bounds = metadata.spec_query_start_loc[: num_spec + 1].long()
    lengths = bounds.diff()
    width_nodes = int(lengths.max())
    real = torch.arange(width_nodes).view(1, -1) < lengths.view(-1, 1)  # [S, N]: the window's rows
    token_rows = (bounds[:-1].view(-1, 1) + torch.arange(width_nodes)).masked_fill(~real, 0)
    parents = torch.where(real, trees.parents[:, :width_nodes], -1)
    depths = torch.where(real, trees.depths[:, :width_nodes], 0)
    slots = metadata.spec_state_indices_tensor[:num_spec].long()
    num_accepted = metadata.num_accepted_tokens[:num_spec].long()

    x = mixed_qkv[token_rows]  # [S, N, C]
    history = read_conv_history(conv_buf, slots[:, 0], num_accepted, width)
    conv_out = tree_causal_conv1d(x, history, parents, depths, _unpacked_conv_weight(layer), layer.conv1d.bias,
                                  silu=layer.activation == "silu").to(mixed_qkv.dtype)
    write_conv_window_(conv_buf, slots[:, 0], num_accepted, x, width)

    query, key, value = layer.rearrange_mixed_qkv(conv_out.flatten(0, 1))
    shape = (num_spec, width_nodes, -1, query.shape[-1])
    g, beta = gdn_gating(layer.A_log, a[token_rows], b[token_rows], layer.dt_bias)
    initial = ssm_state[slots.gather(1, (num_accepted - 1).view(-1, 1)).squeeze(1)]
    out, states = tree_gated_delta_rule(query.reshape(shape), key.reshape(shape), value.reshape(num_spec, width_nodes, *value.shape[-2:]),
                                        g, beta, parents, depths, initial)
    ssm_state[slots[:, :width_nodes][real]] = states[real].to(ssm_state.dtype)
    return out[real].to(mixed_qkv.dtype)


def compact_gdn_states(runner: Any, recurrent_groups: list[int], acceptance: TreeAcceptance, num_spec: int) -> None:
    """Move each request's accepted path to the chain's columns in every GDN layer (`core.gdn_state`):
    requests whose path is not already a chain prefix only."""
    nodes = acceptance.accepted_nodes
    moved = ((nodes >= 0) & (nodes != torch.arange(nodes.shape[1]))).any(dim=1)
    if not bool(moved.any()):
        return
    rows = moved.nonzero().squeeze(1)
    acceptance = TreeAcceptance(**{f.name: getattr(acceptance, f.name)[rows] for f in fields(TreeAcceptance)})
    forward_context = runner.compilation_config.static_forward_context
    for group in recurrent_groups:
        slots = runner.input_batch.block_table[group].get_cpu_tensor()[rows, : num_spec + 1].long()
        for name in runner.kv_cache_config.kv_cache_groups[group].layer_names:
            layer = forward_context[name]
            compact_conv_windows_(_conv_buffer_view(layer), slots[:, 0], acceptance, _unpacked_conv_weight(layer).shape[-1])
            compact_recurrent_states_(layer.kv_cache[1], slots, acceptance)
