"""The CUDA layer of method 'ddtree' on vLLM's V2 model runner, run on CPU: a V2 engine whose runner has
the V2 CUDA hooks (`v2/gpu_runner.DDTreeV2TritonMixin`, over V2's CPU runner: `triton_on_cpu.py`) and
whose attention is our TRITON_ATTN subclass (registered in CPU_ATTN's place), in Triton's interpreter.
Greedy output equals plain decoding through the same backend (a V1 engine, the baseline); the runner
filled the builder's persistent tree buffers in both layouts (uniform verify batches, and gather ones
while the longest prompt's prefill shares steps with verifies); accepted paths off the first chain had
their K/V moved on the logical paged cache (`kv_rows.move_slots`); the draft's top-K came from the
persistent buffers `sample_draft` writes. (vLLM's Triton KV writer asks for the CUDA capability:
answered with 9.0, a stand-in.)

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

from tests.v2.engines import interpreted_module

interpreted_module()

from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.gpu.triton_on_cpu import BACKEND  # noqa: E402
from tests.v2.engines import ddtree, run  # noqa: E402
from tests.v2.triton_on_cpu import DDTreeV2TritonCPUModelRunner  # noqa: E402
from vllm_ddtree.vllm import plugin  # noqa: E402
from vllm_ddtree.vllm.tree_verify import TreeVerifyBuffers  # noqa: E402
from vllm_ddtree.vllm.triton_attention import DDTreeTritonAttentionImpl  # noqa: E402
from vllm_ddtree.vllm.v2 import cpu_runner, gpu_runner  # noqa: E402
from vllm_ddtree.vllm.v2.speculator import DDTreeSpeculator  # noqa: E402

LENGTHS = (7, 20, 45)  # 72 prompt tokens > CHUNK: the last prefill shares steps with verifies
CHUNK = 64  # three requests' verify rows (3 x 17) fit one step: uniform batches
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def runs():
    """(plain V1, ddtree V2) through our Triton backend; the layouts of every tree the runner filled; the
    K/V moves (rows per call); the address of the draft's top-K buffer at each propose."""
    layouts: list[str] = []
    moves: list[int] = []
    top_buffers: list[int] = []
    fill, move, propose = TreeVerifyBuffers.fill, gpu_runner.move_slots, DDTreeSpeculator.propose

    def recording_fill(self, rows, seq_lens, block_table, uniform):
        layouts.append("uniform" if uniform else "gather")
        return fill(self, rows, seq_lens, block_table, uniform)

    def recording_move(kv_cache, src_slots, dst_slots):
        moves.append(int(src_slots.numel()))
        return move(kv_cache, src_slots, dst_slots)

    def recording_propose(speculator, *args, **kwargs):
        top_buffers.append(speculator.top_logprobs.data_ptr())
        return propose(speculator, *args, **kwargs)

    with (
        mock.patch.object(plugin, "ATTENTION_BACKEND", BACKEND),
        mock.patch.object(cpu_runner, "DDTreeV2CPUModelRunner", DDTreeV2TritonCPUModelRunner),
        mock.patch.object(torch.cuda, "get_device_capability", lambda *args: (9, 0)),
        mock.patch.object(TreeVerifyBuffers, "fill", recording_fill),
        mock.patch.object(gpu_runner, "move_slots", recording_move),
        mock.patch.object(DDTreeSpeculator, "propose", recording_propose),
        mock.patch.object(DDTreeTritonAttentionImpl, "forward", side_effect=DDTreeTritonAttentionImpl.forward, autospec=True) as forward,
    ):
        plain = run("v1", None, max_tokens=MAX_TOKENS, lengths=LENGTHS, max_num_batched_tokens=CHUNK)
        plain_calls = forward.call_count
        tree = run("v2", ddtree(), max_tokens=MAX_TOKENS, lengths=LENGTHS, max_num_batched_tokens=CHUNK)
    return {"plain": plain, "tree": tree, "plain calls": plain_calls, "layouts": layouts, "moves": moves, "top buffers": top_buffers}


def test_greedy_trees_on_the_v2_cuda_layer_equal_plain_decoding(runs):
    assert runs["plain calls"] > 0  # the engines really ran our Triton attention
    assert runs["tree"].token_ids == runs["plain"].token_ids


def test_the_runner_filled_the_tree_buffers_in_both_layouts(runs):
    assert {"uniform", "gather"} <= set(runs["layouts"]), runs["layouts"]


def test_accepted_paths_off_the_first_chain_moved_their_kv_on_the_logical_cache(runs):
    steps = runs["tree"].steps
    off_chain = [bool(((nodes >= 0) & (nodes != torch.arange(nodes.shape[1]))).any()) for nodes in (s.acceptance.accepted_nodes for s in steps)]
    assert sum(off_chain) >= 3 and runs["moves"] and min(runs["moves"]) > 0, (sum(off_chain), runs["moves"])


def test_the_draft_top_k_stays_in_one_persistent_buffer(runs):
    assert len(runs["top buffers"]) >= 5 and len(set(runs["top buffers"])) == 1  # what a FULL draft graph replays into
