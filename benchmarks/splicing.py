"""What healing a fork's seam costs on the engine (engines/builtin/splicing.py) against what it replaces: tokenizing
the whole prompt (the context's text and the fork's) for each fork, and tokenizing the fork's text alone (the old
rule, which changed the prompt at the seam). SmolLM2's tokenizer; the context's text is a shared prefix of the
given sizes, the fork's text a ~100-token question, the prefix's encoding kept warm as the engine keeps it.

    python -m benchmarks.splicing --out docs/benchmarks/splicing_cost
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

from benchmarks.results_file import write_results
from benchmarks.workloads.text import document, system_prompt
from engines.builtin.splicing import TokenSplicer

PREFIX_WORDS = (350, 700, 1400)  # ~500, ~1,000 and ~2,000 SmolLM2 tokens


def per_call_us(work: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        work()
    return (time.perf_counter() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/splicing_cost"))
    args = parser.parse_args(argv)
    from engines.builtin.config import default_model_path
    from engines.builtin.loader import ModelSource, load_tokenizer

    splicer = TokenSplicer(load_tokenizer(ModelSource(default_model_path())))
    fork_text = " " + document(1, 1, 70)[0]
    results = {}
    for words in PREFIX_WORDS:
        prefix = system_prompt(0, words).rstrip()
        splicer.left_tokens(prefix)  # warm, as every fork after a prefix's first finds it
        ways = {"whole prompt tokenized": lambda: splicer.tokens(prefix + fork_text),
                "seam healed": lambda: splicer.splice(prefix, fork_text),
                "fork text alone (old rule)": lambda: splicer.tokens(fork_text)}
        runs: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):  # alternating: each round measures every way
            for way, work in ways.items():
                runs[way].append(per_call_us(work, args.calls))
        medians = {way: statistics.median(times) for way, times in runs.items()}
        tokens = len(splicer.left_tokens(prefix))
        results[str(tokens)] = {"prefix_tokens": tokens, "fork_tokens": len(splicer.tokens(fork_text)),
                                "median_us": medians, "runs_us": runs,
                                "whole/healed": medians["whole prompt tokenized"] / medians["seam healed"]}
        print(f"prefix {tokens} tokens: " + ", ".join(f"{way} {us:,.0f} us" for way, us in medians.items())
              + f"; whole/healed {results[str(tokens)]['whole/healed']:.2f}x")
    path = write_results(args.out.with_suffix(".json"), {"rounds": args.rounds, "calls": args.calls,
                                                         "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
