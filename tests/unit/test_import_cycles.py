"""No two of our modules import each other, directly or round a longer circle.

A circle works at run time only while every module in it is careful about what it uses at import
time, and it makes the modules impossible to understand one at a time. Imports under
``TYPE_CHECKING`` and inside functions count too: they are the usual way a circle hides.
``from package import submodule`` is an edge to the submodule, not to the package's ``__init__``
(a submodule's own package is always initialised first, by Python, not by the import).
"""

from __future__ import annotations

import ast
from pathlib import Path

import nvrx

REPO = Path(nvrx.__file__).resolve().parents[1]  # the directory holding the installed `nvrx` package


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "nvrx").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(node: ast.AST, known: dict[str, Path]) -> set[str]:
    """Our modules that NODE (an import statement) imports."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
        return set()
    submodules = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
    names = {a.name for a in node.names if f"{node.module}.{a.name}" not in known}
    return submodules | ({node.module} if names and node.module in known else set())


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    graph = {}
    for name, path in known.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            deps |= imported(node, known)
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    assert circles(import_graph(REPO)) == []


def test_a_circle_through_type_checking_is_found(tmp_path):
    # the check itself can fail: the old session <-> wrapper circle (one side only under TYPE_CHECKING)
    pkg = tmp_path / "nvrx" / "launcher" / "rank"
    pkg.mkdir(parents=True)
    (tmp_path / "nvrx" / "__init__.py").write_text("")
    (tmp_path / "nvrx" / "launcher" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "wrapper.py").write_text("from nvrx.launcher.rank.session import Session\n")
    (pkg / "session.py").write_text("from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    from nvrx.launcher.rank.wrapper import Wrapper\n")
    (pkg / "other.py").write_text("from nvrx.launcher.rank import session\n")
    assert circles(import_graph(tmp_path)) == [["nvrx.launcher.rank.session", "nvrx.launcher.rank.wrapper"]]


def test_a_submodule_importing_a_sibling_through_its_package_is_no_circle(tmp_path):
    pkg = tmp_path / "nvrx" / "monitors"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from nvrx.monitors.a import A\n")
    (pkg / "a.py").write_text("from nvrx.monitors import b\nA = 1\n")
    (pkg / "b.py").write_text("")
    assert circles(import_graph(tmp_path)) == []
