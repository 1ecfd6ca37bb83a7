"""The training script runs end to end at a tiny scale and writes a pair in the shipped layout."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from vllm_ddtree.demo import train_pair

# Every phase of the shipped recipe, at a size that takes seconds on one core: 0.002 of the step and
# sample counts, a sample of the corpus files (a quarter held out, so the evaluation finds held-out
# code), and a small model, vocab and sequence lengths.
TINY = ["--scale", "0.002", "--threads", "1", "--set", "heldout_frac=0.25", "bpe_vocab=512", "hidden=64", "heads=2",
        "kv_heads=1", "head_dim=32", "intermediate=128", "target_seq=128", "gen_prefix=16", "gen_len=48",
        "eval_new_tokens=16"]


def tiny_run(out, *extra: str, corpus_files: int = 16) -> dict:
    """Run the script at the tiny size into ``out``; returns its training record."""
    train_pair.main(["--out", str(out), *TINY, "--corpus-files", str(corpus_files), *extra])
    return json.loads((out / "training_record.json").read_text())


def test_training_script_runs_every_phase_at_tiny_scale(tmp_path):
    out = tmp_path / "pair"
    record = tiny_run(out)
    for rel in ("target/config.json", "target/model.safetensors", "target/tokenizer.json",
                "draft/config.json", "draft/model.safetensors", "training_record.json",
                "corpus_files.json", "heldout_prompts.json"):
        assert os.path.isfile(out / rel), rel
    assert record["corpus"]["files"] == 16 and record["recipe"]["hidden"] == 64
    assert record["draft_cycle1"]["steps"] == 8 and record["draft_cycle2"]["steps"] == 6
    assert record["generation_a"]["seed"] != record["generation_b"]["seed"]
    assert set(record["acceptance_t0"]["all"]) == {"chain", "tree8", "tree16", "tree32", "tree64"}

    # --resume reuses the target and draft cycle 1, and trains cycle 2 again
    again = tiny_run(out, "--resume")
    assert again["target_resumed_from_previous_run"] and again["draft_cycle1_resumed_from_previous_run"]

    # ... but neither after a run on another sample of the corpus
    other = tiny_run(out, "--resume", corpus_files=17)
    assert "target_resumed_from_previous_run" not in other and "draft_cycle1_resumed_from_previous_run" not in other


@pytest.mark.parametrize("text", ["hidden=true", "hidden=6.5", "target_layer_ids=[1.5]", "no_such_field=1", "hidden"])
def test_recipe_overrides_keep_the_fields_types(text):
    with pytest.raises(argparse.ArgumentTypeError):
        train_pair.recipe_override(text)
    assert train_pair.recipe_override("warmup_frac=0") == ("warmup_frac", 0.0)
