"""The package's import graph has the shape docs/architecture.md describes: no module imports
itself through others, no two packages import each other, the runtime never imports pruning
(the runtime drives it through ``elaswave.runtime.prunehook``), and the runtime's subpackages
(``comm``, ``strategies``, ``workload``, ``durable``, ``integrity``) form no cycle.

Read from the source with ``ast``: every import counts, at module level or inside a function,
except those under ``if TYPE_CHECKING:`` (annotations only, never executed).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "elaswave"

Graph = dict[str, set[str]]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """The modules a module imports: ``from a import b`` imports module ``a.b`` where there is
    one, else ``a`` (a name ``a`` defines). A package's ``__init__`` that runs only because one
    of its modules is imported is not counted: every module would then import its package's."""

    def __init__(self, module: str, is_package: bool, *, known: Collection[str]) -> None:
        self.package = module.split(".") if is_package else module.split(".")[:-1]
        self.known = known
        self.names: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package[: len(self.package) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            module = f"{source}.{alias.name}"
            self.names.add(module if module in self.known else source)


def _graph() -> Graph:
    """Module -> the package's modules it imports."""
    modules = _modules()
    graph: Graph = {}
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", known=modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = {n for n in visitor.names if n in modules and n != name}
    return graph


def _cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                        out.append(sorted(component))
    return out


def _collapse(graph: Graph, group: Callable[[str], str | None]) -> Graph:
    """The graph between groups of modules (``group``: a module's group, None: left out)."""
    out: Graph = defaultdict(set)
    for module, imported in graph.items():
        a = group(module)
        if a is None:
            continue
        out.setdefault(a, set())
        for other in imported:
            b = group(other)
            if b is not None and b != a:
                out[a].add(b)
    return dict(out)


def _edges(graph: Graph, group: Callable[[str], str | None], cycle: Iterable[str]) -> list[str]:
    """Every module edge between two groups of ``cycle``, for a failure's message."""
    groups = set(cycle)

    def inside(module: str) -> str | None:
        g = group(module)
        return g if g in groups else None

    return [
        f"{m} -> {d}"
        for m in sorted(graph)
        for d in sorted(graph[m])
        if inside(m) is not None and inside(d) is not None and inside(m) != inside(d)
    ]


def _top(module: str) -> str:
    """``elaswave.X`` for a module of package ``X`` or the top-level module ``X``."""
    return ".".join(module.split(".")[:2])


def _runtime_subpackage(module: str) -> str | None:
    """``elaswave.runtime.X`` for a module of the runtime's subpackage ``X``; None for the
    runtime's own top-level modules and everything outside it."""
    parts = module.split(".")
    if parts[:2] != [PACKAGE, "runtime"] or len(parts) < 3:
        return None
    sub = ".".join(parts[:3])
    return sub if (ROOT / Path(*parts[:3])).is_dir() else None


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(_graph()) == []


def test_no_two_top_level_packages_import_each_other() -> None:
    graph = _graph()
    cycles = _cycles(_collapse(graph, _top))
    assert not cycles, [_edges(graph, _top, c) for c in cycles]


def test_the_runtime_never_imports_pruning() -> None:
    found = {
        (m, d)
        for m, imported in _graph().items()
        if m.startswith("elaswave.runtime")
        for d in imported
        if d == "elaswave.prune" or d.startswith("elaswave.prune.")
    }
    assert found == set()


def test_no_cycle_between_the_runtimes_subpackages() -> None:
    graph = _graph()
    collapsed = _collapse(graph, _runtime_subpackage)
    assert {"elaswave.runtime.strategies", "elaswave.runtime.integrity"} <= set(collapsed)
    cycles = _cycles(collapsed)
    assert not cycles, [_edges(graph, _runtime_subpackage, c) for c in cycles]


def test_the_reader_sees_what_an_import_cycle_looks_like() -> None:
    """The helpers find a cycle where there is one, and skip annotation-only imports."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    visitor = _Imports("elaswave.x.y", False, known={"elaswave.x.z"})
    visitor.visit(
        ast.parse(
            "from typing import TYPE_CHECKING\n"
            "from . import z\n"
            "from elaswave.x import name\n"
            "if TYPE_CHECKING:\n    from elaswave.hidden import H\n"
            "def f():\n    import elaswave.lazy\n"
        )
    )
    assert visitor.names == {"typing", "elaswave.x.z", "elaswave.x", "elaswave.lazy"}
