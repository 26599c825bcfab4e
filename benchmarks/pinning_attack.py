"""Another key's chat latency while one key pins the KV cache with calls that can never run (#57 item 2).

It launches `parrot serve` (gateway + builtin SmolLM2 engine) with two client keys. The victim key's chat
(a ~``--victim-tokens`` prompt, ``--max-tokens`` generated, a fresh prompt each time so that no prefix
cache helps) is timed with the engine idle, then right after the attacker key queued ``--calls`` calls
(``wait: false``), each with a system prompt of its own of ~``--attack-tokens`` tokens and ``{{m}}`` bound
to a variable nobody ever produces: the gateway fills and pins a context for each ahead of its input.
Reported: each latency, the ratio under attack / idle (target: at most 1.5), the engine's fewest free KV
blocks seen, and how many attack calls the gateway accepted.

``--source DIR`` runs `parrot serve` from another checkout (e.g. ``git archive`` of an earlier commit), so
that before and after are measured by the same script.

    python -m benchmarks.pinning_attack
    python -m benchmarks.pinning_attack --source /tmp/base --out /tmp/pinning_before.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.apps import LaunchedGateway

ATTACKER, VICTIM = "sk-attacker", "sk-victim"
WORDS = ("the river museum quiet garden winter market letter window morning station harbor mountain "
         "teacher kitchen bridge forest library village island painter engine summer orchard candle "
         "valley meadow tower lantern shadow violin pocket signal marble thunder copper ribbon").split()


def text_of(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of plain words (SmolLM2's tokenizer: one each, with its space)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class KvWatch:
    """Samples the engine's free KV blocks (as the gateway lists them) until stopped; keeps the fewest."""

    def __init__(self, root: str):
        self.root, self.fewest, self.total = root, None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(0.5):
                try:
                    stats = client.get(f"{self.root}/v1/engines", headers=auth(VICTIM)).json()[0]["stats"]
                except (httpx.HTTPError, ValueError, IndexError, KeyError):
                    continue
                self.total = stats["blocks_total"]
                self.fewest = stats["blocks_free"] if self.fewest is None else min(self.fewest, stats["blocks_free"])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def victim_chat(client: httpx.Client, root: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Run {seed}. " + text_of(args.victim_tokens, seed)}]}
    start = time.perf_counter()
    response = client.post(f"{root}/v1/chat/completions", json=body, headers=auth(VICTIM))
    seconds = time.perf_counter() - start
    if response.status_code != 200:  # a failure is a result too (before #57: a 504 after request_timeout_s)
        print(f"victim chat {seed}: {response.status_code} after {seconds:.1f}s: {response.text[:200]}", flush=True)
        return {"seconds": round(seconds, 3), "status": response.status_code, "error": response.text[:300]}
    print(f"victim chat {seed}: {seconds:.2f}s", flush=True)
    return {"seconds": round(seconds, 3), "status": 200, "prompt_tokens": response.json()["usage"]["prompt_tokens"]}


def attack(client: httpx.Client, root: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The probe's attack: one variable nobody produces, then ``--calls`` calls on it, each with its own
    long system prompt. Returns how many were accepted, and the session to delete."""
    session = client.post(f"{root}/v1/sessions", headers=auth(ATTACKER)).json()["id"]
    never = client.post(f"{root}/v1/vars", json={"session_id": session, "name": "m"}, headers=auth(ATTACKER)).json()["id"]
    statuses: dict[str, int] = {}
    for i in range(args.calls):
        body = {"model": model, "max_tokens": 16, "messages": [
            {"role": "system", "content": f"Agent {i}. " + text_of(args.attack_tokens, 1000 + i)},
            {"role": "user", "content": "{{m}}"}],
            "parrot": {"session_id": session, "wait": False, "vars": {"m": {"id": never}}}}
        status = client.post(f"{root}/v1/chat/completions", json=body, headers=auth(ATTACKER)).status_code
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"session": session, "statuses": statuses}


def run(args: argparse.Namespace) -> dict[str, Any]:
    log = Path(args.out).with_suffix(".serve.log")
    env = {"PARROT_API_KEYS": f"{ATTACKER},{VICTIM}"}
    if args.source:  # its code, not this checkout's, whatever PYTHONPATH this script runs with
        env["PYTHONPATH"] = str(Path(args.source).resolve())
    gateway = LaunchedGateway(args.model, args.engine_args.split(), log, args.start_timeout, env=env, cwd=args.source,
                              api_key=VICTIM)
    root = gateway.url.removesuffix("/v1")
    try:
        with httpx.Client(timeout=args.request_timeout) as client:
            victim_chat(client, root, args.model, argparse.Namespace(**{**vars(args), "victim_tokens": 16}), 0)  # warm-up
            idle = [victim_chat(client, root, args.model, args, seed) for seed in range(1, 1 + args.rounds)]
            watch = KvWatch(root)
            attacked = attack(client, root, args.model, args)
            under = [victim_chat(client, root, args.model, args, seed) for seed in range(101, 101 + args.rounds)]
            watch.stop()
            client.delete(f"{root}/v1/sessions/{attacked['session']}", headers=auth(ATTACKER))
    finally:
        gateway.close()
    idle_s = statistics.median(r["seconds"] for r in idle)
    under_s = statistics.median(r["seconds"] for r in under)
    return {"source": args.source or ".", "commit": _commit(args.source), "host": _host(), "args": {
                k: v for k, v in vars(args).items() if k not in ("out",)},
            "idle": idle, "under_attack": under, "idle_median_s": idle_s, "under_attack_median_s": under_s,
            "ratio": round(under_s / idle_s, 3), "attack_statuses": attacked["statuses"],
            "blocks_total": watch.total, "fewest_blocks_free": watch.fewest}


def _commit(source: str | None) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # a git archive: the caller names it


def _host() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
        cpus = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("CPU(s)")), "")
        return f"{model}, {cpus} CPUs"
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--engine-args", default="", help="flags for `parrot engine`, e.g. '--num-blocks 728'")
    parser.add_argument("--source", default=None, help="the checkout `parrot serve` runs from (default: this one)")
    parser.add_argument("--calls", type=int, default=45)
    parser.add_argument("--attack-tokens", type=int, default=1400)
    parser.add_argument("--victim-tokens", type=int, default=2500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="victim chats idle and under attack (median)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--out", default="docs/benchmarks/pinning_attack.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"victim chat: idle {result['idle_median_s']:.2f}s, under attack {result['under_attack_median_s']:.2f}s "
          f"({result['ratio']:.2f}x); attack calls {result['attack_statuses']}; fewest free KV blocks "
          f"{result['fewest_blocks_free']} of {result['blocks_total']}")


if __name__ == "__main__":
    main()
