"""Imported by Python at start-up in every process whose PYTHONPATH holds this folder (besides the repository
root): in a TRITON_INTERPRET=1 process it registers the Triton "cpu" stand-in (`tests/gpu/triton_cpu_backend.py`).

`test_v2_tp.py` puts the folder on PYTHONPATH for the tensor-parallel workers, which vLLM's CPU platform
starts by spawning fresh interpreters; they import vLLM before any test code could run in them, and the
stand-in must be registered before that (vLLM decides at import whether Triton is on)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.gpu.triton_cpu_backend import register_cpu_backend_stand_in

    register_cpu_backend_stand_in()
