"""Where a builtin-engine step's time goes: decode at batch 1 and 16, 16 forks of a ~900-token prompt, and a 1,000-token prefill.

    python -m benchmarks.engine_profile [--dtype bfloat16] [--quantization int8 | int4] [--compile] [--steps 32]

Each category is the wall time of the calls that make it up (timed by wrappers this script puts
around the engine's parts, not by a sampling profiler), per step, median over the measured steps:

  linears    every nn.Linear (or quantized / prepacked linear) of the decoder layers
  lm_head    the output head and its norm: the vocabulary-wide linear, or an all-greedy step's screen of it
             (engines/builtin/greedy_head.py)
  attention  KV write + paged attention (kernels/cpu_attention.py via kernels/dispatch.py)
  model rest norms, rope, residual adds, SiLU, embedding: the decoder's time (runner.last_hidden) minus the above
  prepare    the runner's batch metadata (host lists -> tensors), once per step
  sampling   the sampler, the logits' copy to the host included
  engine     schedule + postprocess: the step minus the runner
With --compile (engines/builtin/compiled_model.py) the decoder is timed as a whole ("model rest" is then all of
it) and the head apart, as eager. Then "ops" is the share of the step spent inside aten kernels (torch.profiler's self CPU time over
one profiled step's wall time) and "dispatch" the rest: Python, module calls and op dispatch;
"syncs" counts the step's device->host reads (aten::item / _local_scalar_dense).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import engines.builtin.model as model_module  # noqa: E402
from engines.builtin.config import EngineConfig  # noqa: E402
from engines.builtin.core import EngineCore  # noqa: E402
from engines.builtin.types import SamplingParams  # noqa: E402
from benchmarks.results_file import write_results  # noqa: E402

CATEGORIES = ["linears", "lm_head", "attention", "model rest", "prepare", "sampling", "engine"]


class Clock:
    """Sums wall time per category for the step being measured."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, category: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[category] += time.perf_counter() - start

        return timed


def instrument(engine: EngineCore, clock: Clock) -> None:
    model = engine.runner.model
    if not engine.config.compile:  # a compiled forward runs its graph, not these modules: only its total is timed
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and name.rsplit(".", 1)[-1].endswith("proj"):
                module.forward = clock.wrap("linears", module.forward)
        model_module.paged_attention = clock.wrap("attention", model_module.paged_attention)
    # The head is called after the forward, eager or compiled: its logits, or an all-greedy step's screen.
    model.logits = clock.wrap("lm_head", model.logits)
    if engine.runner.greedy_head is not None:
        engine.runner.greedy_head = clock.wrap("lm_head", engine.runner.greedy_head)
    engine.runner.last_hidden = clock.wrap("model", engine.runner.last_hidden)
    engine.runner.prepare = clock.wrap("prepare", engine.runner.prepare)
    engine.runner.sampler = clock.wrap("sampling", engine.runner.sampler)
    engine.runner.run = clock.wrap("runner", engine.runner.run)


def step_breakdown(clock: Clock, wall: float) -> dict[str, float]:
    t = clock.totals
    out = {name: t[name] for name in ("linears", "lm_head", "attention", "prepare", "sampling")}
    out["model rest"] = t["model"] - t["linears"] - t["attention"]
    out["engine"] = wall - t["runner"]
    out["step"] = wall
    return {k: v * 1e3 for k, v in out.items()}


def op_share(engine: EngineCore) -> tuple[float, int]:
    """(share of one step's wall time inside aten kernels, host reads in it)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    inside = sum(e.self_cpu_time_total for e in events if e.key.startswith(("aten::", "mkldnn::", "quantized::"))) / 1e6
    syncs = sum(e.count for e in events if e.key in ("aten::_local_scalar_dense",))
    return inside / wall, syncs


def measure(engine: EngineCore, clock: Clock, prompts: list[list[int]], max_tokens: int, warmup: int,
            profile_at: int | None) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    done = []
    for prompt in prompts:
        engine._start_generation(params, lambda event, d=done: d.append(event) if event and event.finish_reason else None,
                                 None, prompt, None, None)
    rows, profiled = [], None
    step = 0
    while engine.has_work():
        if step == profile_at:
            profiled = op_share(engine)
        else:
            clock.totals.clear()
            start = time.perf_counter()
            engine.step()
            if step >= warmup:
                rows.append(step_breakdown(clock, time.perf_counter() - start))
        step += 1
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    if profiled:
        medians["ops share"], medians["syncs"] = profiled
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="the compiled forward (EngineConfig.compile)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per workload")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the table")
    args = parser.parse_args()

    engine = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                     num_threads=args.threads, compile=args.compile))
    clock = Clock()
    instrument(engine, clock)
    vocab = engine.tokenizer.vocab_size
    prompt = [(i * 7919) % (vocab - 100) + 50 for i in range(1000)]  # deterministic token soup
    decode_prompts = [prompt[i * 37 : i * 37 + 120] for i in range(16)]
    # engine_throughput's shared workload: 16 questions after one ~900-token system prompt, which the
    # prefix cache holds after a first run (as in the benchmark's repeats); decoded together.
    shared_prompts = [prompt[:900] + prompt[900 + i * 5 : 910 + i * 5] for i in range(16)]
    measure(engine, clock, shared_prompts, 2, warmup=0, profile_at=None)
    rows = {
        "decode b=1": measure(engine, clock, decode_prompts[:1], args.steps + 4, warmup=3, profile_at=3),
        "decode b=16": measure(engine, clock, decode_prompts, args.steps + 4, warmup=3, profile_at=3),
        "shared b=16": measure(engine, clock, shared_prompts, args.steps + 4, warmup=3, profile_at=3),
        # Each repeat is its own sequence (max_tokens 1): the step that prefills 1,000 tokens and samples.
        "prefill 1000": measure_prefill(engine, clock, prompt, repeats=3),
    }
    label = (args.quantization or args.dtype) + (" compiled" if args.compile else "")
    print(f"{label}, torch threads {torch.get_num_threads()}: ms per step (median)")
    header = f"{'workload':14}" + "".join(f"{c:>11}" for c in CATEGORIES) + f"{'step':>9}{'tok/s':>9}{'ops':>7}{'syncs':>7}"
    print(header)
    for name, r in rows.items():
        tokens = 1000 if name.startswith("prefill") else int(name.split("=")[1])
        line = f"{name:14}" + "".join(f"{r.get(c, 0):11.2f}" for c in CATEGORIES)
        line += f"{r['step']:9.2f}{tokens / r['step'] * 1e3:9.1f}"
        line += f"{r.get('ops share', float('nan')):7.2f}{r.get('syncs', 0):7.0f}"
        print(line)
    if args.out:
        write_results(args.out, {"label": label, "threads": torch.get_num_threads(), "rows": rows})


def measure_prefill(engine: EngineCore, clock: Clock, prompt: list[int], repeats: int) -> dict:
    results = []
    for i in range(repeats + 2):  # the first warms up, the last is profiled
        tokens = [prompt[0] + i + 1] + prompt[1:]  # a new first token: no prefix-cache hit
        results.append(measure(engine, clock, [tokens], 1, warmup=0, profile_at=0 if i == repeats + 1 else None))
    timed = results[1:-1]
    return {k: statistics.median(r[k] for r in timed) for k in timed[0]} | results[-1]


if __name__ == "__main__":
    main()
