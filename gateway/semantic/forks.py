"""A step forked from its shared prefix on an engine with contexts (engines/seam ``ContextEngine``).

The engine splits the rendered prompt where its first variable starts (it owns the tokenizer's rules); the
constant text before it is the shared prefix, pinned once per engine (prefix.py) and forked by every request
that starts with it. The global scheduler places every fork: by its prefix (held exactly where it is
pinned), its call's criteria and task group. A call still waiting for its inputs is warmed: its prompt split
and its prefix filled while its producers run, so only the fork is left on the critical path; the prefix is
held for the call until it ends, so no other prefix evicts it meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, NamedTuple

from engines.seam import ContextEngine, EngineError, ForkPart, Generation, GenerationChunk, PromptSplit
from engines.seam.connect import has_capability
from gateway.prompt_prefix import chain, tokens_in
from gateway.registry import EngineRecord
from gateway.scheduler import Placement, Work
from gateway.semantic.call_spec import Step
from gateway.semantic.gateway_port import GatewayPort
from gateway.semantic.graph import Call, CallTimings, Session, Variable, new_id
from gateway.semantic.handoff import PendingOutput, announced_inputs, fork_parts
from gateway.semantic.prefix import PrefixCache, PrefixEntry
from gateway.semantic.streaming import TextSink
from wire.sampling import sampling_of
from wire.vllm import VLLM_EXTRAS

_PLAIN_ONLY = ("tools", "response_format", "logprobs", "top_logprobs", "echo", "suffix", "best_of", *VLLM_EXTRAS)


class Plan(NamedTuple):
    """Where a forkable request runs: the engine, and its prompt split at the shared prefix."""

    record: EngineRecord
    split: PromptSplit

    @property
    def engine(self) -> ContextEngine:
        return self.record.engine  # type: ignore[return-value]  (chosen among ContextEngines)


class Handoff(NamedTuple):
    """A call sent ahead of its inputs: where (the engine generating them), and its fork text as parts."""

    plan: Plan
    parts: list[ForkPart]
    pending: list[PendingOutput]


class Forks:
    def __init__(self, gateway: GatewayPort, prefixes: PrefixCache, min_prefix_chars: int):
        self.gateway = gateway
        self.prefixes = prefixes
        self.min_prefix_chars = min_prefix_chars

    @staticmethod
    def forkable(step: Step) -> bool:
        body = step.body
        if (body.get("n") or 1) != 1 or any(body.get(k) for k in _PLAIN_ONLY):
            return False
        if step.route == "completions":
            return isinstance(body.get("prompt"), str)
        return not any(_has_media(message) for message in body["messages"])  # the engine refuses it plainly

    def engines(self, model: str) -> list[EngineRecord]:
        """The healthy engines of ``model`` that hold contexts."""
        return [r for r in self.gateway.engines_for(model) if has_capability(r.engine, ContextEngine)]

    async def split(self, step: Step, records: list[EngineRecord]) -> PromptSplit | None:
        """The prompt split at its shared prefix; None when that prefix is too short to be worth pinning."""
        split = await records[0].engine.split_prompt(step.route, step.body)  # type: ignore[attr-defined]
        return split if len(split.prefix) >= self.min_prefix_chars else None

    def place(self, model: str, split: PromptSplit, rest: str, records: list[EngineRecord],
              placement: Placement) -> Plan:
        """The engine the global scheduler picks for a fork of ``split``'s prefix (known exactly where pinned)."""
        prefix = split.prefix.encode()
        held_by = frozenset(r.id for r in records if self.prefixes.holds(r.id, split.prefix))
        work = Work(chain(model, prefix), tokens_in(len(prefix) + len(rest.encode())),
                    placement._replace(held_by=held_by), prefix_tokens=tokens_in(len(prefix)))
        record = self.gateway.place(work, records)
        assert record is not None  # records is never empty here
        return Plan(record, split)

    async def warm(self, step: Step, call: Call) -> None:
        """Before a call's inputs are ready: split its prompt and fill its constant prefix on the engine
        that will run it, so that when they are ready only the fork is left; the prefix is held there until
        the call ends. Errors are left for the run itself to meet and report."""
        records = self.engines(step.body["model"])
        if not records or not self.forkable(step):
            return
        session = call.session
        try:
            split = await self.split(step, records)
            if split is None:
                return
            plan = self.place(step.body["model"], split, "", records, call.placement(step.body))
            key = self.prefixes.key(plan.record.id, split.prefix)
            if not session.holdings.pin(key, tokens_in(len(split.prefix.encode()))):
                return  # its key holds its quota of prefixes ahead already: filled when the call runs
            _until_done(lambda: session.holdings.unpin(key))
            entry, _ = await self._acquire(plan, session)
            _until_done(lambda: self.prefixes.release_soon(entry))
            await plan.engine.fill(text=plan.split.prefix, context_id=entry.context_id, if_absent=True)
            call.timings.warmed = time.time()
        except EngineError:
            pass

    async def plan_ahead(self, step: Step, call: Call, input_timeout_s: float) -> Handoff | None:
        """How ``call`` can run before its inputs' text is known: on the one engine generating the inputs
        that are not ready, which puts their text in as they are produced (handoff.py). None when
        it cannot (an input failed, or is pending on no engine or on several, or the request does not
        fork): the call then waits for its inputs' values and runs as usual."""
        if not self.forkable(step):
            return None
        known = await announced_inputs(call.inputs, input_timeout_s)
        if known is None:
            return None
        model = step.body["model"]
        pending = {name: value for name, value in known.items() if isinstance(value, PendingOutput)}
        records = [r for r in self.engines(model) if {p.engine_id for p in pending.values()} == {r.id}]
        split = await self.split(step, records) if records else None
        if split is None:
            return None
        values = {name: value for name, value in known.items() if isinstance(value, str)}
        plan = self.place(model, split, split.rest_with(values), records, call.placement(step.body))
        return Handoff(plan, fork_parts(split, values, pending), list(pending.values()))

    async def _acquire(self, plan: Plan, session: Session) -> tuple[PrefixEntry, bool]:
        entry, hit = await self.prefixes.acquire(plan.record.id, plan.engine, plan.split.prefix,
                                                 None if session.default else session.id)
        if not session.default:
            session.prefix_keys.add(entry.key)
        return entry, hit

    async def generate(self, plan: Plan, rest: str | list[ForkPart], body: dict[str, Any], hints: dict[str, Any],
                       session: Session, sink: TextSink | None, output: Variable, *, generating: bool,
                       timings: CallTimings | None = None) -> Generation:
        """The fork's generation. ``output``: the variable it produces, published under its output id while
        it is generated (``generating``: at once; else once the call's inputs are bound). ``timings``: the
        call's, told when its first token came (when it streams)."""
        record = plan.record
        entry, hit = await self._acquire(plan, session)
        record.in_flight += 1
        sampling = sampling_of(body) | hints
        record.requests.add()
        pending = PendingOutput(record.id, new_id("out"))
        output.publish(pending, generating=generating)
        try:
            if sink is None:
                generation = await plan.engine.generate_in_context(entry.context_id, sampling, fork_with=rest,
                                                                   context_text=plan.split.prefix,
                                                                   output_id=pending.output_id)
            else:
                sink.engine_id = record.id
                generation = await _gathered(plan.engine.stream_in_context(
                    entry.context_id, sampling, fork_with=rest, context_text=plan.split.prefix,
                    output_id=pending.output_id), sink, timings)
        except BaseException:
            output.withdraw()
            raise
        finally:
            record.in_flight -= 1
            await self.prefixes.release(entry)
        output.settle(pending)
        self.gateway.outcomes.forked(body["model"], record.engine.name)
        if hit:
            self.prefixes.hit_tokens += generation.context_tokens
        return generation


def _has_media(message: dict[str, Any]) -> bool:
    """Whether a message has parts other than text (rendering for a fork would drop them unseen)."""
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") != "text" for part in content)


def _until_done(release: Callable[[], None]) -> None:
    """Holds what a waiting call reserved (the prefix it will fork, its key's pin of it) until that call
    ends (it runs, fails or is cancelled), so that the engine keeps the prefix ahead of prefixes nobody
    is waiting for (DAG-aware retention)."""
    task = asyncio.current_task()  # the call's own task: warm runs inside Call.run
    assert task is not None
    task.add_done_callback(lambda _: release())


async def _gathered(chunks: AsyncIterator[GenerationChunk], sink: TextSink,
                    timings: CallTimings | None = None) -> Generation:
    """A generation streamed from a context: its text handed to ``sink`` as it comes, and the whole."""
    texts: list[str] = []
    token_ids: list[int] = []
    last = None
    async with aclosing(chunks):
        async for last in chunks:
            if timings is not None and last.token_ids:
                timings.token()
            sink.put(last.text)
            texts.append(last.text)
            token_ids += last.token_ids
    if last is None or last.usage is None:
        raise EngineError("the engine's context stream ended before its last chunk")
    return Generation("".join(texts), token_ids, last.finish_reason, last.usage, last.context_tokens or 0)
