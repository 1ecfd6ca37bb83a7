"""Tokens per verify step of DDTree over a DFlash2 draft on the V2 model runner at equal budgets: trees
scored by the per-position marginals against trees scored by the candidate selector's transitions.

The pair: the embedded trained pair's draft in DFlash2 form (identity convolutions: it drafts as the
DFlash draft) with a selector trained on the target's greedy continuations of held-out snippets 16-39
(`python -m vllm_ddtree.demo.dflash2_pair`, run here into --draft when it is missing). Measured on the
held-out snippets 0..--prompts-1, none of which the selector saw, greedy, --max-tokens new tokens each,
one request per call (batch 1). Rounds interleave the variants, in an order rotated by one place per
round; tokens per step are deterministic (greedy, fixed trees), the wall times are not (vLLM's V2 CPU
runner runs under Triton's interpreter here: a correctness path, so they are reported, not compared).
Every variant's tokens must equal plain decoding's (checked). JSON on stdout and in --out.

    python benchmarks/dflash2_scoring.py --out dflash2_scoring.json
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: vLLM's V2 CPU runner needs Triton
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process, where the Triton stand-in is registered
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.gpu.triton_cpu_backend import register_cpu_backend_stand_in  # noqa: E402

SCORINGS = ("marginal", "selector")


def _run(target: str, spec: dict | None, prompts: list[list[int]], max_tokens: int) -> dict:
    """One engine over the prompts one by one: tokens, tokens per verify step, seconds of generate."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=128 * 2**20, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, seed=0,
              disable_log_stats=False, speculative_config=spec)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        tokens = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
        seconds = time.perf_counter() - start
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")}
    finally:
        llm.llm_engine.engine_core.shutdown()
    result = {"tokens": tokens, "seconds": round(seconds, 2)}
    if spec is not None:
        steps = metrics["vllm:spec_decode_num_drafts"]
        result["verify_steps"] = steps
        result["tokens_per_verify_step"] = round(1 + metrics["vllm:spec_decode_num_accepted_tokens"] / steps, 4)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=os.path.expanduser("~/.cache/vllm_ddtree/dflash2_trained"), help="the trained DFlash2 draft (made when missing)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    register_cpu_backend_stand_in()

    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts
    from vllm_ddtree.demo import dflash2_pair

    if not os.path.exists(os.path.join(args.draft, "config.json")):
        dflash2_pair.main(["--out", args.draft])
    with open(os.path.join(args.draft, "selector_record.json")) as f:
        record = json.load(f)
    target = demo_pair_paths()[0]
    prompts = heldout_prompts(args.prompts, 64)
    assert not set(range(args.prompts)) & set(dflash2_pair.TRAIN_SNIPPETS), "measure on snippets the selector never saw"
    plain = _run(target, None, prompts, args.max_tokens)
    variants = [(budget, scoring) for budget in args.budgets for scoring in SCORINGS]
    runs: dict[str, list[dict]] = {f"budget {b} {s}": [] for b, s in variants}
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for budget, scoring in variants[shift:] + variants[:shift]:
            spec = {"method": "ddtree", "model": args.draft, "num_speculative_tokens": budget, "ddtree_adaptive": False, "ddtree_scoring": scoring}
            result = _run(target, spec, prompts, args.max_tokens)
            assert result["tokens"] == plain["tokens"], f"budget {budget} {scoring}: output differs from plain decoding"
            runs[f"budget {budget} {scoring}"].append({k: v for k, v in result.items() if k != "tokens"})
    summary = {
        name: {"tokens_per_verify_step": results[0]["tokens_per_verify_step"], "verify_steps": results[0]["verify_steps"],
               "seconds": [r["seconds"] for r in results]}
        for name, results in runs.items()
    }
    report = {
        "pair": "embedded trained pair, draft in DFlash2 form (identity convolutions, trained selector)",
        "selector_record": record, "prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "equal_to_plain_decoding": True, "plain_seconds": plain["seconds"], "variants": summary,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
