"""The CUDA layer of method 'ddtree': vLLM's V1 `GPUModelRunner` with the platform-neutral DDTree hooks.

CUDA specifics, and nothing else: this step's KV slots live in the block table's device slot mapping
(`.cpu` is not filled there); the target's attention is our TRITON_ATTN subclass, whose builder owns
the persistent tree buffers the masks go into (`tree_verify.py`); K/V rows move by index copies on the
logical paged cache (`kv_rows.py`), fixed-shape and without waiting on the host.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.vllm.kv_rows import move_slots
from vllm_ddtree.vllm.v1.runner import DDTreeRunnerMixin
from vllm_ddtree.vllm.tree_step import TreeRows
from vllm_ddtree.vllm.tree_verify import is_uniform
from vllm_ddtree.vllm.triton_attention import DDTreeTritonAttentionMetadata, check_tree_target


class DDTreeGPUModelRunner(DDTreeRunnerMixin, GPUModelRunner):
    @override
    def _step_slot_mapping(self) -> torch.Tensor:
        return self.input_batch.block_table[self.attention_group].slot_mapping.gpu

    @override
    def _attach_tree_attention(self, attn_metadata: dict[str, Any], rows: TreeRows) -> None:
        query_start_loc = self.query_start_loc.np[: self.input_batch.num_reqs + 1]
        for metadata in {id(m): m for m in attn_metadata.values()}.values():
            if isinstance(metadata, GDNAttentionMetadata):
                continue  # a hybrid target's GDN layers: their trees come from `gdn.attach_gdn_trees`
            assert isinstance(metadata, DDTreeTritonAttentionMetadata) and metadata.tree_buffers is not None
            width, num_padded = rows.valid.shape[1], metadata.seq_lens.shape[0]
            uniform = is_uniform(query_start_loc, width, num_padded, metadata.num_actual_tokens)
            metadata.tree = metadata.tree_buffers.fill(rows, metadata.seq_lens, metadata.block_table, uniform)

    @override
    def _move_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        caches = {layer.kv_cache.data_ptr(): layer.kv_cache for layer in self._target_attention_layers()}  # KV sharing: once
        for kv_cache in caches.values():
            move_slots(kv_cache, src_slots, dst_slots)

    @override
    def _check_target_attention(self, layer: Attention) -> None:
        check_tree_target(layer, self.is_mm_prefix_lm)
