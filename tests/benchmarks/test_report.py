"""The results the README and docs/benchmarks.md show are the committed JSON's: `python -m benchmarks.report --check`
passes on this checkout, and fails on a copy whose figures, files or folder disagree."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.report", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_committed_tables_match_their_result_files():
    checked = _run("--check")
    assert checked.returncode == 0, checked.stderr


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what the report reads and writes."""
    shutil.copy(REPO / report.README, tmp_path / report.README)
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / report.DOC, tmp_path / report.DOC)
    shutil.copytree(REPO / report.RESULTS_DIR, tmp_path / report.RESULTS_DIR)
    assert _run("--check", "--root", str(tmp_path)).returncode == 0
    return tmp_path


def test_a_figure_typed_into_the_readme_is_caught(checkout: Path):
    readme = checkout / report.README
    row = next(r for r in report.entries(checkout) if r["json"] == report.CURRENT[0].file)
    assert f"**{row['ratio']}**" in readme.read_text()
    readme.write_text(readme.read_text().replace(f"**{row['ratio']}**", "**9.99x / 9.99x / 9.99x / 9.99x**", 1))
    checked = _run("--check", "--root", str(checkout))
    assert checked.returncode == 1 and "stale: README.md" in checked.stderr


def test_a_changed_result_file_makes_the_tables_stale_until_regenerated(checkout: Path):
    result = checkout / report.RESULTS_DIR / report.CURRENT[0].file
    data = json.loads(result.read_text())
    ours = next(name for name in data["tokens_per_s"] if name.startswith("ours"))
    data["tokens_per_s"][ours]["single"] *= 2
    result.write_text(json.dumps(data, indent=2))
    checked = _run("--check", "--root", str(checkout))
    assert checked.returncode == 1
    assert {"stale: README.md", "stale: docs/benchmarks.md", "stale: docs/benchmarks/current.json"} <= {
        line.split(" (")[0] for line in checked.stderr.splitlines()}
    assert _run("--root", str(checkout)).returncode == 0
    assert _run("--check", "--root", str(checkout)).returncode == 0
    listed = json.loads((checkout / report.INDEX).read_text())["results"]
    assert listed == report.entries(checkout) and listed[0]["json"] == report.CURRENT[0].file


def test_a_result_file_that_is_not_current_is_caught(checkout: Path):
    (checkout / report.RESULTS_DIR / "engine_vs_vllm_fp32_old_run.json").write_text("{}")
    checked = _run("--check", "--root", str(checkout))
    assert checked.returncode == 1 and "engine_vs_vllm_fp32_old_run.json" in checked.stderr


def test_a_result_must_say_how_when_and_where(checkout: Path):
    result = checkout / report.RESULTS_DIR / report.CURRENT[-1].file
    data = json.loads(result.read_text())
    del data["host"]
    result.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks host"):
        report.entries(checkout)


def test_the_table_stays_short():
    assert sum(row.readme for row in report.CURRENT) <= 12  # the README's; docs/benchmarks.md lists them all
