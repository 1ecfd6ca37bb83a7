"""The traps of tree verification on vLLM's V2 model runner, each watched inside a running engine
(docs/v2_runner.md, F1-F3, D1-D3): the target's forward sees RoPE positions start + depth at every
branching tree's rows on every step (steps after rejections included), read from the persistent
positions buffer; the host's starts equal the device's counts; the tree rows reach the tree kernel; and
the check has power: with the tree masks left off (causal attention over the verify rows), the tokens
change.

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.v2.engines import ddtree, run  # noqa: E402
from vllm_ddtree.vllm.attention import DDTreeCPUAttentionImpl, DDTreeCPUAttentionMetadata  # noqa: E402
from vllm_ddtree.vllm.v2.runner import DDTreeV2RunnerMixin  # noqa: E402


class Recorder:
    """What the engine's hooks saw, in step order: per target forward the step, its positions and
    whether they are the persistent buffer; per step the host and device counts; per attention call
    (target layers) whether it carried tree masks."""

    def __init__(self) -> None:
        self.forwards: list[tuple[Any, torch.Tensor, bool]] = []
        self.counts: list[tuple[list[int], list[int]]] = []
        self.tree_calls: list[tuple[int, bool]] = []  # (index of the forward, metadata carries a tree)
        self.draft_layers: set[str] = set()


def _recording(recorder: Recorder):
    load_model, prepare_inputs, attend = DDTreeV2RunnerMixin.load_model, DDTreeV2RunnerMixin.prepare_inputs, DDTreeCPUAttentionImpl.forward

    def recording_load_model(runner, *args, **kwargs):
        load_model(runner, *args, **kwargs)
        recorder.draft_layers = set(runner.speculator.draft_attn_layer_names)
        buffer = runner.input_buffers.positions

        def before_forward(module, args, kwargs):
            if runner.step is not None:
                positions = kwargs["positions"]
                recorder.forwards.append((runner.step, positions.clone(), positions.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()))

        runner.model.register_forward_pre_hook(before_forward, with_kwargs=True)

    def recording_prepare_inputs(runner, *args, **kwargs):
        batch = prepare_inputs(runner, *args, **kwargs)
        device = runner.req_states.num_computed_tokens.gpu[batch.idx_mapping]
        recorder.counts.append((batch.num_computed_tokens_np.tolist(), device.tolist()))
        return batch

    def recording_attend(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if recorder.forwards and layer.layer_name not in recorder.draft_layers:
            recorder.tree_calls.append((len(recorder.forwards) - 1, getattr(attn_metadata, "tree", None) is not None))
        return attend(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    return (
        mock.patch.object(DDTreeV2RunnerMixin, "load_model", recording_load_model),
        mock.patch.object(DDTreeV2RunnerMixin, "prepare_inputs", recording_prepare_inputs),
        mock.patch.object(DDTreeCPUAttentionImpl, "forward", recording_attend),
    )


@pytest.fixture(scope="module")
def recorded():
    recorder = Recorder()
    load, prepare, attend = _recording(recorder)
    with load, prepare, attend:
        trees = run("v2", ddtree())
    with mock.patch.object(DDTreeCPUAttentionMetadata, "attach_tree", lambda self, tree, rows: None):
        causal = run("v2", ddtree())
    return recorder, trees, causal


def _branching_forwards(recorder: Recorder) -> list[tuple[int, Any, torch.Tensor, bool]]:
    return [(i, step, positions, is_buffer) for i, (step, positions, is_buffer) in enumerate(recorder.forwards) if step.has_branching]


def test_rope_positions_are_start_plus_depth_on_every_step(recorded):
    recorder, trees, _ = recorded
    branching = _branching_forwards(recorder)
    assert len(branching) >= 5
    rejected = sum(int((step.acceptance.accepted_nodes.sum(1) < step.num_drafts).sum()) for _, step, _, _ in branching)
    assert rejected > 0  # positions after steps with rejected nodes are checked too
    for _, step, positions, _ in branching:
        valid = step.tree.valid
        expected = (step.starts.unsqueeze(1) + step.tree.depths)[valid]
        assert torch.equal(positions[step.node_rows()[valid]], expected)


def test_positions_written_into_the_persistent_buffer(recorded):
    recorder, _, _ = recorded
    assert recorder.forwards and all(is_buffer for _, _, is_buffer in recorder.forwards)


def test_host_starts_equal_device_counts(recorded):
    recorder, _, _ = recorded
    assert len(recorder.counts) >= len(recorder.forwards) > 0
    for host, device in recorder.counts:
        assert host == device


def test_branching_rows_reach_the_tree_kernel(recorded):
    recorder, _, _ = recorded
    for index, step, _, _ in _branching_forwards(recorder):
        calls = [has_tree for i, has_tree in recorder.tree_calls if i == index]
        assert calls and all(calls), (index, calls)


def test_a_causal_mask_would_change_the_tokens(recorded):
    _, trees, causal = recorded
    assert causal.token_ids != trees.token_ids
