"""Runs the interpreter tests (test_tree_attention.py) in a fresh process with TRITON_INTERPRET=1.

Triton's interpreter needs that variable before triton is first imported, and setting it here would
leak into every later test of this process (and break compiling kernels); a child process keeps it
contained. The child's pytest output is in the failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_interpreted_kernel_tests_pass_in_their_own_process():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process already interprets: test_tree_attention.py runs in it directly")
    suite = Path(__file__).with_name("test_tree_attention.py")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"
