"""A benchmark's results as a JSON file a reader can check: the figures with the command that made them and when.

Figures the README quotes are written under docs/benchmarks/ (tracked); benchmarks/results/ is scratch."""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Any

TRACKED = Path("docs/benchmarks")


def write_results(path: Path | str, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` to ``path`` as JSON, with the command line and the UTC date added."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join([*_program(), *sys.argv[1:]])
    stamped = {"command": command, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               **payload}
    path.write_text(json.dumps(stamped, indent=2))
    return path


def _program() -> list[str]:
    """How the running benchmark was started: ``python -m benchmarks.x`` by its module name (argv[0] is then a
    file path, wherever the checkout lies), else the script as given."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
