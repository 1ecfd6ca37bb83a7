"""Runs each interpreted module of tests/gpu in a fresh process with TRITON_INTERPRET=1 (the kernels
against the reference, ~15 s; a real engine through our Triton backend, ~90 s on 2 cores).

Those modules need the variable before triton is first imported and the Triton "cpu" stand-in before
vLLM is first imported (`triton_cpu_backend.py`); both would leak into every later test of this
process, so a child process keeps them contained. The child's pytest output is in the failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["test_triton_attention_interpreted.py", "test_triton_engine_interpreted.py"])
def test_interpreted_tests_pass_in_their_own_process(module: str):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(f"this process already interprets: {module} runs in it directly")
    suite = Path(__file__).with_name(module)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
