"""Check the demo pair in vLLM against the pure-PyTorch reference (`vllm_ddtree.demo.reference`).

    python -m vllm_ddtree.demo.check_pair_vllm [--pair DIR] [--prompts 8] [--prompt-tokens 64]
                                               [--max-tokens 128] [--budgets 8 32] [--json PATH]

Runs plain greedy decoding, vLLM's DFlash chain (num_speculative_tokens = block_size - 1) and DDTree at
each budget on held-out prompt ids, and the reference stepping on the same ids. Prints one JSON object:
whether every vLLM variant's tokens equal plain decoding and the reference's greedy tokens, and vLLM's
counters (drafts, accepted tokens, steps reaching each depth, tokens per step) next to the reference's
(same algorithm, same greedy path: on the shipped pair they are identical; only two draft log-probs
tied to float precision, rounded differently by the two float32 implementations, could split them).
"""
from __future__ import annotations

import argparse
import json
import os


def compare(target: str, draft: str, prompt_ids: list[list[int]], max_tokens: int, budgets: list[int]) -> dict:
    from vllm import SamplingParams

    from vllm_ddtree.demo.reference import CHAIN, greedy_reference
    from vllm_ddtree.demo.side_by_side import Variant, run_variant

    with open(os.path.join(draft, "config.json")) as f:
        depth = json.load(f)["block_size"] - 1
    variants = [
        (None, Variant("plain", None)),
        (CHAIN, Variant("dflash chain", {"method": "dflash", "model": draft, "num_speculative_tokens": depth})),
        *((b, Variant(f"ddtree {b}", {"method": "ddtree", "model": draft, "num_speculative_tokens": b, "ddtree_adaptive": False}))
          for b in budgets),
    ]
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    runs = [(key, run_variant(target, v, prompts, sampling, {"max_model_len": 1024})) for key, v in variants]
    reference = greedy_reference(target, draft, prompt_ids, max_tokens, budgets)
    plain = runs[0][1].token_ids
    out: dict = {"plain_equals_reference_greedy": plain == reference.greedy_token_ids, "variants": {}}
    for key, run in runs[1:]:
        ours, theirs = run.tokens_per_step, reference.tokens_per_step(key)
        out["variants"][run.name] = {
            "tokens_equal_plain": run.token_ids == plain,
            "vllm_tokens_per_step": round(ours, 4),
            "reference_tokens_per_step": round(theirs, 4),
            "relative_difference": round(abs(ours - theirs) / theirs, 4),
            "vllm_drafts": run.counters.drafts,
            "reference_drafts": len(reference.accepted[key]),
            "vllm_accepted": run.counters.accepted,
            "reference_accepted": sum(reference.accepted[key]),
            "vllm_accepted_per_position": list(run.counters.accepted_per_position[:depth]),
            "reference_accepted_per_position": reference.accepted_per_position(key, depth),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts
    from vllm_ddtree.demo.side_by_side import configure_cpu_environment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None, help="directory with target/ and draft/ (default: the shipped pair)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    configure_cpu_environment()
    pair_dir = args.pair
    target, draft = demo_pair_paths() if pair_dir is None else (os.path.join(pair_dir, "target"), os.path.join(pair_dir, "draft"))
    prompt_ids = heldout_prompts(args.prompts, args.prompt_tokens, pair_dir=pair_dir)
    out = {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           **compare(target, draft, prompt_ids, args.max_tokens, args.budgets)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
