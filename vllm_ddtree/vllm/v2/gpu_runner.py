"""The CUDA layer of method 'ddtree' on vLLM's V2 model runner: V2's `GPUModelRunner` with the
platform-neutral V2 hooks (`v2/runner.py`). The target's attention is our TRITON_ATTN subclass, as on V1:
the tree masks go into its builder's persistent `TreeVerifyBuffers` (`tree_verify.py`), in the uniform
layout when every request of the batch has the tree width's rows (the shape of V2's FULL decode graphs,
whose capture `build_for_cudagraph_capture` gives causal chains over the same buffers) and in the gather
layout otherwise; K/V rows move by index copies on the logical paged cache (`kv_rows.py`), fixed-shape
and without waiting on the device.

Not run on a GPU yet (docs/v2_runner.md, section 6): the CPU suite runs these hooks inside a V2 engine
through Triton's interpreter (tests/v2/test_v2_triton_layer.py).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.model_executor.layers.attention import Attention
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm_ddtree.vllm.kv_rows import move_slots
from vllm_ddtree.vllm.tree_step import TreeRows
from vllm_ddtree.vllm.tree_verify import is_uniform
from vllm_ddtree.vllm.triton_attention import DDTreeTritonAttentionMetadata, check_tree_target
from vllm_ddtree.vllm.v2.runner import DDTreeV2RunnerMixin


class DDTreeV2TritonMixin(DDTreeV2RunnerMixin):
    """The V2 hooks with TRITON_ATTN's platform layer, over any V2 runner class (the CPU suite puts it
    over V2's CPU runner to run it in the interpreter)."""

    @override
    def _attach_tree_attention(self, attn_metadata: dict[str, Any], rows: TreeRows, block_tables: tuple[torch.Tensor, ...]) -> None:
        batch = self._step_batch
        query_start_loc = batch.query_start_loc_np[: batch.num_reqs + 1]
        width = rows.valid.shape[1]
        for metadata in {id(m): m for m in attn_metadata.values()}.values():  # each group's metadata once
            assert isinstance(metadata, DDTreeTritonAttentionMetadata) and metadata.tree_buffers is not None
            uniform = is_uniform(query_start_loc, width, metadata.seq_lens.shape[0], metadata.num_actual_tokens)
            metadata.tree = metadata.tree_buffers.fill(rows, metadata.seq_lens, metadata.block_table, uniform)

    @override
    def _move_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        layers = self._target_attention_layers()
        device = layers[0].kv_cache.device
        src, dst = src_slots.to(device, non_blocking=True), dst_slots.to(device, non_blocking=True)
        caches = {layer.kv_cache.data_ptr(): layer.kv_cache for layer in layers}  # KV sharing: once
        for kv_cache in caches.values():
            move_slots(kv_cache, src, dst)

    @override
    def _check_target_attention(self, layer: Attention) -> None:
        check_tree_target(layer, self.model_config.is_mm_prefix_lm)


class DDTreeV2GPUModelRunner(DDTreeV2TritonMixin, GPUModelRunner):
    """V2's CUDA runner with the DDTree hooks (`DDTreeV2TritonMixin`)."""
