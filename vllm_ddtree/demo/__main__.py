"""`make demo`: one target + DFlash draft pair, side by side in one run.

Greedy generation with: no speculation, vLLM's n-gram (prompt lookup), vLLM's DFlash chain, and DDTree
at budgets 8, 32 and 64. Prints tokens per step, tokens/s and speedup over no speculation, and fails
if any variant's output differs from plain decoding (DDTree is lossless).

The pair is the embedded trained pair (vllm_ddtree/demo/pair/: a 4-layer Qwen3 target and its 2-layer
DFlash draft, trained on the standard library); prompts are held-out standard-library code as text.

    python -m vllm_ddtree.demo [--prompts 16] [--prompt-tokens 64] [--max-tokens 128] [--budgets 8 32 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_ddtree.demo.side_by_side import Variant, configure_cpu_environment, format_table, run_variant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 32, 64])
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table is the output
    configure_cpu_environment()
    from vllm import SamplingParams

    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts

    target, draft = demo_pair_paths()
    prompts = heldout_prompts(args.prompts, args.prompt_tokens, as_text=True)
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

    print(f"target {target}\ndraft  {draft}")
    print(f"{len(prompts)} held-out code prompts (~{args.prompt_tokens} tokens), greedy, max_tokens {args.max_tokens}\n")
    runs = []
    for variant in variants:
        runs.append(run_variant(target, variant, prompts, sampling, {"max_model_len": 1024}))
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
