"""What a dependent call costs on Parrot's DAG path, beyond the engine's own work.

A chain of ``--calls`` dependent calls (``--max-tokens`` each, short chunks, no simulated RTT) runs two ways
against one `parrot serve` (the builtin engine), alternating which goes first, ``--repeats`` times:

- ``parrot``: the whole chain submitted at once through the `parrot` extension; each call names the
  previous call's output variable, the gateway runs it when that variable is produced; the client reads
  the last variable;
- ``sequential``: the same calls made one after another by a client, each output travelling back and
  out again (plain chat completions through the same gateway and engine).

Both compute the same tokens (greedy, fixed output length). The difference per call is what the DAG path
adds (or saves) per dependent call: producer done -> output known -> consumer's prompt formed and placed
-> consumer scheduled on the engine; negative means it beats a client that makes the calls itself.

    python -m benchmarks.chain_overhead --start            # launch `parrot serve` (SmolLM2) here
    python -m benchmarks.chain_overhead --url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import httpx

from benchmarks.apps import Mode, served, warm_up
from benchmarks.results_file import TRACKED, write_results, save_figure
from benchmarks.workloads import chain

RUNS = {"parrot": chain.run_parrot, "sequential": chain.run_baseline}


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {mode: [] for mode in RUNS}
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout) as client:
        await warm_up(client, Mode("parrot", args.url, args.model))
        for repeat in range(args.repeats + 1):  # the first round warms both paths and is not counted
            order = list(RUNS) if repeat % 2 == 0 else list(RUNS)[::-1]
            for mode in order:
                # A document of its own for every run: a run on the text the other mode just ran would find
                # its prompts in the engine's prefix cache, which favoured whichever ran second by ~100 ms a
                # call (when only plain requests looked it up; a fork's own tokens do too now).
                seed = args.seed + repeat * len(RUNS) + list(RUNS).index(mode)
                config = chain.Config(chunks=args.calls, chunk_words=args.chunk_words, step_tokens=args.max_tokens,
                                      seed=seed)
                result = await RUNS[mode](client, args.model, config, 0.0)
                if repeat:
                    seconds[mode].append(result.seconds)
                print(f"  {mode:<11} repeat {repeat}: {result.seconds * 1e3:8.1f} ms "
                      f"({result.calls} calls){'' if repeat else '  (warm-up)'}", flush=True)
    return seconds


def summarize(seconds: dict[str, list[float]], calls: int) -> dict[str, float]:
    parrot, sequential = (statistics.median(seconds[mode]) for mode in RUNS)
    return {"parrot_ms": parrot * 1e3, "sequential_ms": sequential * 1e3,
            "parrot_per_call_ms": parrot * 1e3 / calls, "sequential_per_call_ms": sequential * 1e3 / calls,
            "dag_minus_sequential_per_call_ms": (parrot - sequential) * 1e3 / calls,
            "sequential_over_parrot": sequential / parrot}


def plot(seconds: dict[str, list[float]], summary: dict[str, float], calls: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 4))
    medians = [summary["parrot_per_call_ms"], summary["sequential_per_call_ms"]]
    axes.bar(list(RUNS), medians, color=["tab:green", "tab:grey"])
    for mode, values in seconds.items():
        axes.scatter([mode] * len(values), [v * 1e3 / calls for v in values], color="black", s=10, zorder=3)
    axes.set_ylabel("ms per dependent call (median)")
    axes.set_title(f"{title}\nsequential / parrot: {summary['sequential_over_parrot']:.2f}x", fontsize=9)
    save_figure(figure, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--start", action="store_true", help="launch `parrot serve` here (and stop it at the end)")
    parser.add_argument("--engine-args", default="", help="with --start: flags for the launched engine")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--chunk-words", type=int, default=12, help="each call's own new text")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=str(TRACKED / "chain_overhead.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    with served(args, out) as args.url:
        seconds = asyncio.run(measure(args))
    summary = summarize(seconds, args.calls)
    print(f"\n{args.calls} dependent calls of {args.max_tokens} tokens, median of {args.repeats}:")
    print(f"  parrot (DAG)  {summary['parrot_ms']:8.1f} ms  {summary['parrot_per_call_ms']:6.1f} ms/call")
    print(f"  sequential    {summary['sequential_ms']:8.1f} ms  {summary['sequential_per_call_ms']:6.1f} ms/call")
    print(f"  DAG path minus sequential client: {summary['dag_minus_sequential_per_call_ms']:+.1f} ms per call; "
          f"sequential / parrot {summary['sequential_over_parrot']:.2f}x")
    write_results(out, {"args": vars(args), "seconds": seconds, "summary": summary})
    plot(seconds, summary, args.calls, out.with_suffix(".png"), f"{args.model}, chain of {args.calls} x {args.max_tokens} tokens")
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
