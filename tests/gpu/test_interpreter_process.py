"""Runs tests/gpu/test_triton_attention_interpreted.py in a fresh process with TRITON_INTERPRET=1.

That module needs the variable before triton is first imported and the Triton "cpu" stand-in before
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


def test_triton_attention_tests_pass_in_an_interpreting_process():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process already interprets: test_triton_attention_interpreted.py runs in it directly")
    suite = Path(__file__).with_name("test_triton_attention_interpreted.py")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
