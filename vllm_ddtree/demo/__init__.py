"""The embedded demo pair: a tiny trained Qwen3 target and its DFlash draft (``demo/pair/``).

Trained on CPU by ``python -m vllm_ddtree.demo.train_pair`` (see ``pair/README.md`` for the record).
Importing this module needs neither torch nor vLLM.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pair")

__all__ = ["PAIR_DIR", "demo_pair_paths", "heldout_prompts"]


def demo_pair_paths() -> tuple[str, str]:
    """(target_dir, draft_dir) of the shipped pair. The target dir holds the tokenizer too."""
    return os.path.join(PAIR_DIR, "target"), os.path.join(PAIR_DIR, "draft")


@lru_cache(maxsize=4)
def _snippets(pair_dir: str) -> tuple[dict, ...]:
    with open(os.path.join(pair_dir, "heldout_prompts.json")) as f:
        return tuple(json.load(f)["snippets"])


def heldout_prompts(n: int = 8, num_tokens: int = 64, as_text: bool = False, pair_dir: str | None = None) -> list:
    """``n`` prompts of ``num_tokens`` tokens from standard-library files the pair never trained on.

    Snippets come from ``pair/heldout_prompts.json`` (64 snippets of 256 token ids, one per held-out
    file first, ``encodings/*`` excluded because code-page tables are trivially predictable), so they
    do not depend on the running interpreter. Returns token-id lists, or the decoded text of exactly
    those ids with ``as_text=True`` (needs ``tokenizers``). Deterministic; ``n`` <= 64,
    ``num_tokens`` <= 256. ``pair_dir`` selects another trained pair (default: the shipped one).
    """
    pair_dir = PAIR_DIR if pair_dir is None else pair_dir
    snippets = _snippets(os.path.abspath(pair_dir))
    if not 0 < n <= len(snippets):
        raise ValueError(f"n must be in 1..{len(snippets)}, got {n}")
    if not 0 < num_tokens <= len(snippets[0]["ids"]):
        raise ValueError(f"num_tokens must be in 1..{len(snippets[0]['ids'])}, got {num_tokens}")
    ids = [list(s["ids"][:num_tokens]) for s in snippets[:n]]
    if not as_text:
        return ids
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(pair_dir, "target", "tokenizer.json"))
    return [tok.decode(x, skip_special_tokens=False) for x in ids]
