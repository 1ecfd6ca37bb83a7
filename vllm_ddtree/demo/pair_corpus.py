"""The demo pair's corpus and tokenizer: the running interpreter's standard-library ``*.py`` files,
split by file, and a byte-level BPE trained on the train files (phase 1 of ``train_pair``)."""
from __future__ import annotations

import hashlib
import json
import os
import random

EOT = "<|endoftext|>"
MASK = "<|mask|>"
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})



def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def list_corpus_files(root: str) -> list[str]:
    """Sorted relative paths of every ``*.py`` under ``root`` outside the excluded directories."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def sample_files(files: list[str], n: int | None, seed: int) -> list[str]:
    """``files`` itself when ``n`` is None (the recipe's corpus), else a seeded random ``n`` of them
    (smoke runs), sorted."""
    if n is None:
        return files
    return sorted(random.Random(seed).sample(files, n))


def split_files(files: list[str], frac: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, heldout), each sorted; the held-out set is a seeded random ``frac`` of the files."""
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    n_held = max(1, round(frac * len(files)))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def read_text(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE, ``<|endoftext|>`` = id 0, then ``<|mask|>`` appended as id ``vocab``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([MASK])
    assert tok.token_to_id(EOT) == 0 and tok.token_to_id(MASK) == vocab
    return tok


def save_hf_tokenizer(tok, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json loadable by ``AutoTokenizer`` and vLLM."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[MASK],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(out_dir)
    # transformers 5 writes its own class name; the classic alias loads in 4.x and 5.x alike.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def sha256_texts(texts: list[str]) -> str:
    """One digest of the texts in order, each terminated by a NUL byte."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()
