"""Map-reduce summarization: summarize each chunk of a document (map), then combine the summaries (reduce).

Parrot: one request, the reduce, whose placeholders are bound to the maps as inline calls: the whole
graph in one round trip, the reduce answering with the final summary. Baseline (a LangChain-style client):
maps concurrently (an async client, or LCEL's ``batch``), then the reduce, every value passing
through the client; with ``sequential`` the maps go one after another, as LangChain's classic
synchronous ``MapReduceDocumentsChain`` runs them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from benchmarks.workloads.remote import Messages, Remote, fill, sampling
from benchmarks.workloads.result import Result
from benchmarks.workloads.text import document

# Constant text before the chunk: on a builtin engine it is filled once and forked by every map.
SYSTEM = ("You are a careful analyst. You write short, factual summaries of reports. Keep names, "
          "numbers and dates exactly as written, and never add facts that are not in the text.")


@dataclass(frozen=True)
class Config:
    chunks: int = 15  # the seed paper's map-reduce setting
    chunk_words: int = 150
    map_tokens: int = 32
    reduce_tokens: int = 48
    seed: int = 0
    ignore_eos: bool = True
    sequential: bool = False  # baseline only: one map at a time
    service_tier: str | None = None  # OpenAI's, on every call ("flex": a background job, throughput work)


def map_messages() -> Messages:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Summarize this part of a report in two sentences.\n\n{{chunk}}"}]


def reduce_messages(chunks: int) -> Messages:
    summaries = "\n".join(f"- {{{{summary_{i}}}}}" for i in range(chunks))
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Combine these partial summaries into one short summary of the whole "
                                        f"report.\n\n{summaries}"}]


def _options(cfg: Config, max_tokens: int) -> dict:
    tier = {"service_tier": cfg.service_tier} if cfg.service_tier else {}
    return sampling(max_tokens, cfg.ignore_eos) | tier


async def run_parrot(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    started = time.perf_counter()
    remote = Remote(client, rtt_ms)
    session = remote.default_session()
    maps = {f"summary_{i}": session.inline_call(model, map_messages(), {"chunk": {"value": chunk}},
                                                _options(cfg, cfg.map_tokens))
            for i, chunk in enumerate(chunks)}
    final, summary_ids = await session.ask_inline(model, reduce_messages(len(chunks)), maps, "final_summary",
                                                  _options(cfg, cfg.reduce_tokens))
    seconds = time.perf_counter() - started
    summaries = [await session.read(summary_ids[f"summary_{i}"]) for i in range(len(chunks))]  # for checks only
    return Result(seconds, final, summaries, calls=len(chunks) + 1, prompt_tokens=remote.prompt_tokens)


async def run_baseline(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    remote = Remote(client, rtt_ms)
    started = time.perf_counter()
    maps = [remote.text(model, fill(map_messages(), {"chunk": chunk}), _options(cfg, cfg.map_tokens))
            for chunk in chunks]
    summaries = [await one for one in maps] if cfg.sequential else await asyncio.gather(*maps)
    values = {f"summary_{i}": summary for i, summary in enumerate(summaries)}
    final = await remote.text(model, fill(reduce_messages(len(chunks)), values), _options(cfg, cfg.reduce_tokens))
    return Result(time.perf_counter() - started, final, list(summaries), calls=len(chunks) + 1, prompt_tokens=remote.prompt_tokens)
