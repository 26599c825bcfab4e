"""A batch beside live chat on one builtin engine: live latency with and without a batch running, and how much of
the batch's shared system prompt the engine computed.

Starts `parrot serve` (SmolLM2 by default), measures ``--live`` sequential live chat requests alone, then uploads
a batch of ``--lines`` chat lines sharing one long system prompt (3 of them bad), measures the same live requests
while it runs, and waits for the batch's end. Reports live p50/p90 both ways and their ratio (the issue's target:
p90 with a batch <= 1.2x without), the batch's time and counts, and the engine's prompt tokens, computed and
served from its prefix cache during the batch (the shared prompt computed N times: the target is N <= 3).

    python -m benchmarks.batch_live --start
"""

from __future__ import annotations

import argparse
import io
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--engine-args", default="--latency-max-num-seqs 4")
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--live", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/batch_live.json")
    args = parser.parse_args()
    launched = LaunchedGateway(args.model, args.engine_args.split(), Path(args.out).with_suffix(".serve.log"), 600,
                               env={"PARROT_STATE": "memory://"})  # files and batches: this run's only
    try:
        client = openai.OpenAI(base_url=launched.url, api_key="unused", max_retries=0, timeout=300)
        live_latencies(client, args.model, 2, "warm-up")
        alone = live_latencies(client, args.model, args.live, "alone")
        prompt_before, hit_before = engine_tokens(launched.url)
        upload = client.files.create(file=("batch.jsonl", io.BytesIO(batch_lines(args.model, args.lines))),
                                     purpose="batch")
        started = time.perf_counter()
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        time.sleep(1.0)  # the batch under way
        beside = live_latencies(client, args.model, args.live, "beside")
        running_at_end = client.batches.retrieve(batch.id).status == "in_progress"
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            time.sleep(0.5)
        batch_s = time.perf_counter() - started
        prompt_after, hit_after = engine_tokens(launched.url)
    finally:
        launched.close()
    prompt, hit = prompt_after - prompt_before, hit_after - hit_before
    result = {
        "lines": args.lines, "batch_status": batch.status, "batch_seconds": round(batch_s, 2),
        "request_counts": batch.request_counts.model_dump(),
        "batch_still_running_after_live_requests": running_at_end,
        "live_alone_p50_s": round(statistics.median(alone), 4), "live_alone_p90_s": round(percentile(alone, 0.9), 4),
        "live_beside_p50_s": round(statistics.median(beside), 4),
        "live_beside_p90_s": round(percentile(beside, 0.9), 4),
        "live_p90_ratio": round(percentile(beside, 0.9) / percentile(alone, 0.9), 3),
        "engine_prompt_tokens_during_batch": prompt, "engine_prefix_hit_tokens_during_batch": hit,
        "engine_computed_prompt_tokens_during_batch": prompt - hit,
    }
    print(json.dumps(result, indent=2))
    write_results(args.out, result)


if __name__ == "__main__":
    main()
