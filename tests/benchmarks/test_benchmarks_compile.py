"""Every benchmark script compiles: they run by hand, not in CI, so a broken one would otherwise go
unnoticed (apps.py once had `await` in a plain function, a SyntaxError only compiling reports)."""

from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[2] / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_compiles(script: Path):
    compile(script.read_text(), str(script), "exec")
