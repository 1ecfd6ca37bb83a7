"""The kernels compile for Hopper (sm_90a) on a machine without a GPU, as the launcher would launch them.

The interpreter runs the kernel's Python, not Triton's compiler: type or shape errors that only the
compiler sees (a constexpr branch returning different shapes, say) pass the interpreter tests. This
compiles the launcher's own constexprs ahead of time with the ptxas bundled in the triton wheel and
checks what matters for speed: tensor-core wgmma, software-pipelined async copies of the K/V tiles,
shared memory within an H100/H200 SM (227 KiB), and (almost) no register spills.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles kernels; this process interprets them", allow_module_level=True)

# import_module, not `import ... as`: the package re-exports a function of the module's name
compiled_module = importlib.import_module("vllm_ddtree.kernels.tree_attention")

HOPPER = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def cuobjdump_path() -> str | None:
    tool = getattr(getattr(triton.knobs, "nvidia", None), "cuobjdump", None)
    path = getattr(tool, "path", None)
    return path if path and Path(path).exists() else None


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK (spill frame) / SHARED of the cubin's kernel, from `cuobjdump --dump-resource-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([cuobjdump_path(), "--dump-resource-usage", file.name], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def compile_for_hopper(fn, pointer_types: dict[str, str], float_args: set[str], constants: dict, num_warps: int, num_stages: int):
    """Compile like a launch with 16-byte aligned tensors and strides divisible by 16 (what the JIT
    specialises on for real caches with head sizes that are multiples of 16)."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in float_args:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith(("stride_q", "stride_k", "stride_v", "stride_o")):
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs the NVIDIA tools bundled with the triton wheel")
@pytest.mark.parametrize(
    ("dtype", "num_nodes", "num_kv_heads", "group", "head_size", "split"),
    [
        (torch.bfloat16, 65, 8, 4, 128, True),  # Qwen3-8B, budget 64: 2 x 128 rows + 16-row tail; batch 1 splits
        (torch.bfloat16, 33, 4, 2, 256, False),  # head size 256: 64-row tiles
    ],
)
def test_tree_attention_kernel_compiles_for_hopper_with_wgmma_pipelining_and_few_spills(dtype, num_nodes, num_kv_heads, group, head_size, split):
    module = compiled_module
    config = module.default_config(num_nodes, group, head_size, dtype)
    constants = module.kernel_constants(num_nodes, num_kv_heads, group, head_size, 16, dtype, config, split)
    kv = "*" + TRITON_DTYPES[dtype]
    pointers = {"q_ptr": kv, "k_cache_ptr": kv, "v_cache_ptr": kv, "out_ptr": kv, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                "mask_bits_ptr": "*i32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32"}  # fmt: skip
    kernel = compile_for_hopper(module._tree_attention_kernel, pointers, {"scale_log2e"}, constants, config.num_warps, config.num_stages)
    usage = resource_usage(kernel.asm["cubin"])
    assert kernel.metadata.shared <= MAX_SHARED_BYTES
    assert "wgmma.mma_async" in kernel.asm["ptx"], "no tensor-core wgmma"
    assert "async_copy_global_to_local" in kernel.asm["ttgir"], "K/V loads are not software-pipelined"
    assert usage["STACK"] <= 256, f"register spills: {usage}"


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs the NVIDIA tools bundled with the triton wheel")
def test_merge_splits_kernel_compiles_for_hopper():
    constants = {"NUM_NODES": 65, "NUM_Q_HEADS": 32, "HEAD_SIZE": 128, "HEAD_PAD": 128, "SPLITS_PAD": 16}
    pointers = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "out_ptr": "*bf16"}
    kernel = compile_for_hopper(compiled_module._merge_splits_kernel, pointers, set(), constants, num_warps=4, num_stages=1)
    assert resource_usage(kernel.asm["cubin"])["STACK"] == 0
