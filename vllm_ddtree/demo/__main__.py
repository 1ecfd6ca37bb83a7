"""`make demo`: one target + DFlash draft pair, side by side in one run.

Greedy generation with: no speculation, vLLM's n-gram (prompt lookup), vLLM's DFlash chain, and DDTree
at budgets 8, 32 and 64. Prints tokens per step, tokens/s and speedup over no speculation, and fails
if any variant's output differs from plain decoding (DDTree is lossless).

The pair is the embedded trained pair (vllm_ddtree/demo/pair/, held-out code prompts) when it is
shipped; until then, the synthetic "focused" pair built on the fly (token-id prompts), whose draft's
top-4 always holds the target's token while its top-1 is often wrong.

    python -m vllm_ddtree.demo [--prompts 8] [--max-tokens 96] [--budgets 8 32 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from vllm_ddtree.demo.side_by_side import Variant, configure_cpu_environment, format_table, run_variant


def trained_pair(num_prompts: int) -> tuple[str, str, list[Any], dict[str, Any]] | None:
    from vllm_ddtree.demo import PAIR_DIR, demo_pair_paths, heldout_prompts

    if not os.path.isdir(PAIR_DIR):
        return None
    target, draft = demo_pair_paths()
    prompts = [{"prompt_token_ids": ids} for ids in heldout_prompts(num_prompts)]
    return target, draft, prompts, {}


def synthetic_pair(num_prompts: int, work_dir: str) -> tuple[str, str, list[Any], dict[str, Any]]:
    from vllm_ddtree.demo.synthetic_pair import build_pair

    target, draft = build_pair(work_dir, focused=True)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j * j + 3 * j) % 499 + 1 for j in range(8 + 9 * i)]} for i in range(num_prompts)]
    return target, draft, prompts, {"skip_tokenizer_init": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 32, 64])
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table is the output
    configure_cpu_environment()
    from vllm import SamplingParams

    with tempfile.TemporaryDirectory() as work_dir:
        pair = trained_pair(args.prompts)
        if pair is None:
            print("the embedded trained pair is not shipped yet: using the synthetic focused pair built on the fly")
            pair = synthetic_pair(args.prompts, work_dir)
        target, draft, prompts, engine_kwargs = pair
        with open(os.path.join(draft, "config.json")) as f:
            chain_length = json.load(f)["block_size"] - 1
        sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        # n-gram runs last: once it has imported numba, vLLM 0.32's CPU start-up scan of loaded modules
        # trips over llvmlite objects and no further engine can start in this process.
        variants = [
            Variant("no speculation", None),
            Variant("dflash chain (vLLM)", {"method": "dflash", "model": draft, "num_speculative_tokens": chain_length}),
            *(Variant(f"ddtree budget {b}", {"method": "ddtree", "model": draft, "num_speculative_tokens": b}) for b in args.budgets),
            Variant("ngram (vLLM)", {"method": "ngram", "num_speculative_tokens": chain_length, "prompt_lookup_max": 4}),
        ]

        print(f"target {target}\ndraft  {draft}\n{len(prompts)} prompts, greedy, max_tokens {args.max_tokens}\n")
        runs = []
        for variant in variants:
            runs.append(run_variant(target, variant, prompts, sampling, {"max_model_len": 1024, **engine_kwargs}))
            print(f"  done: {variant.name} ({runs[-1].seconds:.1f} s)", flush=True)

    baseline = runs[0]
    print("\n" + format_table(runs, baseline))
    differing = [run.name for run in runs[1:] if run.token_ids != baseline.token_ids]
    if differing:
        print(f"\nFAIL: greedy output differs from plain decoding for: {', '.join(differing)}", file=sys.stderr)
        return 1
    print("\ngreedy outputs identical across all variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
