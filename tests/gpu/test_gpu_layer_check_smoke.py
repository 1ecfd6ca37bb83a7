"""benchmarks/gpu_layer_check.py runs on CPU (--smoke: Triton interpreter, tiny fp32 shapes, the layout
check only), so the one-shot GPU check of tree_verify / kv_rows does not rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_layer_check_smoke_mode_passes_and_writes_its_json(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_layer_check.py"), "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_layer_check.json").read_text())
    assert report["mode"] == "smoke" and report["all_ok"]
    assert {(c["layout"], c["layout_used"]) for c in report["layouts"]} == {(k, u) for k in ("NHD", "HND") for u in ("uniform", "gather")}
