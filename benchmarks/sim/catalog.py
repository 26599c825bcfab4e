"""The benchmark apps as graphs (app.App), from the workloads' own messages and text, one per seed (each seed its
own document, as each benchmark run has): chain summarization, map-reduce, the multi-agent exchange, users on a
shared system prompt, and a chat session (the mixed workload's users)."""

from __future__ import annotations

import random

from benchmarks.sim.app import App, Call, rendered
from benchmarks.workloads import chain, map_reduce, mixed, multi_agent, shared_prompt
from benchmarks.workloads.text import document, questions, system_prompt


def chain_app(cfg: chain.Config) -> App:
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    calls = [Call("step0", rendered(chain.first_messages(), {"chunk": chunks[0]}, {}), cfg.step_tokens)]
    for k in range(1, cfg.chunks):
        pieces = rendered(chain.refine_messages(), {"chunk": chunks[k]}, {"summary": f"step{k - 1}"})
        calls.append(Call(f"step{k}", pieces, cfg.step_tokens))
    return App("chain", tuple(calls), calls[-1].name)


def map_reduce_app(cfg: map_reduce.Config) -> App:
    chunks = document(cfg.seed, cfg.chunks, cfg.chunk_words)
    group = f"maps{cfg.seed}"
    maps = [Call(f"map{i}", rendered(map_reduce.map_messages(), {"chunk": chunk}, {}), cfg.map_tokens,
                 latency=False, group=group) for i, chunk in enumerate(chunks)]
    inputs = {f"summary_{i}": f"map{i}" for i in range(cfg.chunks)}
    reduce = Call("reduce", rendered(map_reduce.reduce_messages(cfg.chunks), {}, inputs), cfg.reduce_tokens)
    return App("map_reduce", (*maps, reduce), "reduce")


def multi_agent_app(cfg: multi_agent.Config) -> App:
    plan = Call("plan", rendered(multi_agent.architect_messages(), {"task": multi_agent._task(cfg)}, {}),
                cfg.plan_tokens)
    coders = [Call(f"code{i}", rendered(multi_agent.coder_messages(), {"component": str(i + 1)}, {"plan": "plan"}),
                   cfg.code_tokens) for i in range(cfg.coders)]
    review = Call("review", rendered(multi_agent.reviewer_messages(cfg.coders), {},
                                     {f"code_{i}": f"code{i}" for i in range(cfg.coders)}), cfg.review_tokens)
    # run_parrot makes the output variables first (one round trip), then submits the graph
    return App("multi_agent", (plan, *coders, review), "review", setup_round_trips=1)


def shared_prompt_app(cfg: shared_prompt.Config) -> App:
    system = system_prompt(cfg.seed, cfg.system_words)
    calls = tuple(Call(f"user{i}", rendered(shared_prompt.messages(system), {"question": q}, {}), cfg.answer_tokens)
                  for i, q in enumerate(questions(cfg.seed, cfg.users)))
    return App("shared_prompt", calls, calls[-1].name)


def chat_app(seed: int, cfg: mixed.Config = mixed.Config()) -> App:
    """One of the mixed workload's chat sessions: each turn's prompt is the conversation so far (its earlier
    answers included, which the engine's prefix cache may still hold), a think time between turns."""
    _, turns = mixed.chat_sessions(mixed.Config(duration_s=1.0, chat_sessions_per_s=100.0, seed=seed),
                                   random.Random(seed))[0]
    messages = [{"role": "system", "content": mixed.CHAT_SYSTEM}]
    calls, values, inputs = [], {}, {}
    for k, turn in enumerate(turns):
        values[f"user{k}"] = turn.text
        messages.append({"role": "user", "content": f"{{{{user{k}}}}}"})
        calls.append(Call(f"turn{k}", rendered(messages, values, dict(inputs)), turn.max_tokens))
        inputs[f"answer{k}"] = f"turn{k}"
        messages.append({"role": "assistant", "content": f"{{{{answer{k}}}}}"})
    return App("chat", tuple(calls), calls[-1].name, think_s=cfg.think_s, plain=True)


BUILDERS = {"chain": lambda seed, **kw: chain_app(chain.Config(seed=seed, **kw)),
            "map_reduce": lambda seed, **kw: map_reduce_app(map_reduce.Config(seed=seed, **kw)),
            "multi_agent": lambda seed, **kw: multi_agent_app(multi_agent.Config(seed=seed, **kw)),
            "shared_prompt": lambda seed, **kw: shared_prompt_app(shared_prompt.Config(seed=seed, **kw))}
