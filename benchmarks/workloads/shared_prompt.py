"""Shared system prompt: M users ask short questions at once under the same long (~900 token) system prompt.

Parrot: the system prompt is constant text and the question a variable, so the gateway fills the
prompt once on the engine and forks it for every user (the calls are independent: no session, each
goes to the API key's default session). Baseline: plain requests; whether the prompt
is recomputed per user depends on the server (run it against one without prefix caching to see
the cost of not sharing).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from benchmarks.workloads.remote import Messages, Remote, fill, sampling
from benchmarks.workloads.result import Result
from benchmarks.workloads.text import questions, system_prompt


@dataclass(frozen=True)
class Config:
    users: int = 8
    system_words: int = 630  # about 900 SmolLM2 tokens
    answer_tokens: int = 16
    seed: int = 0
    ignore_eos: bool = True
    distinct_prompts: bool = False  # baseline only: defeat every prefix cache


def _system_prompts(cfg: Config) -> list[str]:
    system = system_prompt(cfg.seed, cfg.system_words)
    return [f"(desk {i + 1}) {system}" if cfg.distinct_prompts else system for i in range(cfg.users)]


def messages(system: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": "{{question}}"}]


async def run_parrot(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    """Independent calls, nothing for a session to hold: they go to the API key's default session (no
    round trip to open one, as a chatbot serving its users would call)."""
    system, asked = system_prompt(cfg.seed, cfg.system_words), questions(cfg.seed, cfg.users)
    options = sampling(cfg.answer_tokens, cfg.ignore_eos)
    remote = Remote(client, rtt_ms)
    started = time.perf_counter()
    replies = await asyncio.gather(*(
        remote.chat(model, messages(system), options, {"vars": {"question": {"value": q}}, "output": f"answer_{i}"})
        for i, q in enumerate(asked)))
    answers = [reply["choices"][0]["message"]["content"] or "" for reply in replies]
    return Result(time.perf_counter() - started, "\n".join(answers), answers, calls=cfg.users, prompt_tokens=remote.prompt_tokens)


async def run_baseline(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    systems, asked = _system_prompts(cfg), questions(cfg.seed, cfg.users)
    options = sampling(cfg.answer_tokens, cfg.ignore_eos)
    remote = Remote(client, rtt_ms)
    started = time.perf_counter()
    answers = await asyncio.gather(*(
        remote.text(model, fill(messages(system), {"question": q}), options) for system, q in zip(systems, asked)))
    return Result(time.perf_counter() - started, "\n".join(answers), list(answers), calls=cfg.users, prompt_tokens=remote.prompt_tokens)
