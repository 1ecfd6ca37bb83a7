"""benchmarks/gpu_check.py runs end to end on CPU (--smoke: Triton interpreter, tiny fp32 shapes), so the
one-shot GPU check does not rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_mode_passes_and_writes_its_json(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "smoke" and report["all_correct"]
    assert {(c["context"], c["budget"], c["batch"]) for c in report["cases"]} == {(c, b, r) for c in (0, 5, 37) for b in (4, 12) for r in (1, 2)}
    assert all("kernel_ms" in c for c in report["cases"] if c["context"] != 5)  # the tree-only cases are not timed
