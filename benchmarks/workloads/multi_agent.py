"""Multi-agent fan-out/fan-in: an architect plans, N coders each implement one component of the plan,
a reviewer reads every implementation.

Parrot: the plan's and the coders' output variables are made first (one round trip), then architect,
coders (consuming the plan by id) and reviewer (consuming every coder's output) are sent together, the
reviewer answering with the review. Baseline: architect, then the coders
concurrently (or one after another with ``sequential``, as a synchronous LangChain chain runs them),
then the reviewer, each value passing through the client.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from benchmarks.workloads.remote import Messages, Remote, fill, sampling
from benchmarks.workloads.result import Result

TASK = "a command-line tool that keeps a to-do list in a local file, with add, list, done and undo commands"
ARCHITECT = ("You are the software architect of a small team. You split a task into components and write "
             "a short, concrete plan that names the files, functions and data each component needs.")
CODER = ("You are a senior Python developer in a small team. You implement exactly the component you are "
         "given, following the architect's plan, and answer with code only.")
REVIEWER = ("You are a strict code reviewer. You read the team's implementations and list the most "
            "important bugs and mismatches between components.")


@dataclass(frozen=True)
class Config:
    coders: int = 4
    plan_tokens: int = 48
    code_tokens: int = 32
    review_tokens: int = 32
    seed: int = 0
    ignore_eos: bool = True
    sequential: bool = False  # baseline only: one coder at a time


def architect_messages() -> Messages:
    return [{"role": "system", "content": ARCHITECT},
            {"role": "user", "content": "Plan this task: {{task}}"}]


def coder_messages() -> Messages:
    return [{"role": "system", "content": CODER},
            {"role": "user", "content": "Implement component {{component}} of this plan.\n\nPlan:\n{{plan}}"}]


def reviewer_messages(coders: int) -> Messages:
    code = "\n\n".join(f"Component {i + 1}:\n{{{{code_{i}}}}}" for i in range(coders))
    return [{"role": "system", "content": REVIEWER},
            {"role": "user", "content": f"Review these implementations.\n\n{code}"}]


def _task(cfg: Config) -> str:
    return f"{TASK} (project {cfg.seed})"  # the seed keeps runs from reusing each other's cached blocks


async def run_parrot(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    started = time.perf_counter()
    remote = Remote(client, rtt_ms)
    session = remote.default_session()
    plan_id, *code_ids = await session.new_variables(["plan", *(f"code_{i}" for i in range(cfg.coders))])
    plan = session.submit(model, architect_messages(), {"task": {"value": _task(cfg)}}, {"id": plan_id},
                          sampling(cfg.plan_tokens, cfg.ignore_eos))
    coders = [session.submit(model, coder_messages(), {"component": {"value": str(i + 1)}, "plan": {"id": plan_id}},
                             {"id": code_id}, sampling(cfg.code_tokens, cfg.ignore_eos))
              for i, code_id in enumerate(code_ids)]
    review = session.ask(model, reviewer_messages(cfg.coders), {f"code_{i}": {"id": var} for i, var in enumerate(code_ids)},
                         "review", sampling(cfg.review_tokens, cfg.ignore_eos))
    answer = (await asyncio.gather(plan, *coders, review))[-1]
    seconds = time.perf_counter() - started
    parts = [await session.read(var) for var in (plan_id, *code_ids)]  # ready by now; for checks only
    return Result(seconds, answer, parts, calls=cfg.coders + 2, prompt_tokens=remote.prompt_tokens)


async def run_baseline(client: httpx.AsyncClient, model: str, cfg: Config, rtt_ms: float = 0.0) -> Result:
    remote = Remote(client, rtt_ms)
    started = time.perf_counter()
    plan = await remote.text(model, fill(architect_messages(), {"task": _task(cfg)}),
                             sampling(cfg.plan_tokens, cfg.ignore_eos))
    coders = [remote.text(model, fill(coder_messages(), {"component": str(i + 1), "plan": plan}),
                          sampling(cfg.code_tokens, cfg.ignore_eos))
              for i in range(cfg.coders)]
    codes = [await coder for coder in coders] if cfg.sequential else await asyncio.gather(*coders)
    review = await remote.text(model, fill(reviewer_messages(cfg.coders), {f"code_{i}": c for i, c in enumerate(codes)}),
                               sampling(cfg.review_tokens, cfg.ignore_eos))
    return Result(time.perf_counter() - started, review, [plan, *codes], calls=cfg.coders + 2, prompt_tokens=remote.prompt_tokens)
