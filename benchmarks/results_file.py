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
    command = shlex.join(["python", "-m", Path(sys.argv[0]).with_suffix("").as_posix().replace("/", "."),
                          *sys.argv[1:]]) if sys.argv[0].endswith(".py") else shlex.join(sys.argv)
    stamped = {"command": command, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               **payload}
    path.write_text(json.dumps(stamped, indent=2))
    return path
