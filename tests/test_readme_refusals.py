"""The README's table of refusals is `vllm_ddtree.vllm.support.REFUSALS`, row for row.

`REFUSALS` is the one list of what method 'ddtree' refuses; the README renders it (one row per
record: `| feature | when | fix |`, in the list's order) under the heading `REFUSALS_HEADING`. The list
is read from support.py's source without importing it (support.py imports vLLM): its module-level
statements other than vLLM imports and other classes are executed, which defines `Refusal`, the shared
fix strings and `REFUSALS`. Needs neither vLLM nor torch.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(ROOT, "vllm_ddtree", "vllm", "support.py")
README = os.path.join(ROOT, "README.md")
REFUSALS_HEADING = "### What method ddtree refuses"
WHEN = ("start", "request")


def _is_vllm_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "vllm"
    return isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "vllm" for alias in node.names)


def load_refusals() -> list[tuple[str, str, str]]:
    """support.REFUSALS as (feature, when, fix) tuples, from the source file."""
    with open(SUPPORT) as f:
        tree = ast.parse(f.read(), SUPPORT)
    kept = [
        node
        for node in tree.body
        if not _is_vllm_import(node) and not (isinstance(node, ast.ClassDef) and node.name != "Refusal")
    ]
    namespace: dict = {"__name__": "support_source"}
    exec(compile(ast.Module(body=kept, type_ignores=[]), SUPPORT, "exec"), namespace)
    return [tuple(refusal) for refusal in namespace["REFUSALS"]]


def render(refusal: tuple[str, str, str]) -> str:
    return "| " + " | ".join(refusal) + " |"


def readme_refusal_rows() -> list[str]:
    """The body rows of the first table under REFUSALS_HEADING (header and separator rows left out)."""
    with open(README) as f:
        lines = f.read().splitlines()
    assert REFUSALS_HEADING in lines, f"README.md has no line {REFUSALS_HEADING!r}"
    section = lines[lines.index(REFUSALS_HEADING) + 1 :]
    section = section[: next((i for i, line in enumerate(section) if line.startswith("#")), len(section))]
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    table = []
    for line in section[start:]:
        if not line.startswith("|"):
            break
        table.append(line.rstrip())
    assert len(table) >= 2 and set(table[1]) <= set("|-: "), "the refusals table needs a header and a separator row"
    return table[2:]


REFUSALS = load_refusals()


def test_the_list_is_not_empty_and_holds_both_kinds():
    assert {when for _, when, _ in REFUSALS} == set(WHEN)


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r[0][:40])
def test_every_refusal_is_a_well_formed_table_row(refusal):
    feature, when, fix = refusal
    assert when in WHEN
    for text in (feature, fix):
        assert text.strip() and "|" not in text and "\n" not in text


def test_every_refusal_appears_in_the_readme():
    rows = readme_refusal_rows()
    missing = [render(r) for r in REFUSALS if render(r) not in rows]
    assert not missing, "rows of support.REFUSALS missing from README.md:\n" + "\n".join(missing)


def test_the_readme_lists_no_refusal_the_list_lacks_in_the_lists_order():
    rows = readme_refusal_rows()
    expected = [render(r) for r in REFUSALS]
    extra = [row for row in rows if row not in expected]
    assert not extra, "README.md refusals not in support.REFUSALS:\n" + "\n".join(extra)
    assert rows == expected, "README.md's refusals table should be:\n" + "\n".join(expected)
