"""Adapter tests: the vLLM layer's engine-free pieces (compiled host kernels, the step object), no engine.

They import `vllm_ddtree.vllm`, which needs vLLM (and numba, which it brings): engine-agnostic installs
run tests/core only.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
