"""The CPU layer of method 'ddtree' on vLLM's V2 model runner: V2's `CPUModelRunner` with the
platform-neutral V2 hooks. Tree masks ride on our CPU_ATTN metadata (the V1 backend classes, which V2
builds unchanged); K/V rows move through CPU_ATTN's paged cache layout (`paged_kv`)."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override
from vllm.model_executor.layers.attention import Attention
from vllm.v1.worker.cpu.model_runner import CPUModelRunner

from vllm_ddtree.vllm import cpu_tree_kernel, paged_kv
from vllm_ddtree.vllm.attention import DDTreeCPUAttentionImpl, DDTreeCPUAttentionMetadata, TreeAttention, warn_unless_float32
from vllm_ddtree.vllm.paged_kv import LayerRows
from vllm_ddtree.vllm.tree_step import TreeRows
from vllm_ddtree.vllm.v2.runner import DDTreeV2RunnerMixin


class DDTreeV2CPUModelRunner(DDTreeV2RunnerMixin, CPUModelRunner):
    _kv_rows: LayerRows | None = None
    """The target attention layers' caches (built at the first move after the caches are bound)."""

    @override
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        cpu_tree_kernel.warm_up()
        paged_kv.warm_up()
        warn_unless_float32(self.model_config.dtype)

    @override
    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        self._kv_rows = None

    @override
    def _attach_tree_attention(self, attn_metadata: dict[str, Any], rows: TreeRows, block_tables: tuple[torch.Tensor, ...]) -> None:
        gid = self._attention_gid
        tree = TreeAttention.build(rows, block_tables[gid], self.block_tables.block_sizes[gid])
        layers = attn_metadata.values()
        for metadata in dict(zip(map(id, layers), layers)).values():  # each group's metadata once
            assert isinstance(metadata, DDTreeCPUAttentionMetadata)
            metadata.attach_tree(tree, rows)

    @override
    def _move_kv_rows(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        if self._kv_rows is None:
            self._kv_rows = LayerRows(self._target_attention_layers())
        self._kv_rows.move(src_slots, dst_slots)

    @override
    def _check_target_attention(self, layer: Attention) -> None:
        if not isinstance(layer.impl, DDTreeCPUAttentionImpl):
            raise NotImplementedError("method 'ddtree' needs vLLM's CPU_ATTN attention backend for the target")
        layer.impl.check_tree_support()
