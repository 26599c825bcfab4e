"""Runs one ready call on an engine: values substituted, shared prefix forked when the engine can.

On an engine with contexts (engines/seam ``ContextEngine``) a prompt is split where its first variable
starts (by the engine, which owns the tokenizer's rules); the constant text before it is the shared
prefix, pinned once per engine and forked by every request that starts with it. The global scheduler
(gateway/scheduler.py) places every call: by its prefix (held exactly where it is pinned), its criteria
and its task group. A call still waiting
for its inputs is warmed: its prompt split and its prefix filled while its producers run, so only the
fork is left on the critical path; the prefix is held for the call until it ends, so no other prefix
evicts it meanwhile. Other engines get plain text substitution.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, NamedTuple

import msgspec

from engines.seam import ContextEngine, EngineError, ForkPart, Generation, GenerationChunk, PromptSplit, Route
from engines.seam.connect import has_capability
from gateway.attempts import retryable
from gateway.outcomes import read_usage
from gateway.prompt_prefix import chain, tokens_in
from gateway.registry import EngineRecord
from gateway.scheduler import Placement, Work
from gateway.semantic import template
from gateway.semantic.graph import Call, Session, Variable, new_id
from gateway.semantic.handoff import PendingOutput, announced_inputs, fork_parts, unless_withdrawn
from gateway.semantic.prefix import PrefixCache, PrefixEntry
from gateway.semantic.streaming import TextSink
from gateway.service import Answer, Gateway
from wire.openai import (ChatChoice, ChatCompletion, Completion, CompletionChoice, PromptTokensDetails, ResponseMessage,
                         Usage)
from wire.placeholders import map_texts
from wire.sampling import sampling_of
from wire.vllm import VLLM_EXTRAS

_WHOLE_ONLY = ("tools", "logprobs", "echo")  # answers a semantic stream gets whole, in one chunk
_PLAIN_ONLY = ("tools", "response_format", "logprobs", "top_logprobs", "echo", "suffix", "best_of", *VLLM_EXTRAS)


def _has_media(message: dict[str, Any]) -> bool:
    """Whether a message has parts other than text (rendering for a fork would drop them unseen)."""
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") != "text" for part in content)


def substitute(route: Route, body: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    return map_texts(route, body, lambda text: template.substitute(text, values))


def output_text(route: Route, response: bytes) -> str:
    """The generated text of a response: message content, or a tool call's arguments."""
    try:
        choice = msgspec.json.decode(response)["choices"][0]
    except (msgspec.DecodeError, LookupError, TypeError) as exc:  # the engine answered 200 with something else
        raise EngineError(f"the engine's answer is not an OpenAI {route} response ({exc})") from None
    if route == "completions":
        return choice.get("text") or ""
    message = choice.get("message") or {}
    if message.get("content") is None and message.get("tool_calls"):
        return message["tool_calls"][0]["function"]["arguments"]
    return message.get("content") or ""


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


class Runner:
    def __init__(self, gateway: Gateway, prefixes: PrefixCache, min_prefix_chars: int = 64):
        self.gateway = gateway
        self.prefixes = prefixes
        self.min_prefix_chars = min_prefix_chars

    def _forkable(self, route: Route, body: dict[str, Any]) -> bool:
        if (body.get("n") or 1) != 1 or any(body.get(k) for k in _PLAIN_ONLY):
            return False
        if route == "completions":
            return isinstance(body.get("prompt"), str)
        return not any(_has_media(message) for message in body["messages"])  # the engine refuses it plainly

    def _with_contexts(self, model: str) -> list[EngineRecord]:
        return [r for r in self.gateway.registry.candidates(model) if has_capability(r.engine, ContextEngine)]

    async def run(self, route: Route, body: dict[str, Any], values: dict[str, str], *, call: Call,
                  session: Session, sink: TextSink | None = None, output: Variable | None = None) -> Answer:
        """Runs ``call``'s request with its inputs' ``values``, placed by the global scheduler; a forked
        request that fails on one engine is run again on another while nothing of it reached anyone.
        With a ``sink``, its text goes there as it is generated. ``output``: the variable its text will be
        bound to, published as pending on the engine while it is generated (handoff.py)."""
        model = body["model"]
        hints, placement = call.engine_hints(), call.placement()
        started = time.perf_counter()
        records = self._with_contexts(model)
        split = await self._split(route, body, records) if records and self._forkable(route, body) else None
        if split is None:
            answer = await self._run_plain(route, substitute(route, body, values), hints, placement, sink)
            call.engine_id = answer.engine_id
            return answer
        bounded = hints | self.gateway.token_defaults(route, body, records[0].engine)  # as a plain request is
        rest = split.rest_with(values)
        tried: set[str] = set()
        while True:
            plan = self._place(model, split, rest, records, placement)
            call.engine_id = plan.record.id
            try:
                generation = await self._fork_and_generate(plan, rest, body, bounded, session, sink, output,
                                                           generating=True)
                break
            except EngineError as exc:
                tried.add(plan.record.id)
                records = [r for r in self._with_contexts(model) if r.id not in tried]
                if (not retryable(exc) or not records or len(tried) > self.gateway.config.routing.num_retries
                        or (sink is not None and sink.started)):
                    self.gateway.outcomes.failed(model, exc)
                    raise
        return self._answered(route, model, plan, generation, started)

    def _answered(self, route: Route, model: str, plan: Plan, generation: Generation, started: float) -> Answer:
        prompt_tokens, cached_tokens = generation.prompt_usage()
        response = _response(route, model, generation.text, generation.finish_reason, prompt_tokens,
                             len(generation.token_ids), cached_tokens)
        self.gateway.outcomes.succeeded(model, plan.record.engine.name, read_usage(response), started)  # as a plain request is
        return Answer(response, plan.record.id)

    async def plan_ahead(self, route: Route, body: dict[str, Any], call: Call, input_timeout_s: float
                         ) -> Handoff | None:
        """How ``call`` can run before its inputs' text is known: on the one engine generating the inputs
        that are not ready, which puts their text in as they are produced (handoff.py). None when
        it cannot (an input failed, or is pending on no engine or on several, or the request does not
        fork): the call then waits for its inputs' values and runs as usual."""
        if not self._forkable(route, body):
            return None
        known = await announced_inputs(call.inputs, input_timeout_s)
        if known is None:
            return None
        pending = {name: value for name, value in known.items() if isinstance(value, PendingOutput)}
        records = [r for r in self._with_contexts(body["model"]) if {p.engine_id for p in pending.values()} == {r.id}]
        split = await self._split(route, body, records) if records else None
        if split is None:
            return None
        values = {name: value for name, value in known.items() if isinstance(value, str)}
        plan = self._place(body["model"], split, split.rest_with(values), records, call.placement())
        return Handoff(plan, fork_parts(split, values, pending), list(pending.values()))

    async def run_ahead(self, route: Route, body: dict[str, Any], handoff: Handoff, *, call: Call,
                        session: Session, input_timeout_s: float, sink: TextSink | None = None,
                        output: Variable | None = None) -> Answer | None:
        """Runs ``call`` as ``handoff`` plans; None when a producer was withdrawn or failed on the engine
        before this produced anything (the caller then runs it from its inputs' text, as usual)."""
        started = time.perf_counter()
        call.hand_to_engine()
        plan = handoff.plan
        call.engine_id = plan.record.id
        bounded = call.engine_hints() | self.gateway.token_defaults(route, body, plan.engine)
        try:
            done, withdrawn = await unless_withdrawn(
                self._fork_and_generate(plan, handoff.parts, body, bounded, session, sink, output, generating=False),
                handoff.pending, beside=_running_once_bound(call, input_timeout_s))
        except EngineError as exc:
            if (exc.status_code == 424 or retryable(exc)) and not (sink is not None and sink.started):
                return None  # a producer failed there, or the engine did: run from the text (elsewhere)
            self.gateway.outcomes.failed(body["model"], exc)
            raise
        if not withdrawn:
            for variable in call.inputs.values():  # bound by their producers as their answers arrive
                await variable.get(input_timeout_s)  # a producer whose value failed (quotas) fails this call too
        if withdrawn or any(pending.withdrawn.is_set() for pending in handoff.pending):
            # A producer was run again elsewhere (its first answer lost): its value may differ from the tokens
            # this call took, so it runs again from the value, unless its text already reached a reader.
            if output is not None:
                output.withdraw()
            if sink is not None and sink.started:
                raise EngineError(f"an input of call {call.id} was produced again after the call began streaming")
            return None
        if call.started is None:
            call.mark_running()
        return self._answered(route, body["model"], plan, done, started)

    async def _run_plain(self, route: Route, body: dict[str, Any], hints: dict[str, Any], placement: Placement,
                         sink: TextSink | None) -> Answer:
        """The request as any OpenAI request runs; with a ``sink``, streamed from the engine when its text is
        one choice's plain text (tool calls, logprobs and several choices arrive whole, at the end)."""
        model = body["model"]
        if sink is None or (body.get("n") or 1) != 1 or any(body.get(k) for k in _WHOLE_ONLY):
            answer = await self.gateway.create(route, model, body, hints=hints, placement=placement)
            if sink is not None:
                sink.engine_id = answer.engine_id
            return answer
        opened = await self.gateway.open_stream(route, model, body | {"stream": True, "stream_options": {
            "include_usage": True}}, hints=hints, placement=placement)
        sink.engine_id = opened.record.id
        whole = _Gathered(route)
        async for events in self.gateway.sse_events(model, opened):
            for event in events.split(b"\n\n"):
                if event.startswith(b"data: {"):
                    sink.put(whole.add(msgspec.json.decode(event[6:])))
        return Answer(_response(route, model, whole.text(), whole.finish_reason, whole.prompt_tokens,
                                whole.completion_tokens, whole.cached_tokens), opened.record.id)

    async def warm(self, route: Route, body: dict[str, Any], call: Call, session: Session) -> None:
        """Before a call's inputs are ready: split its prompt and fill its constant prefix on the engine
        that will run it, so that when they are ready only the fork is left; the prefix is held there until
        the call ends. Errors are left for the run itself to meet and report."""
        records = self._with_contexts(body["model"])
        if not records or not self._forkable(route, body):
            return
        try:
            split = await self._split(route, body, records)
            if split is None:
                return
            plan = self._place(body["model"], split, "", records, call.placement())
            key = self.prefixes.key(plan.record.id, split.prefix)
            if not session.holdings.pin(key, tokens_in(len(split.prefix.encode()))):
                return  # its key holds its quota of prefixes ahead already: filled when the call runs
            self._until_done(lambda: session.holdings.unpin(key))
            entry, _ = await self._acquire(plan, session)
            self._until_done(lambda: self.prefixes.release_soon(entry))
            await plan.engine.fill(text=plan.split.prefix, context_id=entry.context_id, if_absent=True)
        except EngineError:
            pass

    @staticmethod
    def _until_done(release: Callable[[], None]) -> None:
        """Holds what a waiting call reserved (the prefix it will fork, its key's pin of it) until that call
        ends (it runs, fails or is cancelled), so that the engine keeps the prefix ahead of prefixes nobody
        is waiting for (DAG-aware retention)."""
        task = asyncio.current_task()  # the call's own task: warm runs inside Call.run
        assert task is not None
        task.add_done_callback(lambda _: release())

    async def _split(self, route: Route, body: dict[str, Any], records: list[EngineRecord]) -> PromptSplit | None:
        """The prompt split at its shared prefix; None when that prefix is too short to be worth pinning."""
        split = await records[0].engine.split_prompt(route, body)  # type: ignore[attr-defined]
        return split if len(split.prefix) >= self.min_prefix_chars else None

    def _place(self, model: str, split: PromptSplit, rest: str, records: list[EngineRecord],
               placement: Placement) -> Plan:
        """The engine the global scheduler picks for a fork of ``split``'s prefix (known exactly where pinned)."""
        prefix = split.prefix.encode()
        held_by = frozenset(r.id for r in records if self.prefixes.holds(r.id, split.prefix))
        work = Work(chain(model, prefix), tokens_in(len(prefix) + len(rest.encode())),
                    placement._replace(held_by=held_by), prefix_tokens=tokens_in(len(prefix)))
        record = self.gateway.scheduler.place(work, records)
        assert record is not None  # records is never empty here
        return Plan(record, split)

    async def _acquire(self, plan: Plan, session: Session) -> tuple[PrefixEntry, bool]:
        entry, hit = await self.prefixes.acquire(plan.record.id, plan.engine, plan.split.prefix,
                                                 None if session.default else session.id)
        if not session.default:
            session.prefix_keys.add(entry.key)
        return entry, hit

    async def _fork_and_generate(self, plan: Plan, rest: str | list[ForkPart], body: dict[str, Any],
                                 hints: dict[str, Any], session: Session, sink: TextSink | None,
                                 output: Variable | None, *, generating: bool) -> Generation:
        """The fork's generation. ``output``: the variable it produces,
        published under its output id while it is generated (``generating``: at once; else once the
        call's inputs are bound, see _running_once_bound)."""
        record = plan.record
        entry, hit = await self._acquire(plan, session)
        record.in_flight += 1
        sampling = sampling_of(body) | hints
        record.requests.add()
        pending = PendingOutput(record.id, new_id("out")) if output is not None else None
        output_id = pending.output_id if pending is not None else None
        if output is not None and pending is not None:
            output.publish(pending, generating=generating)
        try:
            if sink is None:
                generation = await plan.engine.generate_in_context(entry.context_id, sampling, fork_with=rest,
                                                                   context_text=plan.split.prefix,
                                                                   output_id=output_id)
            else:
                sink.engine_id = record.id
                generation = await _gathered(plan.engine.stream_in_context(
                    entry.context_id, sampling, fork_with=rest, context_text=plan.split.prefix,
                    output_id=output_id), sink)
        except BaseException:
            if output is not None:
                output.withdraw()
            raise
        finally:
            record.in_flight -= 1
            await self.prefixes.release(entry)
        if output is not None and pending is not None:
            output.settle(pending)
        self.gateway.outcomes.forked(body["model"], record.engine.name)
        if hit:
            self.prefixes.hit_tokens += generation.context_tokens
        return generation


async def _running_once_bound(call: Call, timeout_s: float) -> None:
    """Marks a call sent ahead as running once its inputs are bound here (its engine started it then), and
    announces its outputs to their consumers, which may go ahead in turn."""
    with contextlib.suppress(Exception):
        for variable in call.inputs.values():
            await variable.get(timeout_s)
        call.mark_running()
        for output in call.outputs.values():
            output.generating()


async def _gathered(chunks: AsyncIterator[GenerationChunk], sink: TextSink) -> Generation:
    """A generation streamed from a context: its text handed to ``sink`` as it comes, and the whole."""
    texts: list[str] = []
    token_ids: list[int] = []
    last = None
    async with aclosing(chunks):
        async for last in chunks:
            sink.put(last.text)
            texts.append(last.text)
            token_ids += last.token_ids
    if last is None or last.usage is None:
        raise EngineError("the engine's context stream ended before its last chunk")
    return Generation("".join(texts), token_ids, last.finish_reason, last.usage, last.context_tokens or 0)


class _Gathered:
    """One choice of an OpenAI stream gathered into its whole: text, finish reason, usage."""

    def __init__(self, route: Route):
        self.route = route
        self._texts: list[str] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.cached_tokens: int | None = None  # None: the engine did not say

    def add(self, chunk: dict[str, Any]) -> str:
        """Takes one chunk; returns the text it adds. An error object (the engine failed mid-stream) is raised."""
        if "error" in chunk:
            raise EngineError(f"the engine failed mid-stream: {str(chunk['error'])[:500]}",
                              body=msgspec.json.encode(chunk))
        if chunk.get("usage"):
            self.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            self.completion_tokens = chunk["usage"].get("completion_tokens", 0)
            details = chunk["usage"].get("prompt_tokens_details") or {}
            self.cached_tokens = details.get("cached_tokens")
        text = ""
        for choice in chunk.get("choices") or ():
            text += (choice.get("text") if self.route == "completions" else
                     (choice.get("delta") or {}).get("content")) or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self._texts.append(text)
        return text

    def text(self) -> str:
        return "".join(self._texts)


def _response(route: Route, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
              completion_tokens: int, cached_tokens: int | None) -> bytes:
    """``cached_tokens``: None when the engine did not say (an upstream without the figure)."""
    details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)
    if route == "completions":
        return msgspec.json.encode(Completion(model=model, usage=usage, choices=[
            CompletionChoice(index=0, text=text, finish_reason=finish_reason)]))
    return msgspec.json.encode(ChatCompletion(model=model, usage=usage, choices=[
        ChatChoice(index=0, message=ResponseMessage(content=text), finish_reason=finish_reason)]))
