"""Which test modules a ``-m`` expression deselects whole, known before importing them: every xdist worker imports
every collected module, and the modules of model, process and Triton tests import seconds of libraries that
`make test-fast` then deselects. A module's ``pytestmark`` marks all its tests, so when the expression is false for
those marks together with any of the others it names, no test of the module can be selected and tests/conftest.py
leaves the module uncollected.

The ``pytestmark`` line is evaluated alone, after the module's imports of ``pytest`` and of ``tests.*`` helpers (so
``pytestmark = TRITON_MARKS`` reads as it does in the module); a module whose line needs anything else is collected
as usual, as is every module when the expression is not one this can judge."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression  # fenced by tests/test_module_marks.py


def deselects_whole_module(path: Path, mark_expression: str) -> bool:
    """True when no test of the module at ``path`` can match ``mark_expression`` whatever marks its tests add."""
    if not mark_expression or "=" in mark_expression:  # keyword arguments of marks: not judged here
        return False
    try:
        marks = module_marks(path)
        expression = Expression.compile(mark_expression)
    except Exception:  # a module that does not parse is the collector's to report; an expression, pytest's
        return False
    if marks is None:
        return False
    others = sorted(expression.idents() - marks)
    return not any(expression.evaluate(_matcher(marks.union(added)))
                   for size in range(len(others) + 1) for added in itertools.combinations(others, size))


def module_marks(path: Path) -> frozenset[str] | None:
    """The names of the marks the module's ``pytestmark`` puts on all its tests; None without one (or with one that
    needs more than ``pytest`` and ``tests.*`` helpers to evaluate)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    assignment = next((node for node in tree.body if isinstance(node, ast.Assign)
                       and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)),
                      None)
    if assignment is None:
        return None
    used = {node.id for node in ast.walk(assignment.value) if isinstance(node, ast.Name)}
    module = ast.fix_missing_locations(ast.Module(body=[*_helper_imports(tree, used), assignment], type_ignores=[]))
    namespace: dict[str, object] = {}
    try:
        exec(compile(module, str(path), "exec"), namespace)
    except NameError:
        return None
    marks = namespace["pytestmark"]
    marks = marks if isinstance(marks, (list, tuple)) else [marks]
    if not all(isinstance(mark, pytest.MarkDecorator) for mark in marks):
        return None
    return frozenset(mark.name for mark in marks)


def _helper_imports(tree: ast.Module, used: set[str]) -> list[ast.stmt]:
    """``import pytest``, and the imports from ``tests.*`` helpers of the names the ``pytestmark`` line uses (not the
    module's other names: the point is not to import what the module needs)."""
    imports: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Import) and all(alias.name == "pytest" for alias in node.names):
            imports.append(node)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tests":
            names = [alias for alias in node.names if (alias.asname or alias.name) in used]
            if names:
                imports.append(ast.ImportFrom(module=node.module, names=names, level=0))
    return imports


def _matcher(names: frozenset[str]):
    return lambda name, /, **kwargs: name in names
