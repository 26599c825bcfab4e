"""A step run as any OpenAI request runs (an engine without contexts, or a request that does not fork), its
values substituted into its text; with a sink, streamed from the engine when its text is one choice's plain
text (tool calls, logprobs and several choices arrive whole, at the end)."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.seam import EngineError, Route
from gateway.scheduler import Placement
from gateway.semantic import template
from gateway.semantic.answer import Answer, read_answer, usage_of
from gateway.semantic.call_spec import Step
from gateway.semantic.gateway_port import GatewayPort
from gateway.semantic.graph import CallTimings, Variable
from gateway.semantic.streaming import TextSink
from wire.openai import Usage
from wire.placeholders import map_texts

_WHOLE_ONLY = ("tools", "logprobs", "echo")  # answers a semantic stream gets whole, in one chunk


async def run_plain(gateway: GatewayPort, step: Step, values: dict[str, str], hints: dict[str, Any],
                    placement: Placement, sink: TextSink | None, timings: CallTimings | None = None,
                    stream: bool = False, output: Variable | None = None) -> Answer:
    """``timings``: the call's, told when the request was sent and its first token came; ``stream``: streamed
    from the engine even with no sink, so that its first token is timed and ``output`` (the variable the step
    binds) is extended with its text as it comes, for consumers prefilled ahead (prefill.py)."""
    route, body = step.route, _substituted(step.route, step.body, values)
    model = body["model"]
    if (sink is None and not stream) or (body.get("n") or 1) != 1 or any(body.get(k) for k in _WHOLE_ONLY):
        answer = await gateway.create(route, model, body, hints=hints, placement=placement, read=read_answer)
        if sink is not None:
            sink.engine_id = answer.engine_id
        if timings is not None:
            timings.dispatch(answer.dispatched)
        return Answer.passed_through(route, answer)
    opened = await gateway.open_stream(route, model, body | {"stream": True, "stream_options": {
        "include_usage": True}}, hints=hints, placement=placement)
    if timings is not None:
        timings.dispatch(opened.dispatched)
    if sink is not None:
        sink.engine_id = opened.record.id
    whole = _Gathered(route)
    async for events in gateway.sse_events(model, opened):
        for event in events.split(b"\n\n"):
            if event.startswith(b"data: {"):
                text = whole.add(msgspec.json.decode(event[6:]))
                if text and timings is not None:
                    timings.token()
                if text and output is not None:
                    output.extend(text)
                if sink is not None:
                    sink.put(text)
    return Answer.generated(route, model, whole.text(), whole.finish_reason, whole.usage(), opened.record.id)


def _substituted(route: Route, body: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    return map_texts(route, body, lambda text: template.substitute(text, values))


class _Gathered:
    """One choice of an OpenAI stream gathered into its whole: text, finish reason, usage."""

    def __init__(self, route: Route):
        self.route = route
        self._texts: list[str] = []
        self.finish_reason: str | None = None
        self._prompt_tokens = self._completion_tokens = 0
        self._cached_tokens: int | None = None  # None: the engine did not say

    def add(self, chunk: dict[str, Any]) -> str:
        """Takes one chunk; returns the text it adds. An error object (the engine failed mid-stream) is raised."""
        if "error" in chunk:
            raise EngineError(f"the engine failed mid-stream: {str(chunk['error'])[:500]}",
                              body=msgspec.json.encode(chunk))
        if chunk.get("usage"):
            self._prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
            self._completion_tokens = chunk["usage"].get("completion_tokens", 0)
            details = chunk["usage"].get("prompt_tokens_details") or {}
            self._cached_tokens = details.get("cached_tokens")
        text = ""
        for choice in chunk.get("choices") or ():
            text += (choice.get("text") if self.route == "completions" else
                     (choice.get("delta") or {}).get("content")) or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self._texts.append(text)
        return text

    def text(self) -> str:
        return "".join(self._texts)

    def usage(self) -> Usage:
        return usage_of(self._prompt_tokens, self._completion_tokens, self._cached_tokens)
