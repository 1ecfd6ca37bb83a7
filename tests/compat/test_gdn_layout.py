"""Our GDN tree verify keeps vLLM's layout: on chains whose window is num_speculative_tokens + 1 tokens
(vLLM's own case), `gdn.tree_spec_forward` leaves the conv buffers exactly and the spec state columns up
to bf16 rounding as vLLM's CPU `_spec_forward` does, with the same outputs, and the next step reads them
alike. vLLM's recurrent kernel is bf16 only; the tree scan's exactness is tests/core/test_gdn_tree.py's.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

K_HEADS, V_HEADS, HEAD_DIM, WIDTH, NUM_SPEC, NUM_REQS = 1, 2, 128, 4, 3, 2
CHANNELS = 2 * K_HEADS * HEAD_DIM + V_HEADS * HEAD_DIM
WINDOW = NUM_SPEC + 1
SLOTS = 1 + NUM_REQS * WINDOW


def fake_layer(gen: torch.Generator) -> SimpleNamespace:
    """The members of a Qwen3-Next GDN layer that the spec paths read, with vLLM's own qkv split."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    layer = SimpleNamespace(
        conv1d=SimpleNamespace(weight=(torch.randn(CHANNELS, 1, WIDTH, generator=gen) * 0.5).bfloat16(), bias=None),
        activation="silu", A_log=torch.randn(V_HEADS, generator=gen).bfloat16(), dt_bias=torch.randn(V_HEADS, generator=gen).bfloat16(),
        tp_size=1, key_dim=K_HEADS * HEAD_DIM, value_dim=V_HEADS * HEAD_DIM, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
    )
    layer.rearrange_mixed_qkv = functools.partial(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    return layer


def chain_metadata(slots: torch.Tensor, num_accepted: torch.Tensor):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from vllm_ddtree.vllm.v1.gdn import GDNTREES_ATTR, GDNTrees

    tokens = NUM_REQS * WINDOW
    metadata = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=NUM_REQS,
        num_spec_decode_tokens=tokens, num_actual_tokens=tokens,
        spec_query_start_loc=torch.arange(0, tokens + 1, WINDOW, dtype=torch.int32),
        spec_state_indices_tensor=slots.int(), num_accepted_tokens=num_accepted.int(),
        spec_sequence_masks_cpu=torch.ones(NUM_REQS, dtype=torch.bool),
    )
    index = torch.arange(WINDOW).expand(NUM_REQS, WINDOW)
    setattr(metadata, GDNTREES_ATTR, GDNTrees(parents=index - 1, depths=index))
    return metadata


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="vLLM's native conv path expects packed weights")
def test_tree_verify_of_chains_matches_vllms_spec_forward_over_two_steps():
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from vllm_ddtree.vllm.v1.gdn import tree_spec_forward

    vllm_spec_forward = getattr(gdn_attention._spec_forward, "__wrapped__", gdn_attention._spec_forward)
    gen = torch.Generator().manual_seed(0)
    layer = fake_layer(gen)
    slots = 1 + torch.randperm(SLOTS - 1, generator=gen).view(NUM_REQS, WINDOW)
    conv = (torch.randn(SLOTS, CHANNELS, WIDTH - 1 + NUM_SPEC, generator=gen)).bfloat16()
    states = (torch.randn(SLOTS, V_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1).bfloat16()
    ours, theirs = (conv.clone(), states.clone()), (conv.clone(), states.clone())
    for num_accepted in (torch.tensor([1, 3]), torch.tensor([4, 2])):
        metadata = chain_metadata(slots, num_accepted)
        x = torch.randn(NUM_REQS * WINDOW, CHANNELS, generator=gen).bfloat16()
        a, b = torch.randn(2, NUM_REQS * WINDOW, V_HEADS, generator=gen).bfloat16()
        expected = vllm_spec_forward(layer, metadata, x, b, a, *theirs, WIDTH, WIDTH - 1 + NUM_SPEC)
        got = tree_spec_forward(layer, metadata, x, b, a, *ours, WIDTH)
        torch.testing.assert_close(got.float(), expected.float().view_as(got), atol=2e-2, rtol=2e-2)
        assert torch.equal(ours[0], theirs[0])  # conv buffers: the same inputs in the same columns
        torch.testing.assert_close(ours[1].float(), theirs[1].float(), atol=2e-2, rtol=2e-2)
