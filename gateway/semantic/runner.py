"""Runs one ready call on an engine: values substituted, shared prefix forked when the engine can.

On a builtin engine a prompt is rendered once with markers where its variables sit; the constant
text before the first marker is the shared prefix, pinned once per engine and forked by every
request that starts with it. Upstream engines get plain text substitution.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engines.base import Route
from engines.contexts import ContextClient, Generation
from engines.protocol import (
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    ResponseMessage,
    Usage,
)
from gateway.registry import EngineRecord
from gateway.semantic import template
from gateway.semantic.graph import Session
from gateway.semantic.prefix import PrefixCache
from gateway.service import Gateway

# Private-use characters: no chat template or tokenizer gives them meaning, and users don't type them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SPLIT = f"{_OPEN}split{_CLOSE}"  # the start of the last message: where a prompt with no variables splits
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
_PLAIN_ONLY = ("tools", "response_format", "logprobs", "top_logprobs", "echo", "suffix", "best_of")


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


def texts(route: Route, body: dict[str, Any]) -> list[str]:
    found: list[str] = []
    _map_texts(route, body, lambda text: found.append(text) or text)
    return found


def substitute(route: Route, body: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    return _map_texts(route, body, lambda text: template.substitute(text, values))


def output_text(route: Route, response: bytes) -> str:
    """The generated text of a response: message content, or a tool call's arguments."""
    choice = msgspec.json.decode(response)["choices"][0]
    if route == "completions":
        return choice.get("text") or ""
    message = choice.get("message") or {}
    if message.get("content") is None and message.get("tool_calls"):
        return message["tool_calls"][0]["function"]["arguments"]
    return message.get("content") or ""


class Runner:
    def __init__(self, gateway: Gateway, prefixes: PrefixCache, min_prefix_chars: int = 64):
        self.gateway = gateway
        self.prefixes = prefixes
        self.min_prefix_chars = min_prefix_chars

    def contexts(self, record: EngineRecord) -> ContextClient:
        return ContextClient(record.engine.name, f"{record.url}/v1", self.gateway.client)

    def _forkable(self, route: Route, body: dict[str, Any]) -> bool:
        if (body.get("n") or 1) != 1 or any(body.get(k) for k in _PLAIN_ONLY):
            return False
        return route == "chat/completions" or isinstance(body.get("prompt"), str)

    async def run(self, route: Route, body: dict[str, Any], values: dict[str, str], *, priority: int,
                  session: Session) -> bytes:
        model = body["model"]
        builtin = [r for r in self.gateway.registry.candidates(model) if r.kind == "builtin"]
        if builtin and self._forkable(route, body):
            return await self._run_forked(route, body, values, priority, session, builtin)
        plain = substitute(route, body, values)
        if builtin:
            plain["priority"] = priority
        return await self.gateway.create(route, model, plain)

    async def _prompt_with_markers(self, route: Route, body: dict[str, Any], record: EngineRecord) -> str:
        marked = _map_texts(route, body, lambda text: template.PLACEHOLDER.sub(
            lambda m: _marker(m.group(2)), text))
        if route == "completions":
            return marked["prompt"]
        last = marked["messages"][-1]
        if isinstance(last.get("content"), str):
            marked["messages"][-1] = {**last, "content": _SPLIT + last["content"]}
        return await self.contexts(record).render(marked)

    async def _run_forked(self, route: Route, body: dict[str, Any], values: dict[str, str], priority: int,
                          session: Session, records: list[EngineRecord]) -> bytes:
        prompt = await self._prompt_with_markers(route, body, records[0])
        cut = prompt.find(_OPEN)
        while cut > 0 and prompt[cut - 1] in " \t":
            cut -= 1  # BPE joins a space to the next word: "of " + "France" must tokenize as "of" + " France"
        prefix = prompt if cut < 0 else prompt[:cut]
        if len(prefix) < self.min_prefix_chars or cut < 0:
            plain = substitute(route, body, values) | {"priority": priority}
            return await self.gateway.create(route, body["model"], plain)
        rest = prompt[cut:].replace(_SPLIT, "")
        for name, value in values.items():
            rest = rest.replace(_marker(name), value)
        holder = self.prefixes.engine_holding([(r.id, prefix) for r in records])
        record = next((r for r in records if r.id == holder), records[0])
        generation, prompt_tokens = await self._fork_and_generate(record, prefix, rest, body, priority, session)
        return _response(route, body["model"], generation, prompt_tokens)

    async def _fork_and_generate(self, record: EngineRecord, prefix: str, rest: str, body: dict[str, Any],
                                 priority: int, session: Session) -> tuple[Generation, int]:
        client = self.contexts(record)
        entry = await self.prefixes.acquire(record.id, client, prefix, None if session.default else session.id)
        if not session.default:
            session.prefix_keys.add(entry.key)
        record.in_flight += 1
        try:
            sampling = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
            if body.get("max_completion_tokens") is not None:
                sampling["max_tokens"] = body["max_completion_tokens"]
            generation = await client.generate(entry.filled.result(), sampling | {"priority": priority},
                                               fork_with=rest)
        finally:
            record.in_flight -= 1
            self.prefixes.release(entry)
        return generation, entry.tokens + generation.usage["prompt_tokens"]


def _response(route: Route, model: str, generation: Generation, prompt_tokens: int) -> bytes:
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=len(generation.token_ids),
                  total_tokens=prompt_tokens + len(generation.token_ids))
    if route == "completions":
        return msgspec.json.encode(Completion(model=model, usage=usage, choices=[
            CompletionChoice(index=0, text=generation.text, finish_reason=generation.finish_reason)]))
    return msgspec.json.encode(ChatCompletion(model=model, usage=usage, choices=[
        ChatChoice(index=0, message=ResponseMessage(content=generation.text),
                   finish_reason=generation.finish_reason)]))
