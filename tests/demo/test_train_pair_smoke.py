"""The training script runs end to end at a tiny scale and writes a pair in the shipped layout."""

from __future__ import annotations

import json
import os

from vllm_ddtree.demo import train_pair


def test_training_script_runs_every_phase_at_tiny_scale(tmp_path):
    out = tmp_path / "pair"
    train_pair.main(["--out", str(out), "--scale", "0.002", "--threads", "1"])
    for rel in ("target/config.json", "target/model.safetensors", "target/tokenizer.json",
                "draft/config.json", "draft/model.safetensors", "training_record.json",
                "corpus_files.json", "heldout_prompts.json"):
        assert os.path.isfile(out / rel), rel
    record = json.loads((out / "training_record.json").read_text())
    assert record["draft_cycle1"]["steps"] == 8 and record["draft_cycle2"]["steps"] == 6
    assert record["generation_a"]["seed"] != record["generation_b"]["seed"]
    assert set(record["acceptance_t0"]["all"]) == {"chain", "tree8", "tree16", "tree32", "tree64"}

    # --resume reuses the target and draft cycle 1, and trains cycle 2 again
    train_pair.main(["--out", str(out), "--scale", "0.002", "--threads", "1", "--resume"])
    again = json.loads((out / "training_record.json").read_text())
    assert again["target_resumed_from_previous_run"] and again["draft_cycle1_resumed_from_previous_run"]
