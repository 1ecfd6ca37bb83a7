"""One-shot GPU check of the tree-verify attention kernel: correctness, CUDA graphs, speed vs roofline.

Runs with torch + triton only (no vLLM), in one go of at most ~8 minutes on one H200:
1. calibration: copy bandwidth (one big tensor copy, read + write bytes) and bf16 matmul rate;
2. at Qwen3-8B attention shapes (32 q heads, 8 kv heads, head 128, bf16, KV block 16, NHD cache) for
   context {1k, 8k, 32k} x budget {16, 64, 128} x batch {1, 16}: kernel vs the fp32 torch reference
   (plus contexts 0 and 100, correctness only: with long prefixes a tree-mask error hides under the
   prefix's weight), then kernel and dense-SDPA-baseline timings (CUDA events, medians, L2 flushed before each rep);
   roofline = max(bytes / copy bandwidth, flops / matmul rate), bytes = the K/V, queries and outputs
   the problem must touch once, flops = 4 * Hq * D * N * seq_len per request (masked tree keys counted);
3. CUDA graph: capture, change lengths / masks / queries in place, replay == eager (bitwise); K/V
   compaction (`kv_rows.move_slots`) captured and replayed with new slots (`gpu_step_check.py`);
   the core's step ops at 16 requests x budget 64 x vocabulary 151,936 with their host syncs counted
   (target: <= 0.2 ms all together, zero syncs; reported, not enforced);
4. small config sweeps at the target shapes (row tile, key tile, warps, stages; prefix splits at batch 1).
Targets (context 8k, budget 64, batch 16): kernel <= 1.6x its roofline time and >= 3x faster than the
dense masked SDPA baseline (SDPA over pre-gathered, head-expanded K/V with a boolean mask).

Prints a table and writes gpu_check.json to $OUT (default ./gpu_check_out). Exit status 1 if any
correctness check fails; performance targets are reported, not enforced.

    python3 benchmarks/gpu_check.py            # GPU
    python3 benchmarks/gpu_check.py --smoke    # CPU, Triton interpreter, tiny fp32 shapes, no CUDA graph
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; the kernels run on CPU

import argparse
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, without installing it

from vllm_ddtree.kernels.problems import TreeVerifyProblem, make_problem
from vllm_ddtree.kernels.tree_attention import TreeAttentionConfig, default_config, tree_attention
from vllm_ddtree.kernels.tree_attention_reference import tree_attention_reference
from vllm_ddtree.kernels.tree_mask import pack_tree_mask

from gpu_step_check import kv_compaction_graph, step_ops  # noqa: E402 - beside this script


@dataclass(frozen=True)
class Shapes:
    num_kv_heads: int
    group: int
    head_size: int
    kv_block_size: int
    dtype: torch.dtype
    contexts: tuple[int, ...]
    budgets: tuple[int, ...]
    batches: tuple[int, ...]
    target: tuple[int, int, int]  # (context, budget, batch) the performance targets refer to
    atol: float
    rtol: float
    tree_contexts: tuple[int, ...]  # correctness only: short prefixes, where the tree keys dominate the output


GPU_SHAPES = Shapes(8, 4, 128, 16, torch.bfloat16, (1024, 8192, 32768), (16, 64, 128), (1, 16), (8192, 64, 16), 4e-3, 1.6e-2, (0, 100))
SMOKE_SHAPES = Shapes(2, 2, 32, 16, torch.float32, (0, 37), (4, 12), (1, 2), (37, 12, 2), 1e-5, 1e-5, (5,))
GPU_SWEEP = [
    TreeAttentionConfig(128, 64, 8, 3),
    TreeAttentionConfig(128, 64, 8, 2),
    TreeAttentionConfig(128, 64, 8, 4),
    TreeAttentionConfig(128, 32, 8, 3),
    TreeAttentionConfig(128, 128, 8, 2),
    TreeAttentionConfig(64, 64, 4, 3),
    TreeAttentionConfig(64, 128, 4, 3),
    TreeAttentionConfig(64, 64, 4, 4),
]
SPLIT_SWEEP = (1, 4, 8, 16, 32)
TARGET_ROOFLINE_RATIO = 1.6
TARGET_SPEEDUP_VS_SDPA = 3.0
TARGET_STEP_OPS_MS = 0.2  # the core's step ops at 16 requests x budget 64, all together, with zero host syncs


class Clock:
    """Median wall time of a callable: CUDA events with L2 flushed before each rep on GPU,
    perf_counter on CPU (smoke mode: exercises the code path, numbers meaningless)."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def median_ms(self, fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(self.reps):
            if self.flush is None:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
                continue
            self.flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        return statistics.median(times)


def calibrate(device: torch.device, clock: Clock, smoke: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s."""
    numel, size = (1 << 20, 256) if smoke else (1 << 30, 8192)  # 2 GiB bf16 copy; 8192^3 matmul
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = clock.median_ms(lambda: dst.copy_(src))
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = clock.median_ms(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * src.numel() * src.element_size() / (copy_ms * 1e-3), "matmul_flop_per_s": 2 * size**3 / (mm_ms * 1e-3)}


def build(shapes: Shapes, context: int, budget: int, batch: int, device: torch.device, seed: int, dead_fraction: float = 0.1) -> TreeVerifyProblem:
    return make_problem(
        [context] * batch, budget, shapes.num_kv_heads, shapes.group, shapes.head_size, shapes.kv_block_size, shapes.dtype,
        device=device, layout="NHD", seed=seed, dead_fraction=dead_fraction,
    )  # fmt: skip


def close(out: torch.Tensor, reference: torch.Tensor, shapes: Shapes) -> bool:
    """Kernel output within the dtype's tolerance of the fp32 reference (rounded to the same dtype)."""
    return bool(torch.allclose(out.float(), reference.float(), atol=shapes.atol, rtol=shapes.rtol))


def run_kernel(problem: TreeVerifyProblem, config: TreeAttentionConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    p = problem
    return tree_attention(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.mask_bits, p.scale, out=out, config=config)


def run_reference(problem: TreeVerifyProblem) -> torch.Tensor:
    p = problem
    return tree_attention_reference(p.query, p.key_cache, p.value_cache, p.block_table, p.seq_lens, p.tree_mask, p.scale)


def gather_dense(problem: TreeVerifyProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Baseline inputs, all requests of equal length L: q [R, Hq, N, D], k/v [R, Hq, L, D] (kv heads
    repeated per group), boolean mask [R, 1, N, L]."""
    p = problem
    num_req, num_nodes, num_q_heads, _ = p.query.shape
    length = int(p.seq_lens[0])
    positions = torch.arange(length, device=p.query.device)
    blocks = p.block_table[:, positions // p.key_cache.shape[1]].long()
    offsets = (positions % p.key_cache.shape[1]).expand(num_req, length)
    group = num_q_heads // p.key_cache.shape[2]
    k = p.key_cache[blocks, offsets].transpose(1, 2).repeat_interleave(group, dim=1)
    v = p.value_cache[blocks, offsets].transpose(1, 2).repeat_interleave(group, dim=1)
    prefix = torch.ones((num_req, num_nodes, length - num_nodes), dtype=torch.bool, device=p.query.device)
    mask = torch.cat([prefix, p.tree_mask], dim=2).unsqueeze(1)
    return p.query.transpose(1, 2), k, v, mask


def dense_sdpa(problem: TreeVerifyProblem) -> torch.Tensor:
    q, k, v, mask = gather_dense(problem)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=problem.scale).transpose(1, 2)


def roofline(problem: TreeVerifyProblem, calibration: dict[str, float]) -> dict[str, float]:
    p = problem
    _, num_nodes, num_q_heads, head_size = p.query.shape
    tokens = int(p.seq_lens.sum())
    elem = p.query.element_size()
    bytes_moved = tokens * p.key_cache.shape[2] * head_size * 2 * elem + 2 * p.query.numel() * elem
    flops = 4 * num_q_heads * head_size * num_nodes * tokens
    memory_s, compute_s = bytes_moved / calibration["copy_bytes_per_s"], flops / calibration["matmul_flop_per_s"]
    return {"bytes": bytes_moved, "flops": flops, "roofline_ms": max(memory_s, compute_s) * 1e3, "bound": "memory" if memory_s >= compute_s else "compute"}


def check_case(shapes: Shapes, context: int, budget: int, batch: int, device: torch.device, clock: Clock, calibration: dict[str, float], timed: bool) -> dict:
    started = time.monotonic()
    problem = build(shapes, context, budget, batch, device, seed=context + budget + batch)
    out = run_kernel(problem)
    reference = run_reference(problem)
    error = (out.float() - reference.float()).abs().max().item()
    row = {"context": context, "budget": budget, "batch": batch, "config": asdict(default_config(budget + 1, shapes.group, shapes.head_size, shapes.dtype)),
           "max_abs_err": error, "correct": close(out, reference, shapes)}  # fmt: skip
    if timed:
        kernel_ms = clock.median_ms(lambda: run_kernel(problem, out=out))
        q, k, v, mask = gather_dense(problem)
        sdpa_ms = clock.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=problem.scale))
        del q, k, v, mask
        gather_sdpa_ms = clock.median_ms(lambda: dense_sdpa(problem))
        roof = roofline(problem, calibration)
        row.update(roof, kernel_ms=kernel_ms, sdpa_ms=sdpa_ms, gather_sdpa_ms=gather_sdpa_ms,
                   achieved_bytes_per_s=roof["bytes"] / (kernel_ms * 1e-3), achieved_flop_per_s=roof["flops"] / (kernel_ms * 1e-3),
                   roofline_ratio=kernel_ms / roof["roofline_ms"], speedup_vs_sdpa=sdpa_ms / kernel_ms)  # fmt: skip
    row["seconds"] = time.monotonic() - started  # includes compiling a new kernel variant
    return row


def check_cuda_graph(shapes: Shapes, device: torch.device, context: int, budget: int, batch: int) -> dict:
    """Capture one launch, then change queries, lengths (shorter prefixes, within the block table)
    and tree masks in place; the replay must equal an eager launch on the new inputs bitwise."""
    problem = build(shapes, context, budget, batch, device, seed=11)
    out = torch.empty_like(problem.query)
    run_kernel(problem, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(problem, out=out)
    other = build(shapes, context, budget, batch, device, seed=12, dead_fraction=0.5)
    shorter = torch.randint(0, context + 1, (batch,), generator=torch.Generator().manual_seed(13)).to(device=device, dtype=torch.int32)
    problem.query.copy_(other.query)
    problem.seq_lens.copy_(shorter + budget + 1)
    problem.mask_bits.copy_(pack_tree_mask(other.tree_mask))
    graph.replay()
    torch.cuda.synchronize()
    eager = run_kernel(problem)
    reference = run_reference(replace(problem, tree_mask=other.tree_mask))
    error = (eager.float() - reference.float()).abs().max().item()
    return {"context": context, "budget": budget, "batch": batch, "replay_equals_eager": bool(torch.equal(out, eager)),
            "eager_max_abs_err": error, "correct": bool(torch.equal(out, eager)) and close(eager, reference, shapes)}  # fmt: skip


def sweep(shapes: Shapes, device: torch.device, clock: Clock, context: int, budget: int, batch: int, configs: list[TreeAttentionConfig]) -> list[dict]:
    problem = build(shapes, context, budget, batch, device, seed=21)
    reference = run_reference(problem)
    rows = []
    for config in configs:
        try:
            out = run_kernel(problem, config)
        except (triton.CompilationError, OutOfResources, RuntimeError) as error:  # a config that does not fit is a result, not a failure
            rows.append({"config": asdict(config), "error": str(error).splitlines()[0][:200]})
            continue
        error = (out.float() - reference.float()).abs().max().item()
        kernel_ms = clock.median_ms(lambda config=config, out=out: run_kernel(problem, config, out))
        rows.append({"config": asdict(config), "max_abs_err": error, "correct": close(out, reference, shapes), "kernel_ms": kernel_ms})
    return rows


TABLE_HEADER = (f"{'ctx':>6} {'budget':>6} {'batch':>5} {'err':>8} {'ok':>3} {'kernel ms':>9} {'roof ms':>8} {'bound':>7} "
                f"{'x roof':>6} {'sdpa ms':>8} {'x sdpa':>6} {'TB/s':>6} {'TFLOP/s':>7}")  # fmt: skip


def table_row(r: dict) -> str:
    timing = ""
    if "kernel_ms" in r:
        timing = (f"{r['kernel_ms']:9.3f} {r['roofline_ms']:8.3f} {r['bound']:>7} {r['roofline_ratio']:6.2f} {r['sdpa_ms']:8.3f} "
                  f"{r['speedup_vs_sdpa']:6.2f} {r['achieved_bytes_per_s'] / 1e12:6.2f} {r['achieved_flop_per_s'] / 1e12:7.1f}")  # fmt: skip
    return f"{r['context']:6d} {r['budget']:6d} {r['batch']:5d} {r['max_abs_err']:8.1e} {'yes' if r['correct'] else 'NO':>3} {timing}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run under TRITON_INTERPRET=1 (no CUDA graph)")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="output folder (default $OUT or ./gpu_check_out)")
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds after which timings and sweeps are skipped")
    args = parser.parse_args()
    started = time.monotonic()
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device; use --smoke on CPU")
    device = torch.device("cpu" if smoke else "cuda")
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    clock = Clock(device, reps=1 if smoke else 20)
    result: dict = {
        "mode": "smoke" if smoke else "gpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if not smoke else platform.processor() or "cpu",
        "shapes": {k: str(v) for k, v in asdict(shapes).items()},
    }
    result["calibration"] = calibrate(device, clock, smoke)
    print(f"calibration: copy {result['calibration']['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {result['calibration']['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s")

    def in_time() -> bool:
        return time.monotonic() - started < args.time_limit

    target = shapes.target
    combos = [target] + [c for c in itertools.product(shapes.contexts, shapes.budgets, shapes.batches) if c != target]
    tree_combos = list(itertools.product(shapes.tree_contexts, shapes.budgets, shapes.batches))
    result["cases"] = []
    print(TABLE_HEADER)
    for context, budget, batch in combos + tree_combos:
        timed = (context, budget, batch) in combos and in_time()
        row = check_case(shapes, context, budget, batch, device, clock, result["calibration"], timed=timed)
        result["cases"].append(row)
        print(table_row(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not smoke:
        result["cuda_graph"] = [check_cuda_graph(shapes, device, *case) for case in ((8192, 64, 16), (8192, 64, 1))]
        print("cuda graph:", result["cuda_graph"])
        result["kv_compaction_graph"] = kv_compaction_graph(device)
        print("K/V compaction in a CUDA graph:", result["kv_compaction_graph"])
    result["step_ops"] = step_ops(device, clock.median_ms, smoke)
    for name, row in result["step_ops"].items():
        print(f"step op {name:34s} {row['ms']:8.3f} ms  {row['syncs']} host syncs")
    target_context, target_budget, target_batch = target
    if in_time():
        result["sweep_configs"] = sweep(shapes, device, clock, *target, GPU_SWEEP if not smoke else [TreeAttentionConfig(16, 16, 4, 1)])
        base = default_config(target_budget + 1, shapes.group, shapes.head_size, shapes.dtype)
        splits = [replace(base, num_splits=s) for s in (SPLIT_SWEEP if not smoke else (1, 2))]
        result["sweep_splits_batch1"] = sweep(shapes, device, clock, shapes.contexts[-1], target_budget, 1, splits)
        for name in ("sweep_configs", "sweep_splits_batch1"):
            for row in result[name]:
                print(name, row)

    target_row = result["cases"][0]
    result["targets"] = {
        "case": {"context": target_context, "budget": target_budget, "batch": target_batch},
        "roofline_ratio": target_row.get("roofline_ratio"),
        "meets_roofline_target": target_row.get("roofline_ratio", float("inf")) <= TARGET_ROOFLINE_RATIO,
        "speedup_vs_sdpa": target_row.get("speedup_vs_sdpa"),
        "meets_sdpa_target": target_row.get("speedup_vs_sdpa", 0.0) >= TARGET_SPEEDUP_VS_SDPA,
        "step_ops_ms": sum(row["ms"] for row in result["step_ops"].values()),
        "step_ops_host_syncs": sum(row["syncs"] for row in result["step_ops"].values()),
    }
    result["targets"]["meets_step_ops_target"] = (
        result["targets"]["step_ops_ms"] <= TARGET_STEP_OPS_MS and result["targets"]["step_ops_host_syncs"] == 0
    )
    checks = [r["correct"] for r in result["cases"] + result.get("cuda_graph", []) + [result.get("kv_compaction_graph", {"correct": True})]]
    checks += [r.get("correct", True) for r in result.get("sweep_configs", []) + result.get("sweep_splits_batch1", [])]
    result["all_correct"] = all(checks)
    result["seconds"] = time.monotonic() - started
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    print("targets:", result["targets"])
    print(f"all correct: {result['all_correct']}; {result['seconds']:.0f} s; wrote {out_dir / 'gpu_check.json'}")
    return 0 if result["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
