"""A small-vocabulary copy of a focused pair, for distribution tests whose chi-square cells must fill.

`shrink_vocab` keeps a subset of the pair's token ids (new id j = old id keep[j]) and the mask token
(new id vocab - 1): the rows of the target's embedding and LM head are sliced, so every kept token's
logit is what the big pair gives it. `head_scale` multiplies the LM head (the draft shares it), which
flattens both distributions without changing the draft's ranking: at temperature 1 the focused
target then spreads its mass over its FOCUS tokens instead of nearly always taking one.
"""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import load_file, save_file

from tests.e2e.pairs import FOCUS, MASK_TOKEN_ID

SMALL_VOCAB = 32


def kept_token_ids(vocab: int = SMALL_VOCAB) -> list[int]:
    """Old ids of the new vocabulary: the FOCUS tokens, then the smallest other ids, then the mask."""
    others = [i for i in range(1, MASK_TOKEN_ID) if i not in FOCUS][: vocab - 1 - len(FOCUS)]
    return [*FOCUS, *others, MASK_TOKEN_ID]


def shrink_vocab(pair: tuple[str, str], out_dir: str, head_scale: float = 1.0, vocab: int = SMALL_VOCAB) -> tuple[str, str]:
    """Write target/ and draft/ of the small-vocabulary pair under out_dir; returns their paths."""
    keep = kept_token_ids(vocab)
    target_in, draft_in = pair
    target_out, draft_out = os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    shutil.copytree(target_in, target_out)
    shutil.copytree(draft_in, draft_out)
    os.remove(os.path.join(target_out, "generation_config.json"))  # its EOS id is an old id

    weights_path = os.path.join(target_out, "model.safetensors")
    weights = load_file(weights_path)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][keep].contiguous()
    weights["lm_head.weight"] = (weights["lm_head.weight"][keep] * head_scale).contiguous()
    save_file(weights, weights_path, metadata={"format": "pt"})

    for path, update in (
        (os.path.join(target_out, "config.json"), {}),
        (os.path.join(draft_out, "config.json"), {"dflash_config": {"mask_token_id": vocab - 1}}),
    ):
        with open(path) as f:
            config = json.load(f)
        config["vocab_size"] = vocab
        for key, value in update.items():
            config[key] = {**config[key], **value}
        with open(path, "w") as f:
            json.dump(config, f, indent=1)
    return target_out, draft_out
