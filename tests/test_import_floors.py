"""The import floors of docs/architecture.md hold: no module imports from a floor above its own,
and no two modules import each other, directly or through others (a cycle on one floor).

The map of the floors is read from docs/architecture.md ("Import floors"), so the page stays the
one map. Every import counts: module level, inside functions, under `if TYPE_CHECKING:`,
relative ones resolved, and `importlib.import_module("...")` with a literal name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jpaged", "models", "pallas_kernels")
DOC = ROOT / "docs" / "architecture.md"
_FLOOR_LINE = re.compile(r"^([1-9])\. ")
_PATH = re.compile(r"`((?:jpaged|models|pallas_kernels)/[\w/]*(?:\.py|/)?)`")


def floor_map(text: str) -> dict[str, int]:
    """{module or package path as written ('jpaged/config.py', 'jpaged/core/'): floor}."""
    section = text.split("## Import floors", 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    current = None
    for line in section.splitlines():
        m = _FLOOR_LINE.match(line)
        if m:
            current = int(m.group(1))
        elif not line.startswith("   "):  # a numbered item continues on indented lines only
            current = None
        if current is not None:
            for path in _PATH.findall(line):
                if path in floors:
                    raise AssertionError(f"{path} stands on two floors in {DOC}")
                floors[path] = current
    return floors


def module_name(path: Path) -> str:
    """'jpaged.core.block_hash' for jpaged/core/block_hash.py, 'jpaged.core' for its __init__."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def floor_of(path: Path, floors: dict[str, int]) -> int | None:
    """The floor of a module file: its own entry, else that of the nearest package named."""
    rel = path.relative_to(ROOT).as_posix()
    if rel in floors:
        return floors[rel]
    parent = Path(rel).parent
    while parent != Path("."):
        if f"{parent.as_posix()}/" in floors:
            return floors[f"{parent.as_posix()}/"]
        parent = parent.parent
    return None


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of the three packages in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, `level - 1` packages up
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import mod` imports the submodule pkg.mod; `from mod import f`, mod.
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else source))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) == "import_module")):
            found.append((node.lineno, node.args[0].value))
    return sorted({(line, mod) for line, mod in found if mod.split(".")[0] in PACKAGES})


def target_path(mod: str, modules: dict[str, Path]) -> Path:
    """The file an imported dotted name runs: the module, else its nearest enclosing one."""
    while mod not in modules:  # `import jpaged.core.x.attr`-like names: the enclosing module
        mod = mod.rpartition(".")[0]
    return modules[mod]


def upward_imports(floors: dict[str, int]) -> list[str]:
    """'file:line imports module (floor b > floor a)' for every import from a higher floor."""
    modules = all_modules()
    bad = []
    for name, path in modules.items():
        mine = floor_of(path, floors)
        for line, mod in imports_of(path, name, modules):
            theirs = floor_of(target_path(mod, modules), floors)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} "
                           f"(floor {theirs}) from floor {mine}")
    return bad


def import_graph() -> dict[str, set[str]]:
    """{module: the modules it imports} over the three packages (every kind of import)."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {module_name(target_path(mod, modules))
                       for _, mod in imports_of(path, name, modules)} - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another (strongly connected, 2 or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):  # Tarjan's algorithm, iterative (no recursion limit)
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return sorted(cycles)


@pytest.fixture(scope="module")
def floors() -> dict[str, int]:
    return floor_map(DOC.read_text())


def test_the_map_names_only_what_exists(floors):
    missing = [p for p in floors if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md's import floors name what does not exist: {missing}"


def test_every_module_stands_on_a_floor(floors):
    unassigned = [str(p.relative_to(ROOT)) for p in all_modules().values()
                  if floor_of(p, floors) is None]
    assert not unassigned, (
        f"no import floor for {unassigned}: add each to the floor list in docs/architecture.md "
        "(\"Import floors\"), which tests/test_import_floors.py reads")


def test_no_import_runs_upward(floors):
    bad = upward_imports(floors)
    assert not bad, "imports from a higher floor (docs/architecture.md, Import floors):\n" + \
        "\n".join(bad)


def test_the_checker_sees_every_kind_of_import(tmp_path, floors, monkeypatch):
    """A lowest-floor module importing upward in each way the checker knows is caught."""
    src = ("from __future__ import annotations\n"
           "from typing import TYPE_CHECKING\n"
           "import jpaged.runner.batch\n"
           "from .core import block_pool\n"
           "if TYPE_CHECKING:\n"
           "    from jpaged.engine import LLMEngine\n"
           "def f():\n"
           "    from jpaged import llm\n"
           "    import importlib\n"
           "    return importlib.import_module('jpaged.cli')\n")
    path = ROOT / "jpaged" / "config.py"
    modules = all_modules()
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text",
                        lambda self, *a, **k: src if self == path else real_read(self, *a, **k))
    found = imports_of(path, "jpaged.config", modules)
    assert sorted(m for _, m in found) == ["jpaged.cli", "jpaged.core.block_pool",
                                           "jpaged.engine", "jpaged.llm", "jpaged.runner.batch"]
    bad = [line for line in upward_imports(floors) if line.startswith("jpaged/config.py")]
    assert len(bad) == 5, bad


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, ("modules that import each other (move what they share down into a "
                        "module both import):\n" + "\n".join(" <-> ".join(c) for c in cycles))


def test_the_cycle_finder_sees_long_and_short_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"},
             "g": {"g"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e", "f"]]
