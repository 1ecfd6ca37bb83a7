"""Method 'ddtree' in a real vLLM engine whose attention is our TRITON_ATTN subclass: greedy output
equals plain decoding through the same backend.

vLLM's CPU platform always picks CPU_ATTN, so the test registers our Triton backend in its place
(`triton_on_cpu.py`) and runs the CPU runner with the GPU runner's attention hooks; everything the GPU
layer adds then runs inside the engine on CPU, in Triton's interpreter: the builder on the engine's
real config, the runner's masks into its persistent buffers (uniform verify batches and mixed ones
while a chunked prefill goes on), vLLM's kernel and ours in every target layer, the DFlash draft's
non-causal pass through the same backend, and K/V compaction on the logical cache. (vLLM's Triton
KV writer asks for the CUDA capability: answered with 9.0, a stand-in.)

Runs only in a process started with TRITON_INTERPRET=1 (tests/test_interpreter_process.py starts one).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in its own TRITON_INTERPRET=1 process (tests/test_interpreter_process.py)", allow_module_level=True)

from tests.gpu.triton_cpu_backend import register_cpu_backend_stand_in

register_cpu_backend_stand_in()
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

from unittest import mock  # noqa: E402

import torch  # noqa: E402

from tests.e2e.conftest import prompts, run_engine  # noqa: E402 - also sets the in-process engine env
from tests.e2e.pairs import build_pair  # noqa: E402
from tests.gpu.triton_on_cpu import BACKEND, DDTreeTritonCPUModelRunner  # noqa: E402
from vllm_ddtree.vllm import plugin  # noqa: E402
from vllm_ddtree.vllm.tree_verify import TreeVerifyBuffers  # noqa: E402
from vllm_ddtree.vllm.triton_attention import DDTreeTritonAttentionImpl  # noqa: E402
from vllm_ddtree.vllm.v1 import cpu_runner  # noqa: E402

PROMPT_LENGTHS = (7, 20, 45)  # 72 prompt tokens > 64 per step: the last prefill shares steps with verifies
MAX_TOKENS = 16
BUDGET = 16  # wide enough that accepted paths leave the first chain (the focused pair's draft top-1 is often wrong)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(plain, ddtree) runs through our Triton backend, and the layouts of every tree the runner filled."""
    from vllm import SamplingParams

    target, draft = build_pair(str(tmp_path_factory.mktemp("pair")), focused=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    layouts: list[str] = []
    fill = TreeVerifyBuffers.fill

    def recording_fill(self, rows, seq_lens, block_table, uniform):
        layouts.append("uniform" if uniform else "gather")
        return fill(self, rows, seq_lens, block_table, uniform)

    spec = {"method": "ddtree", "model": draft, "num_speculative_tokens": BUDGET, "ddtree_adaptive": False}
    with (
        mock.patch.object(plugin, "ATTENTION_BACKEND", BACKEND),
        mock.patch.object(cpu_runner, "DDTreeCPUModelRunner", DDTreeTritonCPUModelRunner),
        mock.patch.object(torch.cuda, "get_device_capability", lambda *args: (9, 0)),
        mock.patch.object(TreeVerifyBuffers, "fill", recording_fill),
        mock.patch.object(DDTreeTritonAttentionImpl, "forward", side_effect=DDTreeTritonAttentionImpl.forward, autospec=True) as forward,
    ):
        plain = run_engine(target, None, prompts(PROMPT_LENGTHS), params)
        plain_calls = forward.call_count
        tree = run_engine(target, spec, prompts(PROMPT_LENGTHS), params)
    return plain, tree, layouts, plain_calls


def test_greedy_ddtree_on_our_triton_backend_equals_plain_decoding(runs):
    plain, tree, _, plain_calls = runs
    assert plain_calls > 0  # the engines really ran our Triton attention
    assert tree.token_ids == plain.token_ids


def test_the_engine_verified_branching_trees_in_both_layouts_and_compacted_kv(runs):
    _, tree, layouts, _ = runs
    assert {"uniform", "gather"} <= set(layouts), layouts
    off_chain = [bool(((nodes >= 0) & (nodes != torch.arange(nodes.shape[1]))).any()) for nodes in (s.acceptance.accepted_nodes for s in tree.steps)]
    assert sum(off_chain) >= 5  # accepted nodes off the first chain: their K/V moved before the next step read it
