"""Check the demo pair inside stock vLLM on CPU and against the pure-PyTorch draft.

    python -m vllm_ddtree.demo.check_pair_vllm [--pair DIR] [--prompts 8] [--max-tokens 128]

1. plain greedy generation and stock ``method:"dflash"`` (num_speculative_tokens = block_size - 1)
   must produce identical text (float32, greedy, ``ignore_eos``);
2. stock DFlash's acceptance from ``llm.get_metrics()`` (mean acceptance length = 1 + accepted /
   drafts, per-position acceptance rates);
3. the same T=0 chain stepping simulated in pure PyTorch with the training code's ``DFlashDraft``
   (anchor = last committed token, context < anchor, accept the longest matching prefix) on the same
   prompt ids. vLLM computes the same drafts, so the two per-position counts should agree up to
   float rounding; a layout mismatch (positions, layer ids, mask token, norms) shows up here.
Prints one JSON object; ``--json PATH`` also writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _vllm_run(target: str, draft: str | None, prompts: list[str], max_tokens: int, k: int) -> dict:
    from vllm import LLM, SamplingParams

    spec = None if draft is None else {"method": "dflash", "model": draft, "num_speculative_tokens": k}
    llm = LLM(model=target, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=1024, speculative_config=spec, disable_log_stats=False, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate(prompts, sp)
    dt = time.time() - t0
    res = {"texts": [o.outputs[0].text for o in outs], "token_ids": [list(o.outputs[0].token_ids) for o in outs],
           "prompt_token_ids": [list(o.prompt_token_ids) for o in outs], "generate_s": round(dt, 2)}
    if draft is not None:
        m = {x.name: x for x in llm.get_metrics() if "spec_decode" in x.name}
        drafts = m["vllm:spec_decode_num_drafts"].value
        accepted = m["vllm:spec_decode_num_accepted_tokens"].value
        per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"].values
        res["spec"] = {"drafts": drafts, "accepted": accepted,
                       "mean_acceptance_length": round(1 + accepted / max(1, drafts), 4),
                       "accepted_per_pos": list(per_pos),
                       "acceptance_rate_per_pos": [round(v / max(1, drafts), 4) for v in per_pos]}
    llm.llm_engine.engine_core.shutdown()
    del llm
    return res


def _torch_chain(target_dir: str, draft_dir: str, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    """Pure-PyTorch T=0 chain stepping over the greedy continuation, counted like vLLM's metrics:
    one draft per verify step while fewer than ``max_tokens`` tokens are committed."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    from vllm_ddtree.demo.train_pair import CachedTarget, DFlashDraft, Recipe, draft_logits

    torch.set_num_threads(int(os.environ.get("DEMO_TORCH_THREADS", "1")))
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with open(os.path.join(draft_dir, "config.json")) as f:
        dcfg = json.load(f)
    r = Recipe(hidden=dcfg["hidden_size"], heads=dcfg["num_attention_heads"], kv_heads=dcfg["num_key_value_heads"],
               head_dim=dcfg["head_dim"], intermediate=dcfg["intermediate_size"],
               rope_theta=dcfg["rope_parameters"]["rope_theta"], draft_layers=dcfg["num_hidden_layers"],
               block_size=dcfg["block_size"], target_layer_ids=dcfg["dflash_config"]["target_layer_ids"],
               tie_k_norm=False)  # load every layer's own k_norm (GPU semantics)
    mask_id = dcfg["dflash_config"]["mask_token_id"]
    draft = DFlashDraft(r).eval()
    draft.load_state_dict(load_file(os.path.join(draft_dir, "model.safetensors")))
    tgt = CachedTarget(target, r.target_layer_ids)
    D = r.block_size - 1
    drafts, per_pos, gen_ids = 0, [0] * D, []
    with torch.no_grad():
        for p in prompt_ids:
            P, L = len(p), len(p) + max_tokens + D
            cache = tgt.new_cache(1, L)
            logits, _ = tgt.forward(torch.tensor([p]), 0, cache)
            seq = list(p)
            for pos in range(P, L):
                seq.append(int(logits[0, -1].argmax()))
                if pos < L - 1:
                    logits, _ = tgt.forward(torch.tensor([[seq[-1]]]), pos, cache)
            gen_ids.append(seq[P : P + max_tokens])
            _, feats = tgt.forward(torch.tensor([seq]), 0, tgt.new_cache(1, L))
            anchors = torch.arange(P, P + max_tokens)
            guess = draft_logits(draft, tgt.embed, tgt.lm_head, torch.tensor([seq]), feats, anchors, mask_id)[0].argmax(-1)
            a = P
            while a - P + 1 < max_tokens:  # committed tokens x_P..x_a
                acc = 0
                while acc < D and int(guess[a - P, acc]) == seq[a + 1 + acc]:
                    per_pos[acc] += 1
                    acc += 1
                drafts += 1
                a += acc + 1
    return {"drafts": drafts, "accepted": sum(per_pos),
            "mean_acceptance_length": round(1 + sum(per_pos) / max(1, drafts), 4),
            "accepted_per_pos": per_pos, "acceptance_rate_per_pos": [round(v / max(1, drafts), 4) for v in per_pos],
            "greedy_token_ids": gen_ids}


def main(argv: list[str] | None = None) -> dict:
    from vllm_ddtree.demo import demo_pair_paths, heldout_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None, help="directory with target/ and draft/ (default: shipped pair)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target, draft = demo_pair_paths() if args.pair is None else (os.path.join(args.pair, "target"), os.path.join(args.pair, "draft"))
    with open(os.path.join(draft, "config.json")) as f:
        k = json.load(f)["block_size"] - 1
    prompts = heldout_prompts(args.prompts, args.prompt_tokens, as_text=True, pair_dir=os.path.dirname(target))

    plain = _vllm_run(target, None, prompts, args.max_tokens, k)
    spec = _vllm_run(target, draft, prompts, args.max_tokens, k)
    ref = _torch_chain(target, draft, plain["prompt_token_ids"], args.max_tokens)
    out = {
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "num_speculative_tokens": k,
        "greedy_text_identical": plain["texts"] == spec["texts"],
        "greedy_ids_identical": plain["token_ids"] == spec["token_ids"],
        "vllm_plain_matches_torch_greedy": plain["token_ids"] == ref.pop("greedy_token_ids"),
        "vllm_dflash": spec["spec"],
        "torch_chain_same_prompts": ref,
        "generate_s": {"plain": plain["generate_s"], "dflash": spec["generate_s"]},
        "sample_text": prompts[0][-200:] + "<<<|>>>" + plain["texts"][0][:300],
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
