"""Runs each TRITON_INTERPRET=1 module of the suite in a fresh process, and fails unless its tests ran
and passed: the kernels against the reference (kernels/test_tree_attention.py), our TRITON_ATTN
subclass on vLLM batches (gpu/test_triton_attention_interpreted.py) and a real engine through our
Triton backend (gpu/test_triton_engine_interpreted.py, the slowest).

Those modules need the variable before triton is first imported, and the gpu ones the Triton "cpu"
stand-in before vLLM is first imported (`gpu/triton_cpu_backend.py`); both would leak into every later
test of this process (and break compiling kernels), so a child process keeps them contained. Each
module skips itself in a process without the variable, and a test inside may skip too; a child that
ran nothing must not pass. So besides exit status 0, the child's JUnit report must count at least one
test, none skipped, failed or in error. The child's pytest output is in the failure message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
INTERPRETED_MODULES = [
    "kernels/test_tree_attention.py",
    "gpu/test_triton_attention_interpreted.py",
    "gpu/test_triton_engine_interpreted.py",
    "v2/test_v2_greedy.py",
    "v2/test_v2_traps.py",
    "v2/test_v2_preemption.py",
    "v2/test_v2_sampling.py",
    "v2/test_v2_logprobs.py",
    "v2/test_v2_tp.py",
    "v2/test_v2_triton_layer.py",
    "v2/test_v2_request_features.py",
    "v2/test_v2_dflash2.py",
]


def junit_counts(report: Path) -> dict[str, int]:
    """{"tests", "failures", "errors", "skipped"} of a pytest JUnit XML report (one test suite)."""
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"no <testsuite> in {report}"
    return {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}


def ran_and_passed(counts: dict[str, int]) -> bool:
    """At least one test ran, and every collected test passed (a skipped one counts against)."""
    return counts["tests"] >= 1 and counts["failures"] == counts["errors"] == counts["skipped"] == 0


@pytest.mark.parametrize("module", INTERPRETED_MODULES)
def test_interpreted_tests_run_and_pass_in_their_own_process(module: str, tmp_path: Path):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(f"this process already interprets: {module} runs in it directly")
    report = tmp_path / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(TESTS / module)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, check=False)
    output = f"{' '.join(command)}:\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"
    assert result.returncode == 0, f"failed (exit status {result.returncode}) {output}"
    counts = junit_counts(report)
    assert ran_and_passed(counts), f"ran no test or skipped some: {counts} {output}"


@pytest.mark.parametrize(
    ("counts", "accepted"),
    [
        ({"tests": 3, "failures": 0, "errors": 0, "skipped": 0}, True),
        ({"tests": 0, "failures": 0, "errors": 0, "skipped": 0}, False),  # nothing collected
        ({"tests": 1, "failures": 0, "errors": 0, "skipped": 1}, False),  # the module skipped itself
        ({"tests": 3, "failures": 0, "errors": 0, "skipped": 1}, False),
        ({"tests": 3, "failures": 1, "errors": 0, "skipped": 0}, False),
        ({"tests": 3, "failures": 0, "errors": 1, "skipped": 0}, False),
    ],
)
def test_a_child_that_ran_nothing_or_skipped_is_not_a_pass(counts: dict[str, int], accepted: bool):
    assert ran_and_passed(counts) is accepted


def test_a_module_that_skips_itself_is_not_a_pass(tmp_path: Path):
    """The report the check reads: an interpreted module in a process without TRITON_INTERPRET skips
    at module level, which the report counts as a skipped test, so the check refuses it whatever the
    exit status."""
    report = tmp_path / "junit.xml"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(TESTS / INTERPRETED_MODULES[0])]
    subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    counts = junit_counts(report)
    assert counts["skipped"] >= 1 and not ran_and_passed(counts), counts
