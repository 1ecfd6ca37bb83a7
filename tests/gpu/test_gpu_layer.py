"""The CUDA layer's parts that need no Triton launch, in this process: the runner's hooks, KV row moves
on vLLM's logical cache (both physical stride orders), the persistent tree buffers' addresses, the
metadata builder, and the refusals. (The attention itself: test_triton_attention_interpreted.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.vllm.v1.gpu_runner import DDTreeGPUModelRunner
from vllm_ddtree.vllm.kv_rows import move_slots
from vllm_ddtree.vllm.v1.runner import DDTreeRunnerMixin
from vllm_ddtree.vllm.tree_step import TreeRows
from vllm_ddtree.vllm.tree_verify import TreeVerifyBuffers, is_uniform
from vllm_ddtree.vllm.triton_attention import (
    DDTreeTritonAttentionBackend,
    DDTreeTritonAttentionImpl,
    DDTreeTritonAttentionMetadata,
    DDTreeTritonAttentionMetadataBuilder,
)

PLATFORM_HOOKS = ("_step_slot_mapping", "_attach_tree_attention", "_move_kv_rows", "_check_target_attention")
BLOCK_SIZE, HEAD_SIZE = 16, 32


# ---- the runner ------------------------------------------------------------------------------------
def test_the_mixin_comes_before_vllms_runner_and_every_platform_hook_is_ours():
    mro = DDTreeGPUModelRunner.__mro__
    assert mro.index(DDTreeRunnerMixin) < mro.index(GPUModelRunner)
    for hook in PLATFORM_HOOKS:
        assert hook in DDTreeGPUModelRunner.__dict__, hook
        assert not hasattr(GPUModelRunner, hook), f"{hook} would shadow a vLLM member"


def test_kv_sharing_layers_move_their_shared_cache_once():
    """Moves that chain (slot 2 -> 1, then 5 -> 2) are right once; a second pass over a shared cache
    would copy node 5's row on to slot 1."""
    cache = torch.randn(2, 2, BLOCK_SIZE, 2 * HEAD_SIZE)
    expected = cache.clone()
    move_slots(expected, torch.tensor([2, 5]), torch.tensor([1, 2]))
    layers = [SimpleNamespace(kv_cache=cache), SimpleNamespace(kv_cache=cache)]
    runner = SimpleNamespace(_target_attention_layers=lambda: layers)
    DDTreeGPUModelRunner._move_kv_rows(runner, torch.tensor([2, 5]), torch.tensor([1, 2]))
    assert torch.equal(cache, expected)


def test_our_backend_stands_in_for_triton_attn_with_our_impl_and_builder():
    assert DDTreeTritonAttentionBackend.get_name() == "TRITON_ATTN"
    assert DDTreeTritonAttentionBackend.get_impl_cls() is DDTreeTritonAttentionImpl
    assert DDTreeTritonAttentionBackend.get_builder_cls() is DDTreeTritonAttentionMetadataBuilder


def test_the_step_slots_are_the_block_tables_device_slot_mapping():
    slot_mapping = SimpleNamespace(cpu=torch.zeros(4), gpu=torch.arange(4))
    other_group = SimpleNamespace(slot_mapping=SimpleNamespace(gpu=torch.zeros(4)))
    block_tables = [other_group, SimpleNamespace(slot_mapping=slot_mapping)]
    runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=block_tables), attention_group=1)  # a hybrid target's
    assert DDTreeGPUModelRunner._step_slot_mapping(runner) is slot_mapping.gpu


def test_a_target_layer_with_our_triton_impl_is_accepted():
    impl = DDTreeTritonAttentionImpl(4, HEAD_SIZE, HEAD_SIZE**-0.5, 2, None, None, "auto")
    DDTreeGPUModelRunner._check_target_attention(SimpleNamespace(is_mm_prefix_lm=False), SimpleNamespace(impl=impl))


def test_target_attention_other_than_our_triton_impl_is_refused():
    layer = SimpleNamespace(impl=object())
    with pytest.raises(NotImplementedError, match="needs vLLM's TRITON_ATTN attention backend"):
        DDTreeGPUModelRunner._check_target_attention(SimpleNamespace(is_mm_prefix_lm=False), layer)


def test_mm_prefix_targets_are_refused():
    impl = DDTreeTritonAttentionImpl(4, HEAD_SIZE, HEAD_SIZE**-0.5, 2, None, None, "auto")
    with pytest.raises(NotImplementedError, match="bidirectional multimodal prefixes .*; use method 'dflash'"):
        DDTreeGPUModelRunner._check_target_attention(SimpleNamespace(is_mm_prefix_lm=True), SimpleNamespace(impl=impl))


@pytest.mark.parametrize(
    "options, named",
    [
        ({"sliding_window": 64}, "sliding-window attention"),
        ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi"),
        ({"logits_soft_cap": 30.0}, "logit soft-capping"),
        ({"sinks": torch.zeros(4)}, "attention sinks"),
        ({"kv_cache_dtype": "fp8"}, "quantized KV cache"),
        ({"kv_cache_dtype": "int8_per_token_head"}, "quantized KV cache"),
    ],
)
def test_layer_options_the_tree_rows_cannot_reproduce_are_refused(options: dict, named: str):
    args = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"} | options
    impl = DDTreeTritonAttentionImpl(4, HEAD_SIZE, HEAD_SIZE**-0.5, 2, **args)
    with pytest.raises(NotImplementedError, match=f"does not support target models with {named}"):
        impl.check_tree_support()


def test_our_impl_never_fuses_output_quantization():
    impl = DDTreeTritonAttentionImpl(4, HEAD_SIZE, HEAD_SIZE**-0.5, 2, None, None, "auto")
    assert impl.fused_output_quant_supported(None) is False


# ---- KV row moves on the logical cache ---------------------------------------------------------------
def logical_cache(layout: str, num_blocks: int = 5, num_kv_heads: int = 2) -> torch.Tensor:
    """vLLM's logical [blocks, Hkv, block_size, 2D] cache with NHD or HND physical strides."""
    gen = torch.Generator().manual_seed(0)
    if layout == "NHD":
        return torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, 2 * HEAD_SIZE, generator=gen).transpose(1, 2)
    return torch.randn(num_blocks, num_kv_heads, BLOCK_SIZE, 2 * HEAD_SIZE, generator=gen)


def token_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[M, Hkv, 2D] keys and values of `slots`, read through the backends' key/value views."""
    key_cache, value_cache = cache.transpose(1, 2).split(HEAD_SIZE, -1)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    return torch.cat([key_cache[blocks, offsets], value_cache[blocks, offsets]], -1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compaction_moves_each_accepted_row_and_nothing_else(layout: str):
    """A plan as the core makes it: two requests' windows (slots 17.. and 40..), accepted paths moved
    to the front; entries past a path are identity moves (src == dst) that no real move writes."""
    cache = logical_cache(layout)
    before = cache.clone()
    src = torch.tensor([17, 19, 22, 24, 40, 41, 45, 43])
    dst = torch.tensor([17, 18, 19, 20, 40, 41, 42, 43])
    move_slots(cache, src, dst)
    assert torch.equal(token_rows(cache, dst), token_rows(before, src))
    untouched = torch.tensor([s for s in range(5 * BLOCK_SIZE) if s not in set(dst.tolist())])
    assert torch.equal(token_rows(cache, untouched), token_rows(before, untouched))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compaction_round_trip_restores_the_cache_and_identity_moves_are_no_ops(layout: str):
    cache = logical_cache(layout)
    before = cache.clone()
    slots = torch.tensor([3, 16, 33, 70])
    move_slots(cache, slots, slots)
    assert torch.equal(cache, before)
    scratch = torch.tensor([5, 50, 51, 79])
    move_slots(cache, slots, scratch)
    move_slots(cache, scratch, slots)
    assert torch.equal(token_rows(cache, slots), token_rows(before, slots))
    assert torch.equal(token_rows(cache, scratch), token_rows(before, slots))


# ---- persistent buffers and the builder ------------------------------------------------------------
def rows_of(num_trees: int, width: int, starts: list[int], first_rows: list[int], req_indices: list[int]) -> TreeRows:
    valid = torch.ones(num_trees, width, dtype=torch.bool)
    valid[0, width - 1 :] = False
    mask = torch.eye(width, dtype=torch.bool).repeat(num_trees, 1, 1)
    mask[:, 1:, 0] = True
    return TreeRows(
        req_indices=torch.tensor(req_indices),
        starts=torch.tensor(starts),
        num_nodes=valid.sum(1),
        valid=valid,
        ancestor_mask=mask,
        node_rows=torch.tensor(first_rows).unsqueeze(1) + torch.where(valid, torch.arange(width), 0),
    )


def tensor_addresses(tree) -> dict[str, int]:
    names = ("mask_bits", "query_rows", "write_nodes", "write_rows", "query_workspace", "out_workspace")
    return {name: getattr(tree, name).data_ptr() for name in names if getattr(tree, name) is not None}


def test_buffers_keep_their_addresses_across_batches_of_different_shapes():
    buffers = TreeVerifyBuffers(8, 6, BLOCK_SIZE, 4, HEAD_SIZE, torch.float32, torch.device("cpu"), pin_memory=False)
    table = torch.arange(1, 1 + 8 * 4, dtype=torch.int32).view(8, 4)
    seen: dict[str, set[int]] = {}
    block_ids, gather_seq_lens = set(), set()
    for num_trees, width in ((2, 4), (3, 6), (1, 2)):  # gather layouts
        rows = rows_of(num_trees, width, [10 * t for t in range(num_trees)], [width * t for t in range(num_trees)], list(range(num_trees)))
        tree = buffers.fill(rows, torch.zeros(5, dtype=torch.int32), table[:5], uniform=False)
        block_ids.add(tree.block_table.data_ptr())
        gather_seq_lens.add(tree.seq_lens.data_ptr())
        for name, address in tensor_addresses(tree).items():
            seen.setdefault(name, set()).add(address)
    for num_req, width in ((4, 5), (8, 6)):  # uniform layouts: vLLM's seq_lens and table, our masks
        seq_lens = torch.full((num_req,), 20, dtype=torch.int32)
        rows = rows_of(1, width, [20 - width], [0], [0])
        tree = buffers.fill(rows, seq_lens, table[:num_req], uniform=True)
        assert tree.seq_lens is seq_lens and tree.query_rows is None
        seen["mask_bits"].add(tree.mask_bits.data_ptr())
        seen["mask_bits"].add(buffers.uniform(seq_lens, table[:num_req], width).mask_bits.data_ptr())
    assert all(len(addresses) == 1 for addresses in seen.values()), seen
    assert len(block_ids) == 1 and len(gather_seq_lens) == 1


def test_buffers_refuse_a_batch_larger_than_they_were_sized_for():
    buffers = TreeVerifyBuffers(2, 4, BLOCK_SIZE, 4, HEAD_SIZE, torch.float32, torch.device("cpu"), pin_memory=False)
    rows = rows_of(3, 4, [0, 0, 0], [0, 4, 8], [0, 1, 2])
    with pytest.raises(ValueError, match="hold 2 requests x 4 nodes, got 3 x 4"):
        buffers.fill(rows, torch.zeros(3, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32), uniform=False)


def test_only_batches_whose_every_request_has_n_rows_are_uniform():
    import numpy as np

    assert is_uniform(np.array([0, 5, 10]), 5, 2, 10)
    assert is_uniform(np.array([0, 5, 10]), 5, 3, 15)  # a padded request with its N padded rows
    assert not is_uniform(np.array([0, 3, 8]), 5, 2, 10)  # 8 real rows padded to 10: rows are not t * N + i
    assert not is_uniform(np.array([0, 5, 10]), 5, 3, 12)


def make_builder(cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE) -> DDTreeTritonAttentionMetadataBuilder:
    """Our builder over a stand-in VllmConfig holding only what TRITON_ATTN's builder reads."""
    model = SimpleNamespace(
        get_num_attention_heads=lambda parallel: 4,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: HEAD_SIZE,
        rswa_window=None,
        dtype=torch.float32,
    )
    config = SimpleNamespace(
        model_config=model,
        parallel_config=None,
        compilation_config=SimpleNamespace(cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=[5, 10, 20], static_forward_context={}),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
    )
    spec = SimpleNamespace(block_size=BLOCK_SIZE)
    return DDTreeTritonAttentionMetadataBuilder(spec, [], config, torch.device("cpu"))


def common(num_reqs: int, query_len: int, causal: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs * query_len,
        max_query_len=query_len,
        max_seq_len=40,
        query_start_loc=torch.arange(0, num_reqs * query_len + 1, query_len, dtype=torch.int32),
        seq_lens=torch.full((num_reqs,), 40, dtype=torch.int32),
        block_table_tensor=torch.ones(num_reqs, 3, dtype=torch.int32),
        slot_mapping=torch.zeros(num_reqs * query_len, dtype=torch.int64),
        causal=causal,
        mm_req_doc_ranges=None,
        rswa_prefix_lens=None,
    )


def test_builder_metadata_carries_the_buffers_and_no_tree():
    builder = make_builder()
    metadata = builder.build(0, common(3, 5))
    assert isinstance(metadata, DDTreeTritonAttentionMetadata) and metadata.tree is None
    assert metadata.tree_buffers is builder.tree_buffers and builder.tree_buffers.max_nodes == 5
    assert torch.equal(metadata.seq_lens, torch.full((3,), 40, dtype=torch.int32))


def test_a_uniform_verify_capture_carries_a_causal_tree_over_the_persistent_masks():
    builder = make_builder()
    captured = builder.build_for_cudagraph_capture(common(2, 5))
    tree = captured.tree
    assert tree is not None and tree.query_rows is None and tree.num_nodes == 5 and tree.num_requests == 2
    assert tree.mask_bits.data_ptr() == builder.tree_buffers.mask_bits.device.data_ptr()
    assert tree.seq_lens is captured.seq_lens and tree.block_table is captured.block_table
    causal = sum(1 << j for j in range(5))
    assert tree.mask_bits[:, 4, 0].tolist() == [causal, causal]


@pytest.mark.parametrize("batch", [common(2, 5, causal=False), common(4, 1), common(2, 3)], ids=["dflash-draft", "decode", "short-verify"])
def test_other_captures_carry_no_tree(batch: SimpleNamespace):
    assert make_builder().build_for_cudagraph_capture(batch).tree is None


def test_a_uniform_verify_build_resets_the_graph_masks_to_causal_under_full_graphs():
    """A replayed FULL graph runs the tree kernel even when a step's trees are all chains (the runner
    attaches nothing then): the build leaves causal masks for it."""
    builder = make_builder()
    builder.tree_buffers.mask_bits.device.fill_(-1)
    builder.build(0, common(3, 5))
    assert builder.tree_buffers.mask_bits.device[:3, 1, 0].tolist() == [3, 3, 3]
    eager = make_builder(CUDAGraphMode.PIECEWISE)
    eager.tree_buffers.mask_bits.device.fill_(-1)
    eager.build(0, common(3, 5))
    assert eager.tree_buffers.mask_bits.device[:3, 1, 0].tolist() == [-1, -1, -1]
