"""Mixed traffic on one engine: chat users who wait for their answers, and map-reduce jobs in the background.

Chat sessions arrive as a Poisson stream; each has a few turns (user turns and answer lengths drawn from
long-tailed distributions shaped like ShareGPT's, scaled to this CPU), the conversation carried from turn
to turn, with a short think time between turns. Map-reduce jobs arrive at a steady interval. Chat is
always plain chat completions; the two modes differ in how the jobs are sent:

- Parrot: each job through the ``parrot`` extension (workloads/map_reduce.run_parrot): its maps form a
  task group the gateway sends as throughput work, its reduce is latency-critical;
- baseline: each job as plain concurrent requests (map_reduce.run_baseline), which an engine cannot tell
  from the chat users' requests.

A run reports each chat answer's normalized latency (seconds per output token, the paper's Fig. 18
measure) and each job's completion time.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field, replace

import httpx

from benchmarks.workloads import map_reduce
from benchmarks.workloads.remote import Remote, sampling
from benchmarks.workloads.text import document

CHAT_SYSTEM = "You are a friendly assistant. Answer the user's questions clearly."


@dataclass(frozen=True)
class Config:
    duration_s: float = 60.0  # arrivals stop here; the run ends when everything sent has finished
    chat_sessions_per_s: float = 0.25
    max_turns: int = 3
    user_words_median: float = 30.0  # ShareGPT-like long tails, cut to what this CPU serves in a minute
    answer_tokens_median: float = 32.0
    answer_tokens_max: int = 96
    think_s: float = 1.0
    job_interval_s: float = 20.0
    job: map_reduce.Config = map_reduce.Config(chunks=8, chunk_words=100, map_tokens=24, reduce_tokens=32)
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    text: str
    max_tokens: int


@dataclass
class MixedResult:
    chat_normalized_s: list[float] = field(default_factory=list)  # per answer: latency / output tokens
    job_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0.0, sigma)))))


def chat_sessions(cfg: Config, rng: random.Random) -> list[tuple[float, list[Turn]]]:
    """(arrival time, turns) of every chat session, Poisson arrivals over the run."""
    sessions, at = [], rng.expovariate(cfg.chat_sessions_per_s)
    while at < cfg.duration_s:
        turns = []
        for _ in range(rng.randint(1, cfg.max_turns)):
            words = _lognormal(rng, cfg.user_words_median, 0.8, 4, 200)
            text = " ".join(document(rng.randrange(1 << 30), 1, words)[0].split()[:words]) + " What do you make of this?"
            turns.append(Turn(text, _lognormal(rng, cfg.answer_tokens_median, 0.6, 4, cfg.answer_tokens_max)))
        sessions.append((at, turns))
        at += rng.expovariate(cfg.chat_sessions_per_s)
    return sessions


async def _chat(remote: Remote, model: str, turns: list[Turn], think_s: float) -> list[float]:
    messages = [{"role": "system", "content": CHAT_SYSTEM}]
    normalized = []
    for turn in turns:
        messages.append({"role": "user", "content": turn.text})
        started = time.perf_counter()
        answer = await remote.chat(model, messages, sampling(turn.max_tokens, True))
        tokens = max(1, answer["usage"]["completion_tokens"])
        normalized.append((time.perf_counter() - started) / tokens)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
        await asyncio.sleep(think_s)
    return normalized


async def _at(start: float, offset: float, work):
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    return await work


async def run(client: httpx.AsyncClient, model: str, cfg: Config, parrot: bool) -> MixedResult:
    """The traffic of ``cfg`` against ``client``'s server; jobs through the extension when ``parrot``."""
    rng = random.Random(cfg.seed)
    remote = Remote(client)
    job = map_reduce.run_parrot if parrot else map_reduce.run_baseline
    start = time.perf_counter()
    chats = [asyncio.ensure_future(_at(start, at, _chat(remote, model, turns, cfg.think_s)))
             for at, turns in chat_sessions(cfg, rng)]
    job_times = [cfg.job_interval_s * (i + 0.1) for i in range(int(cfg.duration_s // cfg.job_interval_s))]
    jobs = [asyncio.ensure_future(_at(start, at, job(client, model, replace(cfg.job, seed=cfg.seed * 1000 + i))))
            for i, at in enumerate(job_times)]
    result = MixedResult()
    for normalized in await asyncio.gather(*chats):
        result.chat_normalized_s += normalized
    result.job_seconds = [done.seconds for done in await asyncio.gather(*jobs)]
    result.seconds = time.perf_counter() - start
    return result
