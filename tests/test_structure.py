"""The file-level structure: no two modules import each other (directly or round a longer loop), and
no module is longer than `MAX_LINES`. `test_layering` keeps the package-level rule; this one keeps
the module-level one inside each package.

Imports are read with `ast` (nothing is imported) by `test_layering`'s scanner, so an import inside
a function or under `if TYPE_CHECKING:` counts: it hides a cycle from Python's import machinery,
not from a reader.

Scope of the size rule: the code a user or a reader of the pipeline reads (the package, the
launchers, tools, experiment configs). Not `tests/` (under `--dist loadfile` a test module is the
unit a worker runs, and its module-scoped fixtures, a trained tiny run among them, are built once
per module: splitting one builds them again) nor `benchmarks/` (each is one measurement script,
run and cited by its path and commit in docs/results.md).
"""

from __future__ import annotations

import pathlib

import pytest
from test_layering import PACKAGE, ROOT, _imported_modules, _module_name

MAX_LINES = 700
SIZED = ("trackstar_jax", "launch", "tools", "experiments")


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """{module name: path} of every module of the package under `root` (a package is its `__init__`)."""
    return {_module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def _import_graph(root: pathlib.Path) -> dict[str, dict[str, int]]:
    """{module: {imported module of the package: first line}}. `from a.b import c` is `a.b.c` when
    that is a module, else `a.b` (c a name in it): the longest prefix that is a module."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, imported in _imported_modules(path, root):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            dst = ".".join(parts)
            if parts and dst != name and dst not in edges:
                edges[dst] = line
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _describe(cycle: list[str], graph: dict[str, dict[str, int]], root: pathlib.Path) -> str:
    modules = _modules(root)
    edges = [
        f"  {modules[a].relative_to(root)}:{graph[a][b]} imports {b}" for a in cycle for b in cycle if b in graph[a]
    ]
    return " <-> ".join(cycle) + "\n" + "\n".join(edges)


def _oversized(root: pathlib.Path, dirs=SIZED, limit: int = MAX_LINES) -> list[str]:
    out = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root)}: {n} lines")
    return out


def test_no_module_imports_itself_round_a_loop():
    graph = _import_graph(ROOT)
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other (move the shared piece down a module):\n" + "\n".join(
        _describe(c, graph, ROOT) for c in cycles
    )


def test_no_module_is_over_the_size_limit():
    big = _oversized(ROOT)
    assert not big, f"modules over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(big)


@pytest.mark.parametrize(
    "files, expect",
    [
        # a function-level import and a TYPE_CHECKING one still make a cycle
        (
            {
                "a.py": "def f():\n    from trackstar_jax.pkg import b\n",
                "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trackstar_jax.pkg.a import X\n",
            },
            [["trackstar_jax.pkg.a", "trackstar_jax.pkg.b"]],
        ),
        # a longer loop, through a relative import and a package's __init__
        (
            {
                "__init__.py": "from .a import f\n",
                "a.py": "import trackstar_jax.pkg.b as b\n",
                "b.py": "from trackstar_jax.pkg import f\n",
            },
            [["trackstar_jax.pkg", "trackstar_jax.pkg.a", "trackstar_jax.pkg.b"]],
        ),
        # importing downward only, and importing a name of a module, is no cycle
        ({"a.py": "from trackstar_jax.pkg.b import X\n", "b.py": "import os\nX = 1\n"}, []),
    ],
)
def test_the_cycle_finder_sees_every_import_form(tmp_path, files, expect):
    """A planted cycle is found whatever form its imports take (else the test above passes vacuously)."""
    pkg = tmp_path / PACKAGE / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    files = {"__init__.py": "", **files}
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert _cycles(_import_graph(tmp_path)) == expect


def test_the_size_check_counts_lines(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "ok.py").write_text("x = 1\n" * 10)
    (tmp_path / "d" / "big.py").write_text("x = 1\n" * 11)
    assert _oversized(tmp_path, ("d",), limit=10) == ["d/big.py: 11 lines"]
