"""The CPU layer of method 'ddtree': vLLM's `CPUModelRunner` with the platform-neutral DDTree hooks.

CPU specifics, and nothing else: this step's KV slots live in the block table's `.cpu` slot mapping;
the target's attention is our CPU_ATTN subclass (`DDTreeCPUAttentionImpl`), whose metadata carries the
tree masks; K/V rows move through the ISA-specific layout of CPU_ATTN's paged cache (`paged_kv`).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_ddtree.vllm import cpu_tree_kernel, paged_kv
from vllm_ddtree.vllm.attention import DDTreeCPUAttentionImpl, DDTreeCPUAttentionMetadata, TreeAttention, warn_unless_float32
from vllm_ddtree.vllm.paged_kv import LayerRows
from vllm_ddtree.vllm.v1.runner import DDTreeRunnerMixin
from vllm_ddtree.vllm.tree_step import TreeRows


class DDTreeCPUModelRunner(DDTreeRunnerMixin, CPUModelRunner):
    @override
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        cpu_tree_kernel.warm_up()  # compiled now, not in the first steps the budget policy times
        paged_kv.warm_up()
        warn_unless_float32(self.model_config.dtype)

    @override
    def _step_slot_mapping(self) -> torch.Tensor:
        # `.gpu`, the buffer vLLM's slot-mapping kernel writes: CPUModelRunner aliases it to `.cpu`, except
        # in an input batch vLLM rebuilds for a hybrid target's block sizes (`may_reinitialize_input_batch`).
        return self.input_batch.block_table[self.attention_group].slot_mapping.gpu

    @override
    def _attach_tree_attention(self, attn_metadata: dict[str, Any], rows: TreeRows) -> None:
        block_table = self.input_batch.block_table[self.attention_group]
        tree = TreeAttention.build(rows, block_table.get_cpu_tensor(), block_table.block_size)
        layers = attn_metadata.values()
        for metadata in dict(zip(map(id, layers), layers)).values():  # each group's metadata once
            if isinstance(metadata, GDNAttentionMetadata):
                continue  # a hybrid target's GDN layers: their trees come from `gdn.attach_gdn_trees`
            assert isinstance(metadata, DDTreeCPUAttentionMetadata)
            metadata.attach_tree(tree, rows)

    _moves_kv_on_host = True

    @override
    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        self._kv_row_caches = None

    _kv_row_caches: LayerRows | None = None
    """Every target attention layer's cache (`paged_kv.LayerRows`, built at the first move after the
    caches are bound)."""

    @override
    def _move_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        if self._kv_row_caches is None:
            self._kv_row_caches = LayerRows(self._target_attention_layers())
        self._kv_row_caches.move(src_slots, dst_slots)

    @override
    def _check_target_attention(self, layer: Attention) -> None:
        if not isinstance(layer.impl, DDTreeCPUAttentionImpl):
            raise NotImplementedError("method 'ddtree' needs vLLM's CPU_ATTN attention backend for the target")
        layer.impl.check_tree_support()
