"""Target verify forward of a branching tree against a chain of the same rows and a plain step, A/B
inside one engine.

One in-process engine, batch 1, greedy. A budget policy turns through the step shapes, one per step:
the chain of `--budget` nodes (`TreeShape(budget, 1)`, vLLM's causal kernel only), the best-first tree
of the same budget (branching: DDTree's tree attention), with `--torch-rows` that tree again with every
layer's tree rows in the torch formulation (`attention.tree_attention`, what a layer the compiled kernel
does not take runs), and with `--plain` an OFF step (one row, no drafts). Every target forward is timed
and labelled by the shape it verifies; the k-th forwards of every label form round k (neighbours in
time, so contention hits them alike), whose ratios to the chain's give median [min-max]. Printed per
context (short: 64-token held-out prompts; 2k: `--long` tokens, skipped with `--long 0`): those ratios
and the median milliseconds of each label.

    python benchmarks/verify_forward_ab.py [--budget 7] [--long 1856] [--tokens 64] [--prompts 4]
    python benchmarks/verify_forward_ab.py --pair ~/.cache/vllm_ddtree/pairs/0.6b --dtype bfloat16 \
        --budget 8 --torch-rows --plain --long 0 --kv-mib 256   # the widened pair (`demo.widen_pair`)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class Alternate:
    """Budget policy: the variants' shapes in turn, one per step; `on_choose(label)` hears each choice."""

    variants: list[tuple[str, Any]]
    on_choose: Any = None
    turn: int = 0
    chosen: str = ""

    @property
    def shapes(self) -> list[Any]:
        return [shape for _, shape in self.variants]

    def choose(self, num_requests: int, context_tokens: float = 0.0) -> Any:
        self.turn += 1
        self.chosen, shape = self.variants[self.turn % len(self.variants)]
        if self.on_choose is not None:
            self.on_choose(self.chosen)
        return shape

    def observe(self, *args: Any, **kwargs: Any) -> None:
        pass

    def requests_arrived(self, num_requests: int) -> None:
        pass


@dataclass
class ForwardTimes:
    """Seconds of each decode verify forward, by label, in order."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def rounds(self, labels: list[str]) -> list[dict[str, float]]:
        """Round k: the k-th forward of every label."""
        count = min(len(self.seconds.get(label, [])) for label in labels)
        return [{label: self.seconds[label][k] for label in labels} for k in range(count)]


def label_of(runner: Any, policy: Alternate, rows: int, forward_rows: int) -> str | None:
    """The variant this forward verifies: "plain" for a decode of one row without drafts (the step after
    an OFF choice), else the policy's last choice when the step carries `rows` branching tree rows (a
    tree) or any chain; None otherwise (not timed: prefills, mixed steps)."""
    step = runner.step
    if step is None or not bool((step.num_drafts > 0).any()):
        return "plain" if forward_rows == 1 else None
    if not bool((step.num_drafts > 0).all()):
        return None
    if step.attention_rows() is None:  # a chain (its depth is the draft's block less one)
        return "chain" if policy.chosen == "chain" else None
    return policy.chosen if policy.chosen.startswith("tree") and int(step.tree.num_nodes.sum()) == rows else None


def timed_runner(runner: Any, policy: Alternate, rows: int, times: ForwardTimes) -> None:
    forward = type(runner)._model_forward.__get__(runner)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = forward(*args, **kwargs)
        seconds = time.perf_counter() - start
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        label = label_of(runner, policy, rows, -1 if positions is None else int(positions.shape[-1]))
        if label is not None:
            times.seconds.setdefault(label, []).append(seconds)
        return result

    runner._model_forward = timed


def tree_row_paths(model: Any) -> Any:
    """A function of a label that sets every attention layer's tree-row path: the torch formulation for
    "tree_torch", else what the layer chose at its first tree step (the compiled kernel where it serves)."""
    from vllm_ddtree.vllm.attention import DDTreeCPUAttentionImpl

    impls = [m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), DDTreeCPUAttentionImpl)]
    chosen: dict[int, Any] = {}

    def set_paths(label: str) -> None:
        for impl in impls:
            path = impl.__dict__.get("_tree_path")
            if path is None:
                continue
            own = chosen.setdefault(id(impl), path if path[2] is not None else None)
            if label == "tree_torch":
                impl._tree_path = (path[0], path[1], None)
            elif own is not None:
                impl._tree_path = own

    return set_paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=7)
    parser.add_argument("--long", type=int, default=1856, help="tokens of the long-context prompts (0: none)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--pair", default=None, help="a folder with target/ and draft/ (default: the embedded pair)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-mib", type=int, default=64)
    parser.add_argument("--torch-rows", action="store_true", help="also the tree with the torch formulation's rows")
    parser.add_argument("--plain", action="store_true", help="also a plain (OFF) step")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_ddtree.core import TreeShape
    from vllm_ddtree.core.budget import OFF
    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts
    from vllm_ddtree.demo.engines import context_prompts

    if args.pair is None:
        target, draft = demo_pair_paths()
    else:
        pair = os.path.expanduser(args.pair)
        target, draft = os.path.join(pair, "target"), os.path.join(pair, "draft")
    llm = LLM(
        model=target, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True, distributed_executor_backend="uni",
        max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=1, seed=0, enable_prefix_caching=False,
        kv_cache_memory_bytes=args.kv_mib * 2**20,
        speculative_config={"method": "ddtree", "model": draft, "num_speculative_tokens": args.budget, "ddtree_adaptive": False},
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    variants = [("chain", TreeShape(args.budget, 1)), ("tree", TreeShape(args.budget, None))]
    variants += [("tree_torch", TreeShape(args.budget, None))] if args.torch_rows else []
    variants += [("plain", OFF)] if args.plain else []
    labels = [label for label, _ in variants]
    policy = Alternate(variants, on_choose=tree_row_paths(runner.get_model()))
    runner.use_budget_policy(policy)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(heldout_prompts(1, 64)[0])}], params, use_tqdm=False)  # warm-up
    contexts = {"short": heldout_prompts(args.prompts, 64)}
    if args.long:
        contexts["2k"] = context_prompts(args.prompts, args.long)
    print(f"{args.dtype}, budget {args.budget}: target forward of {args.budget + 1} rows (chain: as many as the draft block allows; plain: 1), per round; x chain")
    for name, prompts in contexts.items():
        times = ForwardTimes()
        timed_runner(runner, policy, args.budget + 1, times)
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)
        runner._model_forward = type(runner)._model_forward.__get__(runner)
        rounds = times.rounds(labels)
        if not rounds:
            counts = {label: len(times.seconds.get(label, [])) for label in labels}
            raise SystemExit(f"{name}: a label was never timed ({counts}); more --tokens or --prompts")
        cells = []
        for label in labels:
            ratios = sorted(r[label] / r["chain"] for r in rounds)
            ms = statistics.median(r[label] for r in rounds) * 1e3
            cells.append(f"{label} {ms:.2f} ms {statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
        print(f"  {name:5s} ({len(rounds)} rounds): " + "; ".join(cells))


if __name__ == "__main__":
    main()
