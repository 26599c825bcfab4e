"""Chain summarization: refine a running summary chunk by chunk; each step consumes the previous output.

Parrot: the whole chain goes in one request, the last step's: each step's summary is bound to the step
before it as an inline call. The server starts step k+1 the moment step k ends (on the engine, from step
k's token ids).
Baseline: one call after another, each summary travelling back to the client and out again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from benchmarks.workloads.remote import Messages, Remote, fill, sampling
from benchmarks.workloads.result import Result
from benchmarks.workloads.text import document

SYSTEM = ("You are a careful analyst. You keep a short running summary of a long report up to date as "
          "new parts arrive. Keep names and numbers exactly as written.")


@dataclass(frozen=True)
class Config:
    chunks: int = 4
    chunk_words: int = 120
    step_tokens: int = 32
    seed: int = 0
    ignore_eos: bool = True


def first_messages() -> Messages:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Summarize this first part of the report in two sentences.\n\n{{chunk}}"}]


def refine_messages() -> Messages:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Next part of the report:\n{{chunk}}\n\nSummary so far:\n{{summary}}\n\n"
                                        "Rewrite the summary so that it also covers the new part."}]


def _step_messages(index: int) -> Messages:
    return first_messages() if index == 0 else refine_messages()


async def run_parrot(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    options = sampling(cfg.step_tokens, cfg.ignore_eos)
    started = time.perf_counter()
    remote = Remote(client, rtt_ms)
    session = remote.default_session()
    # The last step's request carries the chain: its {{summary}} is the step before as an inline call, whose
    # own {{summary}} is the one before it, and so on (one round trip).
    inputs: dict[str, dict] = {"chunk": {"value": chunks[0]}}
    for index, chunk in enumerate(chunks[1:], start=1):
        before = session.inline_call(model, _step_messages(index - 1), inputs, options)
        inputs = {"chunk": {"value": chunk}, "summary": before}
    last = _step_messages(len(chunks) - 1)
    final, inline_ids = await session.ask_inline(model, last, inputs, "final_summary", options)
    seconds = time.perf_counter() - started
    earlier = [inline_ids[".".join(["summary"] * depth)] for depth in range(len(chunks) - 1, 0, -1)]
    steps = [await session.read(var) for var in earlier] + [final]  # ready by now; for checks only
    return Result(seconds, final, steps, calls=len(chunks), prompt_tokens=remote.prompt_tokens)


async def run_baseline(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    options = sampling(cfg.step_tokens, cfg.ignore_eos)
    remote = Remote(client, rtt_ms)
    started = time.perf_counter()
    steps: list[str] = []
    for index, chunk in enumerate(chunks):
        values = {"chunk": chunk} | ({"summary": steps[-1]} if steps else {})
        steps.append(await remote.text(model, fill(_step_messages(index), values), options))
    return Result(time.perf_counter() - started, steps[-1], steps, calls=len(chunks), prompt_tokens=remote.prompt_tokens)
