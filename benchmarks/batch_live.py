"""A batch beside live chat on one builtin engine: live latency with and without a batch running, and how much of
the batch's shared system prompt the engine computed.

Starts `parrot serve` (SmolLM2 by default). Each of ``--rounds`` rounds measures ``--live`` sequential live chat
requests alone, then uploads a batch of chat lines sharing one long system prompt (3 of them bad) and measures the
same live requests while it runs: the first round's batch has ``--lines`` lines and runs to its end, later
rounds' ``--beside-lines`` and are cancelled once measured. Reports live p50/p90 both ways and their ratio per
round and the median ratio (the issue's target: p90 with a batch <= 1.2x without); for the first batch its time
and counts, the engine's prompt tokens computed during it, and from the lines' usage how many times the shared
prompt was computed (the target: <= 3).

    python -m benchmarks.batch_live --start --lines 1000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import openai

from benchmarks.apps import LaunchedGateway
from benchmarks.mixed_traffic import percentile
from benchmarks.results_file import write_results

SYSTEM = ("You are a careful assistant for a travel agency. Answer every question in one short sentence, name the "
          "country when you name a city, never invent prices, and say so when you do not know. ") * 4


def batch_lines(model: str, count: int) -> bytes:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "max_tokens": 12, "temperature": 0,
                                  "messages": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"Name a city worth visiting, number {i}."}]}})
             for i in range(count - 3)]
    lines[5:5] = ["{not json"]
    lines[50:50] = [json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions", "body": {}})]
    lines[100:100] = [json.dumps({"custom_id": "no-model", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}})]
    return "\n".join(lines).encode() + b"\n"


def live_latencies(client: openai.OpenAI, model: str, count: int, tag: str) -> list[float]:
    seconds = []
    for i in range(count):
        started = time.perf_counter()
        client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": f"Give me one fact about the number {i} ({tag})."}])
        seconds.append(time.perf_counter() - started)
    return seconds


def engine_tokens(url: str) -> tuple[int, int]:
    engines = httpx.get(f"{url}/engines", timeout=10).json()
    return (sum(e["stats"]["prompt_tokens"] for e in engines), sum(e["stats"]["prefix_hit_tokens"] for e in engines))


def shared_prompt_computed(client: openai.OpenAI, batch) -> dict[str, float]:
    """How many times the lines' shared prompt was computed, from the output file's usage: the shared prompt's
    tokens S are the most any line found cached (the longest prefix lines share), and each line computed
    S - its cached tokens of it; their sum over S is the number of whole shared prompts computed."""
    usages = [json.loads(line)["response"]["body"]["usage"]
              for line in client.files.content(batch.output_file_id).text.splitlines() if line.strip()]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages]
    shared = max(cached, default=0)
    computed = sum(max(0, shared - c) for c in cached)
    return {"answered_lines": len(usages), "shared_prompt_tokens": shared,
            "shared_prompt_tokens_computed": computed,
            "shared_prompt_computed_times": round(computed / shared, 2) if shared else float("nan"),
            "lines_computing_over_half_of_it": sum(c < shared / 2 for c in cached),
            "batch_prompt_tokens": sum(u["prompt_tokens"] for u in usages),
            "batch_cached_tokens": sum(cached)}


def run_batch(client: openai.OpenAI, model: str, lines: int):
    upload = client.files.create(file=("batch.jsonl", io.BytesIO(batch_lines(model, lines))), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client: openai.OpenAI, batch):
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        time.sleep(0.5)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--start", action="store_true", help="launch `parrot serve` here (the only way for now)")
    parser.add_argument("--engine-args", default="--latency-max-num-seqs 4")
    parser.add_argument("--lines", type=int, default=200, help="the first round's batch, run to its end")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of live requests alone, then beside a batch")
    parser.add_argument("--beside-lines", type=int, default=200,
                        help="later rounds' batches, cancelled once their live requests are measured")
    parser.add_argument("--live", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/batch_live.json")
    args = parser.parse_args()
    load = {"start": [round(x, 2) for x in os.getloadavg()]}
    launched = LaunchedGateway(args.model, args.engine_args.split(), Path(args.out).with_suffix(".serve.log"), 600,
                               env={"PARROT_STATE": "memory://"})  # files and batches: this run's only
    rounds = []
    try:
        client = openai.OpenAI(base_url=launched.url, api_key="unused", max_retries=0, timeout=300)
        live_latencies(client, args.model, 2, "warm-up")
        for round_ in range(args.rounds):
            alone = live_latencies(client, args.model, args.live, f"alone {round_}")
            prompt_before, hit_before = engine_tokens(launched.url)
            started = time.perf_counter()
            batch = run_batch(client, args.model, args.lines if round_ == 0 else args.beside_lines)
            time.sleep(1.0)  # the batch under way
            beside = live_latencies(client, args.model, args.live, f"beside {round_}")
            running_at_end = client.batches.retrieve(batch.id).status == "in_progress"
            measured = {"alone_p50_s": round(statistics.median(alone), 4),
                        "alone_p90_s": round(percentile(alone, 0.9), 4),
                        "beside_p50_s": round(statistics.median(beside), 4),
                        "beside_p90_s": round(percentile(beside, 0.9), 4),
                        "p90_ratio": round(percentile(beside, 0.9) / percentile(alone, 0.9), 3),
                        "batch_still_running_after_live_requests": running_at_end}
            if round_ == 0:  # the whole batch: its time, counts and how often it computed its shared prompt
                batch = wait_batch(client, batch)
                prompt_after, hit_after = engine_tokens(launched.url)
                measured |= {"lines": args.lines, "batch_status": batch.status,
                             "batch_seconds": round(time.perf_counter() - started, 2),
                             "request_counts": batch.request_counts.model_dump(),
                             "engine_prompt_tokens_during_batch": prompt_after - prompt_before,
                             "engine_computed_prompt_tokens_during_batch":
                                 (prompt_after - prompt_before) - (hit_after - hit_before),
                             **shared_prompt_computed(client, batch)}
            else:
                client.batches.cancel(batch.id)
                wait_batch(client, batch)
            rounds.append(measured)
            print(json.dumps(measured), flush=True)
        load["end"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        launched.close()
    ratios = [r["p90_ratio"] for r in rounds]
    result = {"load_average": load, "rounds": rounds,
              "live_alone_p90_s_median": statistics.median(r["alone_p90_s"] for r in rounds),
              "live_beside_p90_s_median": statistics.median(r["beside_p90_s"] for r in rounds),
              "live_p90_ratio_median": statistics.median(ratios), "target_live_p90_ratio": 1.2,
              "shared_prompt_computed_times": rounds[0].get("shared_prompt_computed_times"),
              "target_shared_prompt_computed_times": 3}
    print(json.dumps(result, indent=2))
    write_results(args.out, {"args": vars(args), **result})


if __name__ == "__main__":
    main()
