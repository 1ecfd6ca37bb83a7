"""One-shot GPU check of the CUDA layer's own parts that run without vLLM: `tree_verify` and `kv_rows`.

vLLM's CUDA build cannot run on the machines of this project, so the TRITON_ATTN subclass is tested on
CPU only (tests/gpu, Triton interpreter). What it adds on top of vLLM's kernel runs here, with torch +
triton only, in well under a minute on one GPU:
1. layouts: a uniform verify batch (every request N rows, plus a padded request with seq_len 0, as a
   FULL decode graph pads) and a mixed batch (a prefill and a chain whose rows must stay untouched, a
   tree with padded nodes reaching past the block table) at Qwen3-8B per-rank attention shapes (32 q /
   8 kv heads, head 128, bf16, KV block 16), NHD and HND caches: every tree row vs the fp32 torch
   reference;
2. graph: the uniform tree the builder attaches to a FULL-graph capture (`TreeVerifyBuffers.uniform`)
   captured in a CUDA graph, then for three steps the runner's `fill` writes that step's trees and the
   graph replays: equal to eager attention on the same trees (same buffers, so bitwise);
3. syncs: `fill` (both layouts), `TreeVerify.attend` and `move_slots` under
   torch.cuda.set_sync_debug_mode("error") (any host synchronisation raises);
4. compaction: `move_slots` captured in a CUDA graph, its index tensors rewritten, replayed == eager.

Writes gpu_layer_check.json to $OUT (default ./gpu_layer_check_out); exit status 1 if a check fails.

    python3 benchmarks/gpu_layer_check.py            # GPU
    python3 benchmarks/gpu_layer_check.py --smoke    # CPU, Triton interpreter, tiny fp32 shapes: check 1 only
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported; the kernels run on CPU

import argparse
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, without installing it

from vllm_ddtree.kernels.tree_attention_reference import tree_attention_reference
from vllm_ddtree.vllm.kv_rows import move_slots
from vllm_ddtree.vllm.tree_step import TreeRows
from vllm_ddtree.vllm.tree_verify import TreeVerify, TreeVerifyBuffers, is_uniform


@dataclass(frozen=True)
class Shapes:
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    nodes: int  # N = 1 + budget
    contexts: tuple[int, ...]  # the uniform batch's prefixes


GPU_SHAPES = Shapes(32, 8, 128, 16, torch.bfloat16, 65, (1000, 3000, 8000, 17))
SMOKE_SHAPES = Shapes(4, 2, 32, 16, torch.float32, 6, (0, 7, 21))


@dataclass
class Batch:
    """masks: each request's [q, q] ancestor-or-self mask (causal for prefills and chains);
    branching: whether the request is a tree the runner hands to the tree attention."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: np.ndarray
    masks: list[torch.Tensor]
    branching: list[bool]
    contexts: list[int]

    @property
    def num_real(self) -> int:
        return len(self.masks)


def random_tree_mask(num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.eye(num_nodes, dtype=torch.bool)
    for i in range(1, num_nodes):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def make_batch(shapes: Shapes, requests: list[tuple[int, str, int]], layout: str, padded: int, device: torch.device, seed: int) -> Batch:
    """requests: (context, kind, query rows), kind in {"tree", "chain", "prefill"}. Each request owns
    distinct shuffled blocks (block 0 stays the null block); the block table is exactly as wide as
    the longest request needs; padded requests have seq_len 0 and null blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [context + rows for context, _, rows in requests]
    blocks = [-(-n // shapes.block_size) for n in seq_lens]
    ids = (torch.randperm(sum(blocks) + 2, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(requests) + padded, max(blocks), dtype=torch.int32)
    for row, count in enumerate(blocks):
        block_table[row, :count] = torch.tensor([ids.pop() for _ in range(count)], dtype=torch.int32)
    num_blocks, hkv, bs, d = sum(blocks) + 3, shapes.num_kv_heads, shapes.block_size, shapes.head_size
    physical = (num_blocks, bs, hkv, 2 * d) if layout == "NHD" else (num_blocks, hkv, bs, 2 * d)
    kv_cache = torch.randn(physical, generator=gen).to(shapes.dtype)
    kv_cache = (kv_cache.transpose(1, 2) if layout == "NHD" else kv_cache).to(device)
    lens = [rows for _, _, rows in requests] + [max(rows for _, _, rows in requests)] * padded
    query = torch.randn(sum(lens), shapes.num_q_heads, d, generator=gen).to(shapes.dtype).to(device)
    starts = np.concatenate([[0], np.cumsum([rows for _, _, rows in requests])])
    masks = [random_tree_mask(rows, gen) if kind == "tree" else torch.ones(rows, rows, dtype=torch.bool).tril() for _, kind, rows in requests]
    return Batch(
        query=query,
        kv_cache=kv_cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens + [0] * padded, dtype=torch.int32, device=device),
        query_start_loc=np.concatenate([starts, [starts[-1]] * padded]),
        masks=masks,
        branching=[kind == "tree" for _, kind, _ in requests],
        contexts=[context for context, _, _ in requests],
    )


def tree_rows(batch: Batch, width: int) -> TreeRows:
    """The branching requests' TreeRows as the runner hands them over (host tensors; padded nodes
    repeat the root's row and see only themselves)."""
    picked = [i for i, branching in enumerate(batch.branching) if branching]
    num_nodes = torch.tensor([batch.masks[i].shape[0] for i in picked])
    valid = torch.arange(width).unsqueeze(0) < num_nodes.unsqueeze(1)
    ancestor = torch.eye(width, dtype=torch.bool).repeat(len(picked), 1, 1)
    for t, i in enumerate(picked):
        n = batch.masks[i].shape[0]
        ancestor[t, :n, :n] = batch.masks[i]
    first = torch.from_numpy(batch.query_start_loc[picked]).long().unsqueeze(1)
    return TreeRows(
        req_indices=torch.tensor(picked),
        starts=torch.tensor([batch.contexts[i] for i in picked]),
        num_nodes=num_nodes,
        valid=valid,
        ancestor_mask=ancestor,
        node_rows=first + torch.where(valid, torch.arange(width), 0),
    )


def fill(buffers: TreeVerifyBuffers, batch: Batch) -> TreeVerify:
    """What DDTreeGPUModelRunner._attach_tree_attention does for one metadata object."""
    width = max(mask.shape[0] for mask, branching in zip(batch.masks, batch.branching) if branching)
    uniform = is_uniform(batch.query_start_loc[: batch.num_real + 1], width, batch.seq_lens.shape[0], batch.query.shape[0])
    return buffers.fill(tree_rows(batch, width), batch.seq_lens, batch.block_table, uniform)


def attend(tree: TreeVerify, batch: Batch, output: torch.Tensor, head_size: int) -> None:
    key_cache, value_cache = batch.kv_cache.transpose(1, 2).split(head_size, -1)
    tree.attend(batch.query, key_cache, value_cache, output, head_size**-0.5)


def reference_rows(batch: Batch, head_size: int) -> torch.Tensor:
    key_cache, value_cache = (c.float() for c in batch.kv_cache.transpose(1, 2).split(head_size, -1))
    out = torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    for i, mask in enumerate(batch.masks):
        lo, hi = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        rows = tree_attention_reference(
            batch.query[lo:hi].float().unsqueeze(0), key_cache, value_cache, batch.block_table[i : i + 1],
            batch.seq_lens[i : i + 1], mask.unsqueeze(0).to(batch.query.device), head_size**-0.5,
        )  # fmt: skip
        out[lo:hi] = rows[0]
    return out


def tolerance(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2e-2


def make_buffers(shapes: Shapes, max_requests: int, device: torch.device) -> TreeVerifyBuffers:
    pin = device.type == "cuda"
    return TreeVerifyBuffers(max_requests, shapes.nodes, shapes.block_size, shapes.num_q_heads, shapes.head_size, shapes.dtype, device, pin)


def uniform_batch(shapes: Shapes, layout: str, device: torch.device, seed: int) -> Batch:
    kinds = ["tree", "chain"] + ["tree"] * (len(shapes.contexts) - 2)
    return make_batch(shapes, [(c, k, shapes.nodes) for c, k in zip(shapes.contexts, kinds)], layout, 1, device, seed)


def mixed_batch(shapes: Shapes, layout: str, device: torch.device, seed: int) -> Batch:
    n = shapes.nodes
    longest = shapes.contexts[-2] + n  # the short tree below ends exactly where the block table does
    longest = -(-longest // shapes.block_size) * shapes.block_size
    short = max(2, n // 2)
    requests = [(5, "prefill", 9), (shapes.contexts[1], "tree", n), (3, "chain", n), (longest - short, "tree", short)]
    return make_batch(shapes, requests, layout, 0, device, seed)


def check_layouts(shapes: Shapes, device: torch.device) -> list[dict]:
    results = []
    for layout in ("NHD", "HND"):
        for name, batch in (("uniform", uniform_batch(shapes, layout, device, 0)), ("mixed", mixed_batch(shapes, layout, device, 1))):
            buffers = make_buffers(shapes, 8, device)
            tree = fill(buffers, batch)
            sentinel = torch.full_like(batch.query, 7.0)
            output = sentinel.clone()
            attend(tree, batch, output, shapes.head_size)
            expected = reference_rows(batch, shapes.head_size)
            tree_rows_mask = torch.zeros(output.shape[0], dtype=torch.bool, device=device)
            for i in range(batch.num_real):
                if name == "uniform" or batch.branching[i]:
                    tree_rows_mask[int(batch.query_start_loc[i]) : int(batch.query_start_loc[i + 1])] = True
            real = int(batch.query_start_loc[batch.num_real])
            error = (output[tree_rows_mask].float() - expected[tree_rows_mask]).abs().max().item()
            untouched = torch.equal(output[:real][~tree_rows_mask[:real]], sentinel[:real][~tree_rows_mask[:real]])
            layout_used = "uniform" if tree.query_rows is None else "gather"
            results.append({"layout": layout, "batch": name, "layout_used": layout_used, "max_abs_error": error,
                            "other_rows_untouched": untouched, "ok": error < tolerance(shapes.dtype) and untouched and layout_used == name.replace("mixed", "gather")})  # fmt: skip
    return results


def check_graph_replay(shapes: Shapes, device: torch.device) -> dict:
    """Capture as the builder does for a FULL decode graph, then fill + replay for three steps."""
    batch = uniform_batch(shapes, "NHD", device, 2)
    buffers = make_buffers(shapes, 8, device)
    captured = buffers.uniform(batch.seq_lens, batch.block_table, shapes.nodes)
    output = torch.zeros_like(batch.query)
    attend(captured, batch, output, shapes.head_size)  # warm up (compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(captured, batch, output, shapes.head_size)
    steps = []
    for step in range(3):
        fresh = uniform_batch(shapes, "NHD", device, 10 + step)  # new trees and queries, same lengths
        batch.query.copy_(fresh.query)
        batch.masks, batch.branching = fresh.masks, fresh.branching
        eager_tree = fill(buffers, batch)
        graph.replay()
        replayed = output.clone()
        eager = torch.zeros_like(output)
        attend(eager_tree, batch, eager, shapes.head_size)
        steps.append(bool(torch.equal(replayed, eager)))
    return {"steps_equal_to_eager": steps, "ok": all(steps)}


@contextmanager
def no_host_syncs():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def check_no_syncs(shapes: Shapes, device: torch.device) -> dict:
    results = {}
    for name, batch in (("uniform", uniform_batch(shapes, "HND", device, 3)), ("mixed", mixed_batch(shapes, "HND", device, 4))):
        buffers = make_buffers(shapes, 8, device)
        output = torch.zeros_like(batch.query)
        attend(fill(buffers, batch), batch, output, shapes.head_size)  # first use: compile, allocate
        try:
            with no_host_syncs():
                attend(fill(buffers, batch), batch, output, shapes.head_size)
            results[f"{name}_fill_and_attend"] = "no sync"
        except RuntimeError as error:
            results[f"{name}_fill_and_attend"] = f"synced: {error}"[:300]
    cache = torch.randn(64, shapes.num_kv_heads, shapes.block_size, 2 * shapes.head_size, device=device, dtype=shapes.dtype)
    src = torch.tensor([17, 19, 22, 40, 41], device=device)
    dst = torch.tensor([17, 18, 19, 40, 41], device=device)
    try:
        with no_host_syncs():
            move_slots(cache, src, dst)
        results["move_slots"] = "no sync"
    except RuntimeError as error:
        results["move_slots"] = f"synced: {error}"[:300]
    return {**results, "ok": all(value == "no sync" for value in results.values())}


def check_compaction_graph(shapes: Shapes, device: torch.device) -> dict:
    cache = torch.randn(64, shapes.num_kv_heads, shapes.block_size, 2 * shapes.head_size, device=device, dtype=shapes.dtype)
    src = torch.tensor([17, 19, 22, 24, 40, 41], device=device)
    dst = torch.tensor([17, 18, 19, 20, 40, 41], device=device)
    graphed, eager = cache.clone(), cache.clone()
    move_slots(graphed, src, dst)  # warm up
    graphed.copy_(cache)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_slots(graphed, src, dst)
    graphed.copy_(cache)
    src.copy_(torch.tensor([100, 103, 105, 106, 200, 201], device=device))
    dst.copy_(torch.tensor([100, 101, 102, 103, 200, 201], device=device))
    graph.replay()
    move_slots(eager, src, dst)
    equal = bool(torch.equal(graphed, eager))
    return {"replay_equal_to_eager": equal, "ok": equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny fp32 shapes; no CUDA graphs or sync checks")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_layer_check_out"), help="output folder (default $OUT)")
    args = parser.parse_args()
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    torch.manual_seed(0)
    started = time.perf_counter()
    report: dict = {"mode": "smoke" if smoke else "gpu", "device": "cpu" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__}
    report["layouts"] = check_layouts(shapes, device)
    if not smoke:
        report["graph_replay"] = check_graph_replay(shapes, device)
        report["no_host_syncs"] = check_no_syncs(shapes, device)
        report["compaction_graph"] = check_compaction_graph(shapes, device)
    checks = [*report["layouts"], *(report[key] for key in ("graph_replay", "no_host_syncs", "compaction_graph") if key in report)]
    report["all_ok"] = all(check["ok"] for check in checks)
    report["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_layer_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
