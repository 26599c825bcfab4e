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
from benchmarks.results_file import save_figure, write_results

SYSTEM = ("You are a careful assistant for a travel agency. Answer every question in one short sentence, name the "
          "country when you name a city, never invent prices, and say so when you do not know. ") * 4


def batch_lines(model: str, count: int, max_tokens: int) -> bytes:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
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


def run_batch(client: openai.OpenAI, model: str, lines: int, max_tokens: int):
    upload = client.files.create(file=("batch.jsonl", io.BytesIO(batch_lines(model, lines, max_tokens))),
                                 purpose="batch")
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
    parser.add_argument("--config", default="", help="more of the gateway's config file (TOML), e.g. '[files]\\n"
                                                     "batch_live_quiet_s = 0'")
    parser.add_argument("--lines", type=int, default=200, help="the first round's batch, run to its end")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of live requests alone, then beside a batch")
    parser.add_argument("--beside-lines", type=int, default=200,
                        help="later rounds' batches, cancelled once their live requests are measured")
    parser.add_argument("--line-max-tokens", type=int, default=12, help="each batch line's max_tokens")
    parser.add_argument("--live", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/batch_live.json")
    args = parser.parse_args()
    load = {"start": [round(x, 2) for x in os.getloadavg()]}
    launched = LaunchedGateway(args.model, args.engine_args.split(), Path(args.out).with_suffix(".serve.log"), 600,
                               env={"PARROT_STATE": "memory://"},  # files and batches: this run's only
                               config=args.config.replace("\\n", "\n"))
    rounds = []
    try:
        client = openai.OpenAI(base_url=launched.url, api_key="unused", max_retries=0, timeout=300)
        live_latencies(client, args.model, 2, "warm-up")
        for round_ in range(args.rounds):
            alone = live_latencies(client, args.model, args.live, f"alone {round_}")
            prompt_before, hit_before = engine_tokens(launched.url)
            started = time.perf_counter()
            lines = args.lines if round_ == 0 else args.beside_lines
            batch = run_batch(client, args.model, lines, args.line_max_tokens)
            time.sleep(1.0)  # the batch under way
            beside = live_latencies(client, args.model, args.live, f"beside {round_}")
            running_at_end = client.batches.retrieve(batch.id).status == "in_progress"
            measured = {"alone_p50_s": round(statistics.median(alone), 4),
                        "alone_p90_s": round(percentile(alone, 0.9), 4),
                        "beside_p50_s": round(statistics.median(beside), 4),
                        "beside_p90_s": round(percentile(beside, 0.9), 4),
                        "p90_ratio": round(percentile(beside, 0.9) / percentile(alone, 0.9), 3),
                        "batch_still_running_after_live_requests": running_at_end,
                        "load_average": [round(x, 2) for x in os.getloadavg()]}
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
    plot(result, Path(args.out).with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Each round's live p90 alone and beside a batch, the ratio over each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = result["rounds"]
    figure, axes = plt.subplots(figsize=(7, 4))
    width = 0.38
    for offset, (key, label) in enumerate((("alone_p90_s", "live alone"), ("beside_p90_s", "live beside a batch"))):
        axes.bar([i + (offset - 0.5) * width for i in range(len(rounds))], [r[key] for r in rounds], width,
                 label=label)
    for i, measured in enumerate(rounds):
        axes.annotate(f"{measured['p90_ratio']:.2f}x", (i, max(measured["alone_p90_s"], measured["beside_p90_s"])),
                      textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    axes.set_xticks(range(len(rounds)), [f"round {i + 1}" for i in range(len(rounds))])
    axes.set_ylabel("live chat p90 latency, s")
    axes.set_title(f"live p90 beside a batch: median {result['live_p90_ratio_median']:.2f}x (target <= 1.2x); "
                   f"shared prompt computed {result['shared_prompt_computed_times']}x (target <= 3)", fontsize=8)
    axes.margins(y=0.15)
    axes.legend(fontsize=8, loc="lower right")
    save_figure(figure, path)


if __name__ == "__main__":
    main()
