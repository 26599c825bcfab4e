"""A benchmark's results as a JSON file a reader can check: the figures with the command that made them and when.

Figures the README quotes are written under docs/benchmarks/ (tracked) and listed in benchmarks/report.py, which
generates the README's results table and docs/benchmarks.md from them; benchmarks/results/ is scratch."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

TRACKED = Path("docs/benchmarks")


def write_results(path: Path | str, payload: dict[str, Any]) -> Path:
    """Writes ``payload`` to ``path`` as JSON, with the command line, the UTC date and the host added."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join([*_program(), *sys.argv[1:]])
    stamped = {"command": command, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "host": host(), **payload}
    path.write_text(json.dumps(stamped, indent=2))
    return path


def host() -> str:
    """The machine in a few words, as results name it: CPU model, widest vector ISA, CPUs this process may use
    (e.g. "AMD EPYC, AVX2, 2 CPUs"). Figures from different hosts are not comparable."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), platform.machine())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {isa}, {cpus} CPUs"


def _program() -> list[str]:
    """How the running benchmark was started: ``python -m benchmarks.x`` by its module name (argv[0] is then a
    file path, wherever the checkout lies), else the script as given."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]


def save_figure(figure: Any, path: Path | str, dpi: int = 120) -> None:
    """A finished matplotlib figure written beside its results file, and its memory let go."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
