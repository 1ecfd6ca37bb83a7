"""The table of vLLM members we rely on (`vllm_ddtree.vllm.surface`) is complete and the installed vLLM
has every one of them: an override of a method vLLM renamed would silently stop running.

Our classes are found by walking the vllm_ddtree.vllm modules, so a new subclass, a new mixin or a
split of a class needs no change here: the failure message lists the entries to add, remove or fix.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import sys
import types

import pytest

pytest.importorskip("vllm")

import vllm_ddtree
import vllm_ddtree.vllm
import vllm_ddtree.vllm.v1
from vllm_ddtree.vllm.surface import (
    SURFACE,
    IncompatibleVLLM,
    VLLMMember,
    available,
    check_vllm_surface,
    member_params,
    vllm_surface,
)

GPU_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
TP_GROUP = "vllm.distributed.parallel_state.GroupCoordinator"


def _is_vllm(cls: type) -> bool:
    return cls.__module__ == "vllm" or cls.__module__.startswith("vllm.")


def _is_ours(cls: type) -> bool:
    return cls.__module__.startswith("vllm_ddtree.")


def our_vllm_subclasses() -> list[type]:
    """Every class defined in a shared or V1-layer module (vllm_ddtree.vllm, vllm_ddtree.vllm.v1) with a vLLM
    class among its bases (imports them all). The V2 layer's classes answer to SURFACES["v2"] (tests/v2)."""
    found = []
    names = [info.name for info in pkgutil.iter_modules(vllm_ddtree.vllm.__path__, "vllm_ddtree.vllm.")]
    names += [info.name for info in pkgutil.iter_modules(vllm_ddtree.vllm.v1.__path__, "vllm_ddtree.vllm.v1.")]
    for name in names:
        module = importlib.import_module(name)
        found += [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type) and cls.__module__ == module.__name__ and any(map(_is_vllm, cls.__mro__))
        ]
    return found


def derived_overrides(classes: list[type]) -> dict[tuple[type, str], tuple[str, ...] | None]:
    """(vLLM class that defines the member, name) -> our override's `params`, for every name that one of
    `classes`, or a vllm_ddtree class above it in its MRO (a mixin), defines over a vLLM member.

    Not overrides: dunders (Python's and dataclasses' machinery; vLLM dispatches by its own names, and our
    constructors call vLLM's, declared as "read-method" entries) and ABCMeta's per-class `_abc_impl`.
    """
    overrides: dict[tuple[type, str], tuple[str, ...] | None] = {}
    for cls in classes:
        theirs = [klass for klass in cls.__mro__ if _is_vllm(klass)]
        for klass in filter(_is_ours, cls.__mro__):
            for name, value in vars(klass).items():
                if (name.startswith("__") and name.endswith("__")) or name == "_abc_impl":
                    continue
                owner = next((t for t in theirs if name in vars(t)), None)
                if owner is not None:
                    overrides.setdefault((owner, name), member_params(value, follow_wrapped=False))
    return overrides


def surface_mismatches(overrides: dict[tuple[type, str], tuple[str, ...] | None]) -> list[str]:
    """What SURFACE's "override" entries lack, have in excess or declare wrongly, given the overrides."""
    declared = {(m.owner_class(), m.name): m for m in SURFACE if m.kind == "override"}
    return (
        [
            f'add: VLLMMember("{owner.__module__}.{owner.__qualname__}", "{name}", "override", "<why>", params={params!r})'
            for (owner, name), params in overrides.items()
            if (owner, name) not in declared
        ]
        + [f"remove: {m} (nothing of ours overrides it)" for key, m in declared.items() if key not in overrides]
        + [
            f"fix: {m} (our override takes {overrides[key]!r})"
            for key, m in declared.items()
            if key in overrides and overrides[key] != m.params
        ]
    )


def test_every_override_of_ours_is_declared_with_its_signature():
    classes = our_vllm_subclasses()
    assert classes, "no subclass of a vLLM class found in vllm_ddtree.vllm"
    mismatches = surface_mismatches(derived_overrides(classes))
    assert not mismatches, "vllm_ddtree.vllm.surface.SURFACE is out of date:\n" + "\n".join(mismatches)


def unmarked_overrides(classes: list[type]) -> list[str]:
    """"Class.method" of every method of ours in `classes`' MROs that overrides a vLLM member without
    `@override` (typing_extensions)."""
    unmarked = set()
    for cls in classes:
        theirs = [klass for klass in cls.__mro__ if _is_vllm(klass)]
        for klass in filter(_is_ours, cls.__mro__):
            for name, value in vars(klass).items():
                function = getattr(value, "__func__", value)
                if callable(function) and not name.startswith("__") and any(name in vars(t) for t in theirs):
                    if not getattr(function, "__override__", False):
                        unmarked.add(f"{klass.__qualname__}.{name}")
    return sorted(unmarked)


def test_every_override_of_ours_is_marked_override():
    unmarked = unmarked_overrides(our_vllm_subclasses())
    assert not unmarked, f"add @override to: {unmarked}"


def test_an_override_in_a_new_mixin_is_reported_missing():
    """The completeness check above can fail: a method of a vllm_ddtree mixin that shadows a vLLM member
    (here SpecDecodeBaseProposer._greedy_sample) is an override that SURFACE does not declare."""
    from vllm_ddtree.vllm.v1.proposer import DDTreeProposer

    class GreedyMixin:
        __module__ = "vllm_ddtree.vllm.split"

        def _greedy_sample(self, hidden_states):
            raise NotImplementedError

    class SplitProposer(GreedyMixin, DDTreeProposer):
        __module__ = "vllm_ddtree.vllm.split"

    added = [line for line in surface_mismatches(derived_overrides([SplitProposer])) if line.startswith("add: ")]
    assert added == [
        'add: VLLMMember("vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer", "_greedy_sample", '
        "\"override\", \"<why>\", params=('hidden_states',))"
    ]


def test_installed_vllm_has_every_member():
    check_vllm_surface()
    kinds = {m.kind for m in vllm_surface()}
    assert kinds == {"override", "patch", "replace", "read-method", "read-attribute"}


def test_every_platform_checks_its_runner_paths_entries_at_start():
    """Off CPU the start-up check leaves out only the entries owned by vLLM's CPU-platform modules (which
    never run there, and are not imported there); the GPU runner's and everything shared stay."""
    from unittest import mock

    from vllm_ddtree.vllm import plugin
    from vllm_ddtree.vllm.surface import installed_surface

    everywhere, off_cpu = installed_surface(cpu=True), installed_surface(cpu=False)
    left_out = set(everywhere) - set(off_cpu)
    assert left_out and all(m.cpu_only for m in left_out) and not any(m.cpu_only for m in off_cpu)
    assert {m.owner.rsplit(".", 1)[0] for m in left_out} == {
        "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu_worker", "vllm.v1.attention.backends.cpu_attn"}
    assert any(m.owner == GPU_RUNNER for m in off_cpu) and any(m.kind == "patch" for m in off_cpu)
    check_vllm_surface(off_cpu)

    cuda = types.SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)
    with (
        mock.patch("vllm.platforms._current_platform", cuda),
        mock.patch.object(plugin, "check_vllm_surface") as check,
        mock.patch("vllm_ddtree.vllm.patches.apply_all"),
        mock.patch("vllm.v1.attention.backends.registry.register_backend") as register_backend,
    ):
        plugin.register()
    check.assert_called_once_with(off_cpu)
    assert register_backend.call_args.args[1] == plugin.GPU_ATTENTION_BACKEND


FAKES = [
    (VLLMMember(GPU_RUNNER, "_sample_v2", "override", "renamed method", params=("logits", "spec_decode_metadata")), "lacks it"),
    (VLLMMember(GPU_RUNNER, "_sample", "override", "one parameter fewer", params=("logits",)), r"has \(logits, spec_decode_metadata\)"),
    (VLLMMember(GPU_RUNNER, "_sample", "override", "reordered", params=("spec_decode_metadata", "logits", "...")), "has"),
    (VLLMMember(GPU_RUNNER, "_build_attention_metadata", "override", "3-tuple", params=("...",), returns_tuple=3), "unpack 3 values"),
    (VLLMMember(GPU_RUNNER, "input_batches", "read-attribute", "renamed attribute", created_in="__init__"), "does not set it"),
    (VLLMMember(GPU_RUNNER, "input_batch", "read-attribute", "moved", created_in="_init_batch"), "no method"),
    (VLLMMember(TP_GROUP, "broadcast", "read-method", "a required parameter we do not pass", params=()), r"has \(input_, src\)"),
    (VLLMMember(TP_GROUP, "broadcast", "read-method", "renamed keyword", params=("input_", "*", "source")), "has"),
    (VLLMMember("vllm.v1.sample.metadata.SamplingMetadata", "temperatures", "read-attribute", "no such field"), "lacks it"),
    (VLLMMember("vllm.v1.worker.gpu_model_runner_v9.GPUModelRunner", "_sample", "override", "moved", params=()), "has no"),
]


@pytest.mark.parametrize(("member", "problem"), FAKES, ids=[m.reason for m, _ in FAKES])
def test_check_names_a_member_vllm_lacks_or_changed(member, problem):
    with pytest.raises(IncompatibleVLLM, match=re.escape(str(member)) + r" \(.*\): .*" + problem):
        check_vllm_surface((member,))


def test_one_error_names_every_problem_and_nothing_else():
    with pytest.raises(IncompatibleVLLM) as raised:
        check_vllm_surface(tuple(filter(available, SURFACE)) + tuple(member for member, _ in FAKES))
    listed = [line for line in str(raised.value).splitlines() if line.startswith("- ")]
    assert [line.split(" (", 1)[0] for line in listed] == [f"- {member}" for member, _ in FAKES]


def code_of_ours_in_vllm() -> set[tuple[str, str]]:
    """(owner, name) of every function whose code lives in vllm_ddtree stored on a vLLM module or class."""
    package_dir = os.path.dirname(vllm_ddtree.__file__) + os.sep
    found = set()
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or not (module_name == "vllm" or module_name.startswith("vllm.")):
            continue
        namespaces = [(module_name, vars(module))] + [
            (f"{module_name}.{value.__qualname__}", vars(value))
            for value in list(vars(module).values())
            if isinstance(value, type) and value.__module__ == module_name
        ]
        for owner, namespace in namespaces:
            for name, value in list(namespace.items()):
                func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                if isinstance(func, types.FunctionType) and func.__code__.co_filename.startswith(package_dir):
                    found.add((owner, name))
    return found


def test_declared_patches_are_applied_and_are_all_of_our_code_in_vllm():
    """After the plugin ran (and every module of ours was imported), the only functions of ours on vLLM's
    modules and classes are the declared patches, which the surface lists as "patch" entries."""
    from vllm_ddtree.vllm import plugin
    from vllm_ddtree.vllm.patches import all_patches
    from vllm_ddtree.vllm.patching import is_patched

    plugin.register()
    our_vllm_subclasses()
    applied = [p for p in all_patches() if p.applies()]  # a patch may be scoped to other releases
    assert all(is_patched(p.owner, p.name) for p in applied)
    assert code_of_ours_in_vllm() == {(p.owner_name, p.name) for p in applied}
    assert {(m.owner, m.name) for m in vllm_surface() if m.kind == "patch"} == {(p.owner_name, p.name) for p in all_patches()}


def test_cpu_kernel_overrides_register_in_a_process_that_loaded_numba():
    """vLLM's CPU worker start rebinds its Triton kernels by scanning every module attribute; llvmlite's
    library wrapper (loaded with numba, our host kernels' compiler) broke that scan. With the plugin's
    patch the scan runs, and the wrapper is back where it was."""
    import llvmlite.binding.ffi as ffi
    from vllm.triton_utils import dispatcher

    from vllm_ddtree.vllm import plugin

    plugin.register()
    library = ffi.lib
    dispatcher._rebind_kernels([])
    assert ffi.lib is library
