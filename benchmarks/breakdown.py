"""Where an app's time goes, call by call, from what the gateway recorded of each semantic call (its graph node:
GET /v1/sessions/{id}/graph; gateway/semantic/graph.py's CallTimings).

For each call, in seconds:
  inputs    waiting for its inputs: from submitted to its last producer's end (0 with none)
  gap       from its last input produced (or its submission) to its request leaving the gateway for its engine:
            binding values, placement, admission; the gap between dependent calls the client would otherwise
            pay as a round trip (negative when it was handed to its engine ahead of its inputs)
  ttft      from its request sent to its first token back: the engine's queue and prefill (known when its text
            was streamed from the engine: a streaming client, or ``[semantic] stream_steps = true``)
  decode    from its first token to its answer
  engine    from its request sent to its answer (ttft + decode)
  after     from its answer to its output bound (the gateway's own, again)
  warmed    its prompt made ready ahead (a context fill or an upstream prefill), seconds after its submission

The engine's own split of a request's time into queue and prefill is not in an OpenAI answer: vLLM's /metrics
histograms have it per engine (``vllm:request_queue_time_seconds``, ``…prefill_time…``, ``…decode_time…``):
``engine_phases`` reads their sums, and the difference of two reads is that of the requests in between.

    python -m benchmarks.breakdown --url http://127.0.0.1:8000/v1 --app chain [--engine-metrics URL] [--set chunks=4]

runs the app once through the gateway (its default session) and prints the table, the totals, and the engines'
phases over the run when given their /metrics URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import time
from typing import Any, NamedTuple

import httpx

COLUMNS = ("inputs", "gap", "ttft", "decode", "engine", "after", "warmed")
ENGINE_PHASES = ("queue", "prefill", "decode", "inference")
# vLLM's prompt-token counters (0.32 names): tokens asked of the prefix cache, those found there, prompt tokens.
ENGINE_COUNTERS = {"prefix_queries": "vllm:prefix_cache_queries_total", "prefix_hits": "vllm:prefix_cache_hits_total",
                   "prompt_tokens": "vllm:prompt_tokens_total", "requests": "vllm:request_success_total"}


class CallTime(NamedTuple):
    id: str
    engine: str | None
    criteria: str
    submitted: float
    finished: float | None
    times: dict[str, float | None]  # COLUMNS -> seconds (None: not known)


def rows(graph: dict[str, Any], since: float = 0.0) -> list[CallTime]:
    """The finished calls of a session's graph submitted at or after ``since``, in submission order."""
    producers = {v["id"]: v.get("producer") for v in graph["variables"]}
    nodes = {c["id"]: c for c in graph["calls"]}
    found = []
    for call in sorted(graph["calls"], key=lambda c: c["submitted"]):
        if call["submitted"] < since or call.get("finished") is None:
            continue
        ends = [nodes[p]["finished"] for p in (producers.get(v) for v in call["inputs"].values())
                if p in nodes and nodes[p].get("finished") is not None]
        inputs_at = max(ends, default=call["submitted"])
        found.append(CallTime(call["id"], call.get("engine"), call["criteria"], call["submitted"], call["finished"], {
            "inputs": inputs_at - call["submitted"],
            "gap": _minus(call.get("dispatched"), inputs_at),
            "ttft": _minus(call.get("first_token"), call.get("dispatched")),
            "decode": _minus(call.get("answered"), call.get("first_token")),
            "engine": _minus(call.get("answered"), call.get("dispatched")),
            "after": _minus(call["finished"], call.get("answered")),
            "warmed": _minus(call.get("warmed"), call["submitted"]),
        }))
    return found


def _minus(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def totals(found: list[CallTime]) -> dict[str, float]:
    """Each column summed over the calls (what is known of it), and the run's wall time."""
    summed = {name: sum(row.times[name] or 0.0 for row in found) for name in COLUMNS if name != "warmed"}
    if found:
        summed["wall"] = max(row.finished or row.submitted for row in found) - min(row.submitted for row in found)
    return summed


def table(found: list[CallTime]) -> str:
    lines = [f"{'call':<14} {'engine':<12} {'criteria':<10} " + " ".join(f"{name:>7}" for name in COLUMNS)]
    for row in found:
        cells = " ".join(f"{row.times[name]:7.3f}" if row.times[name] is not None else f"{'-':>7}" for name in COLUMNS)
        lines.append(f"{row.id[:14]:<14} {(row.engine or '-')[:12]:<12} {row.criteria:<10} {cells}")
    summed = totals(found)
    lines.append("sum: " + ", ".join(f"{name} {value:.3f}s" for name, value in summed.items()))
    return "\n".join(lines)


def engine_phases(metrics_text: str) -> dict[str, float]:
    """The sums of an engine's per-request phase histograms (vLLM's names; what it exports of them)."""
    found = {}
    for phase in ENGINE_PHASES:
        values = re.findall(rf"^vllm:request_{phase}_time_seconds_sum(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M)
        if values:
            found[phase] = sum(float(v) for v in values)
    return found


def engine_counters(metrics_text: str) -> dict[str, float]:
    """An engine's prompt-token and prefix-cache counters (ENGINE_COUNTERS; summed over label sets)."""
    found = {}
    for key, name in ENGINE_COUNTERS.items():
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M)
        if values:
            found[key] = sum(float(v) for v in values)
    return found


def counters_line(old: dict[str, float], new: dict[str, float]) -> str:
    """The counters' growth over a run, and the prefix cache's hit fraction of the prompt tokens asked of it."""
    grown = {key: new[key] - old.get(key, 0.0) for key in new}
    line = ", ".join(f"{key} {value:.0f}" for key, value in grown.items())
    if grown.get("prefix_queries"):
        line += f", hit fraction {grown.get('prefix_hits', 0.0) / grown['prefix_queries']:.3f}"
    return line


async def default_session_graph(client: httpx.AsyncClient) -> dict[str, Any]:
    """The graph of the caller's default session (``client`` based at the gateway's /v1)."""
    sessions = (await client.get("/sessions")).json()["data"]
    default = next(s for s in sessions if s["default"])
    return (await client.get(f"/sessions/{default['id']}/graph")).json()


async def run(url: str, app: str, model: str, engine_metrics: list[str], settings: dict[str, str]) -> str:
    from benchmarks.workloads import WORKLOADS

    module = WORKLOADS[app]
    defaults = module.Config()
    config = dataclasses.replace(defaults, **{key: type(getattr(defaults, key))(value) if not isinstance(
        getattr(defaults, key), bool) else value.lower() in ("1", "true", "yes") for key, value in settings.items()})
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        before = [(await client.get(m)).text for m in engine_metrics]
        since = time.time()
        await module.run_parrot(client, model, config)
        found = rows(await default_session_graph(client), since)
        after = [(await client.get(m)).text for m in engine_metrics]
    report = [table(found)]
    for metrics, old_text, new_text in zip(engine_metrics, before, after):
        old, new = engine_phases(old_text), engine_phases(new_text)
        report.append(f"{metrics}: " + ", ".join(f"{phase} {new[phase] - old.get(phase, 0.0):.3f}s" for phase in new))
        report.append(f"{metrics}: " + counters_line(engine_counters(old_text), engine_counters(new_text)))
    return "\n".join(report)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the Parrot gateway")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--app", default="chain", help="a workload of benchmarks/workloads (run once)")
    parser.add_argument("--engine-metrics", nargs="*", default=[], help="engines' /metrics URLs (their phases)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="the app's Config fields (e.g. chunks=4 step_tokens=32)")
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    print(asyncio.run(run(args.url, args.app, args.model, args.engine_metrics, settings)))


if __name__ == "__main__":
    main()
