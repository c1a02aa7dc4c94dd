"""No import circle in outrate/, vllm_integration/ or benchmarks/, named when
one comes back. The packages are also held by import-linter's
`acyclic_siblings` contract (pyproject.toml, `make lint`); benchmarks/ is a
folder of scripts that import each other by file name, which import-linter
cannot see, so this test reads every `import` in them (at any depth: a
function-level import closes a circle as surely as a top-level one)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Each strongly connected set of two or more modules (or one importing
    itself), as a cycle through it: Tarjan's algorithm, then a walk."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1 or v in graph.get(v, ()):
                found.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_walk(graph, part) for part in found]


def _walk(graph: Mapping[str, Iterable[str]], part: set[str]) -> list[str]:
    """A cycle inside one strongly connected set, from its first module back to it."""
    start = min(part)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph.get(path[-1], ()) if w in part)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1 or (back and len(part) == 1):
            return [*path, start]
        fresh = [w for w in nxt if w not in seen]
        if not fresh:  # every way on was seen: close the cycle where it meets itself
            w = nxt[0]
            return [*path[path.index(w) :], w]
        path.append(fresh[0])
        seen.add(fresh[0])


def script_graph(folder: Path) -> dict[str, set[str]]:
    """Which script of `folder` imports which (by file name), at any depth."""
    names = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for p in sorted(folder.glob("*.py")):
        out = graph.setdefault(p.stem, set())
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            out.update(m.split(".")[0] for m in mods if m.split(".")[0] in names)
    return graph


def package_graph(*packages: str) -> dict[str, set[str]]:
    grimp = pytest.importorskip("grimp")
    g = grimp.build_graph(*packages)
    return {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}


def test_the_cycle_finder_names_a_cycle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": {"a"}}) == [["a", "a"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_benchmarks_import_no_circle():
    found = circles(script_graph(REPO / "benchmarks"))
    assert not found, "import circles in benchmarks/: " + "; ".join(" -> ".join(c) for c in found)


def test_packages_import_no_circle():
    """Module by module (import-linter's contract judges packages by their
    siblings; this names the modules)."""
    found = circles(package_graph("outrate", "vllm_integration"))
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
