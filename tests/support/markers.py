"""Markers that tests get from the fixtures they use: what a fixture costs (a model load, a process, a browser) is
said once, where the fixture is defined, and every test using it, directly or through another fixture, is marked.
The markers are registered in pyproject.toml; `make test-fast` deselects model, subprocess, browser and slow.
A module whose every test gets such a mark says so in its ``pytestmark`` as well: `make test-fast` then leaves the
module unimported (tests/support/module_marks.py) instead of importing its libraries in each worker to deselect it."""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

# fixture name -> the markers of its users (fixture names are unique across the suite where they carry marks)
MARKS_OF_FIXTURES: dict[str, tuple[str, ...]] = {}


def marks_users(*marks: str) -> Callable[[F], F]:
    """Put under ``@pytest.fixture``: the tests that use this fixture get ``marks``."""

    def register(fixture_function: F) -> F:
        name = fixture_function.__name__
        if MARKS_OF_FIXTURES.get(name, marks) != marks:
            raise ValueError(f"two fixtures named {name!r} mark their users differently: rename one")
        MARKS_OF_FIXTURES[name] = marks
        return fixture_function

    return register
