"""Runs one ready call on an engine: values substituted, shared prefix forked when the engine can.

On a builtin engine a prompt is rendered once with markers where its variables sit; the constant
text before the first marker is the shared prefix, pinned once per engine and forked by every
request that starts with it. A call still waiting for its inputs is warmed: its prompt rendered and
its prefix filled while its producers run, so only the fork is left on the critical path. Upstream
engines get plain text substitution.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, NamedTuple

import msgspec

from engines.seam import EngineError, Route
from engines.seam.builtin_client import ContextClient, Generation
from wire.openai import ChatChoice, ChatCompletion, Completion, CompletionChoice, ResponseMessage, Usage
from wire.vllm import VLLM_EXTRAS
from gateway.registry import EngineRecord
from gateway.semantic import template
from gateway.semantic.graph import Session
from gateway.semantic.prefix import PrefixCache, PrefixEntry
from wire.sampling import sampling_of
from gateway.service import Gateway

# Private-use characters: no chat template or tokenizer gives them meaning, and users don't type them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SPLIT = f"{_OPEN}split{_CLOSE}"  # the start of the last message: where a prompt with no variables splits
_PLAIN_ONLY = ("tools", "response_format", "logprobs", "top_logprobs", "echo", "suffix", "best_of", *VLLM_EXTRAS)


def _marker(name: str) -> str:
    return f"{_OPEN}{name}{_CLOSE}"


def _map_texts(route: Route, body: dict[str, Any], change) -> dict[str, Any]:
    """A copy of the body with ``change`` applied to every message text (or to the prompt)."""
    body = dict(body)
    if route == "completions":
        prompt = body["prompt"]
        body["prompt"] = change(prompt) if isinstance(prompt, str) else [
            change(p) if isinstance(p, str) else p for p in prompt]
        return body
    messages = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": change(content)}
        elif isinstance(content, list):
            message = {**message, "content": [
                {**part, "text": change(part["text"])} if part.get("type") == "text" else part for part in content]}
        messages.append(message)
    body["messages"] = messages
    return body


def _has_media(message: dict[str, Any]) -> bool:
    """Whether a message has parts other than text (rendering for a fork would drop them unseen)."""
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") != "text" for part in content)


def texts(route: Route, body: dict[str, Any]) -> list[str]:
    found: list[str] = []
    _map_texts(route, body, lambda text: found.append(text) or text)
    return found


def substitute(route: Route, body: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    return _map_texts(route, body, lambda text: template.substitute(text, values))


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
    """Where a forkable request runs: the engine, the constant prefix it forks, and the text after it
    (variables still as markers)."""

    record: EngineRecord
    prefix: str
    rest: str


class Runner:
    def __init__(self, gateway: Gateway, prefixes: PrefixCache, min_prefix_chars: int = 64,
                 max_rendered: int = 256):
        self.gateway = gateway
        self.prefixes = prefixes
        self.min_prefix_chars = min_prefix_chars
        # Calls of one app share templates (every map of a map-reduce renders the same messages with
        # markers): rendered prompts are kept per engine, skipping the engine round trip.
        self._rendered: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._max_rendered = max_rendered

    def contexts(self, record: EngineRecord) -> ContextClient:
        return ContextClient(record.engine.name, f"{record.url}/v1", self.gateway.client,
                             auth_headers=getattr(record.engine, "auth_headers", None))

    def _forkable(self, route: Route, body: dict[str, Any]) -> bool:
        if (body.get("n") or 1) != 1 or any(body.get(k) for k in _PLAIN_ONLY):
            return False
        if route == "completions":
            return isinstance(body.get("prompt"), str)
        return not any(_has_media(message) for message in body["messages"])  # the engine refuses it plainly

    def _builtin(self, model: str) -> list[EngineRecord]:
        return [r for r in self.gateway.registry.candidates(model) if r.kind == "builtin"]

    async def run(self, route: Route, body: dict[str, Any], values: dict[str, str], *, hints: dict[str, Any],
                  session: Session) -> bytes:
        """``hints``: the call's scheduling fields for a builtin engine (``Call.engine_hints``)."""
        model = body["model"]
        started = time.perf_counter()
        builtin = self._builtin(model)
        plan = await self._plan(route, body, builtin) if builtin and self._forkable(route, body) else None
        if plan is not None:
            rest = plan.rest
            for name, value in values.items():
                rest = rest.replace(_marker(name), value)
            bounded = hints | self.gateway.token_defaults(route, body, plan.record.kind)  # as a plain request is
            try:
                generation, prompt_tokens = await self._fork_and_generate(plan, rest, body, bounded, session)
            except EngineError as exc:
                self.gateway.record_failure(model, exc)
                raise
            response = _response(route, model, generation, prompt_tokens)
            self.gateway.record_success(model, response, started)  # as a plain request through the gateway is
            return response
        return await self.gateway.create(route, model, substitute(route, body, values), builtin_hints=hints)

    async def warm(self, route: Route, body: dict[str, Any], session: Session) -> None:
        """Before a call's inputs are ready: render its prompt and fill its constant prefix on the engine
        that will run it, so that when they are ready only the fork is left. Errors are left for the
        run itself to meet and report."""
        builtin = self._builtin(body["model"])
        if not builtin or not self._forkable(route, body):
            return
        try:
            plan = await self._plan(route, body, builtin)
            if plan is None:
                return
            entry, _ = await self._acquire(plan, session)
            try:
                await self.contexts(plan.record).fill(text=plan.prefix, context_id=entry.context_id, if_absent=True)
            finally:
                await self.prefixes.release(entry)
        except EngineError:
            pass

    async def _plan(self, route: Route, body: dict[str, Any], records: list[EngineRecord]) -> Plan | None:
        """None when the constant prefix is too short to be worth pinning."""
        prompt = await self._prompt_with_markers(route, body, records[0])
        cut = prompt.find(_OPEN)
        while cut > 0 and prompt[cut - 1].isspace():
            cut -= 1  # BPE joins whitespace to what follows: "of " + "France" must tokenize as "of" + " France"
        prefix = prompt if cut < 0 else prompt[:cut]
        if len(prefix) < self.min_prefix_chars or cut < 0:
            return None
        holder = self.prefixes.engine_holding([(r.id, prefix) for r in records])
        record = next((r for r in records if r.id == holder), records[0])
        return Plan(record, prefix, prompt[cut:].replace(_SPLIT, ""))

    async def _prompt_with_markers(self, route: Route, body: dict[str, Any], record: EngineRecord) -> str:
        """The prompt with a marker for each variable; a prompt without variables gets one at the start
        of its last message, where it splits instead."""
        has_variables = any(template.PLACEHOLDER.search(text) for text in texts(route, body))
        marked = _map_texts(route, body, lambda text: template.PLACEHOLDER.sub(
            lambda m: _marker(m.group(2)), text))
        if route == "completions":
            return marked["prompt"]
        last = marked["messages"][-1]
        if not has_variables and isinstance(last.get("content"), str):
            marked["messages"][-1] = {**last, "content": _SPLIT + last["content"]}
        key = (record.id, msgspec.json.encode(marked))
        prompt = self._rendered.get(key)
        if prompt is None:
            prompt = self._rendered[key] = await self.contexts(record).render(marked)
            if len(self._rendered) > self._max_rendered:
                self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(key)
        return prompt

    async def _acquire(self, plan: Plan, session: Session) -> tuple[PrefixEntry, bool]:
        entry, hit = await self.prefixes.acquire(plan.record.id, self.contexts(plan.record), plan.prefix,
                                                 None if session.default else session.id)
        if not session.default:
            session.prefix_keys.add(entry.key)
        return entry, hit

    async def _fork_and_generate(self, plan: Plan, rest: str, body: dict[str, Any], hints: dict[str, Any],
                                 session: Session) -> tuple[Generation, int]:
        record = plan.record
        entry, hit = await self._acquire(plan, session)
        record.in_flight += 1
        try:
            generation = await self.contexts(record).generate(entry.context_id, sampling_of(body) | hints,
                                                              fork_with=rest, context_text=plan.prefix)
        finally:
            record.in_flight -= 1
            await self.prefixes.release(entry)
        if hit:
            self.prefixes.hit_tokens += generation.context_tokens
        return generation, generation.context_tokens + generation.usage["prompt_tokens"]


def _response(route: Route, model: str, generation: Generation, prompt_tokens: int) -> bytes:
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=len(generation.token_ids),
                  total_tokens=prompt_tokens + len(generation.token_ids))
    if route == "completions":
        return msgspec.json.encode(Completion(model=model, usage=usage, choices=[
            CompletionChoice(index=0, text=generation.text, finish_reason=generation.finish_reason)]))
    return msgspec.json.encode(ChatCompletion(model=model, usage=usage, choices=[
        ChatChoice(index=0, message=ResponseMessage(content=generation.text),
                   finish_reason=generation.finish_reason)]))
