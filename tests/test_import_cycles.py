"""No import cycles between the project's packages, but the ones named in KNOWN_CYCLE_EDGES.

A package is a directory with an ``__init__.py`` (``gateway.semantic`` is one, apart from ``gateway``); package A
depends on package B when any module of A imports a module of B, at its top or inside a function (a lazy import
hides a cycle from the interpreter, not from a reader). The check reads the source (ast), so it imports nothing."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "engines", "kernels", "wire", "http_plumbing", "compat", "benchmarks")

# Each edge here, (package, package it imports) -> why, allows the cycle it closes; there are none now, and a new
# one should be restructured away rather than listed. The test fails on any other cycle, and when an edge here no
# longer closes one (then drop it from this list).
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    modules = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


@cache  # the source does not change during a run
def package_dependencies() -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> the importing places, as ``module:line``."""
    modules = _modules()

    def package_of(module: str) -> str:
        return module if modules[module][1] else module.rpartition(".")[0]

    def project_module(name: str) -> str | None:  # "gateway.config.GatewayConfig" -> "gateway.config"
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, (path, _) in modules.items():
        here = package_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            imported = {package_of(target) for name in names if (target := project_module(name))}
            for other in sorted(imported - {here}):
                edges[here, other].append(f"{module}:{node.lineno}")
    return edges


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    graph = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                on_stack.discard(member)
                component.append(member)
            on_stack.discard(node)
            if component:
                found.append(sorted(component + [node]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_packages_but_the_known_ones():
    edges = package_dependencies()
    unknown = {edge: places for edge, places in edges.items() if edge not in KNOWN_CYCLE_EDGES}
    report = []
    for component in cycles(unknown):
        report.append(" <-> ".join(component))
        report += [f"    {a} -> {b}: {', '.join(places[:3])}" for (a, b), places in sorted(unknown.items())
                   if a in component and b in component]
    assert not report, "import cycles between packages:\n" + "\n".join(report)


def test_each_known_cycle_edge_still_closes_a_cycle():
    edges = package_dependencies()
    for edge in KNOWN_CYCLE_EDGES:
        assert edge in edges, f"{edge[0]} no longer imports {edge[1]}: drop it from KNOWN_CYCLE_EDGES"
        assert any(set(edge) <= set(component) for component in cycles(edges)), (
            f"{edge[0]} -> {edge[1]} closes no cycle any more: drop it from KNOWN_CYCLE_EDGES")


def test_the_check_finds_a_cycle():
    assert cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == [["a", "b", "c"]]
    assert cycles({("a", "b"): [], ("b", "c"): []}) == []
