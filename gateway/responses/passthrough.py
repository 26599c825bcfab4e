"""A Responses request passed through to an engine that speaks that API itself (seam ``ResponsesEngine``): the
client's body as it came, but for what the gateway keeps itself, and the engine's answer (whole, or its stream's
events) read into the response the gateway stores and answers.

The gateway keeps the conversation: a turn naming ``previous_response_id`` is sent with the whole conversation
as its input (the earlier turns from the gateway's store), and the engine is asked not to store anything
(``store: false``), so any engine of the model can serve any turn and no stored copy is left where nobody reads it.
The gateway's own fields of the response (its model name, ``previous_response_id``, ``store``, ``background``)
are the client's request's, as on the chat path; the engine's say what ran: id, status, output, usage."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from wire.openai import Usage
from wire.responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    MessageItem,
    OutputItem,
    OutputText,
    Response,
    ResponseError,
    ResponseUsage,
)
from wire.usage import FinishOnly, UsageOnly

# The client's fields the gateway answers itself: the conversation (sent whole instead), where it is stored, and
# whether it runs in the background (the gateway runs it so), and Parrot's extension.
_KEPT = frozenset({"previous_response_id", "store", "background", "parrot"})
_LIFECYCLE_END = frozenset({"response.completed", "response.incomplete", "response.failed"})


def upstream_body(body: dict[str, Any], input: list[Item], earlier: list[Item]) -> dict[str, Any]:
    """What the engine is sent: the client's body, its input the whole conversation when it continues one."""
    sent = {name: value for name, value in body.items() if name not in _KEPT}
    if earlier:  # without the items' ids and statuses: the gateway's (or another engine's), unknown to this one
        sent["input"] = [{name: value for name, value in item.items() if name not in ("id", "status")}
                         for item in msgspec.to_builtins([*earlier, *input])]
    sent["store"] = False
    return sent


class _Usage(Struct):
    input_tokens: int | None = 0
    output_tokens: int | None = 0
    total_tokens: int | None = None
    input_tokens_details: dict[str, Any] | None = None


class _Answer(Struct):
    """The engine's response as far as the gateway reads it; whatever else it says is its own (its id too: the
    response is the gateway's, stored under the gateway's id)."""

    status: str | None = None
    output: list[Any] | None = None
    usage: _Usage | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class _Event(Struct):
    type: str = ""
    sequence_number: int | None = None
    response: _Answer | None = None


_answer_decoder = msgspec.json.Decoder(_Answer)
_event_decoder = msgspec.json.Decoder(_Event)


def adopt(response: Response, answer: _Answer) -> None:
    """The engine's account of what ran, into the gateway's ``response``."""
    if answer.status in ("queued", "in_progress", "completed", "incomplete", "cancelled", "failed"):
        response.status = answer.status  # type: ignore[assignment]
    if answer.output is not None:
        response.output = [item for item in map(_output_item, answer.output) if item is not None]
    if answer.usage is not None:
        response.usage = _usage(answer.usage)
    if answer.incomplete_details is not None and answer.incomplete_details.get("reason"):
        response.incomplete_details = IncompleteDetails(reason=str(answer.incomplete_details["reason"]))
    if answer.error is not None:
        response.error = ResponseError(code=str(answer.error.get("code") or "server_error"),
                                       message=str(answer.error.get("message") or "the engine failed"))


def adopt_body(response: Response, body: bytes) -> None:
    """``adopt`` of a whole answer (a 200 that is no Response: nothing adopted, the response fails)."""
    try:
        adopt(response, _answer_decoder.decode(body))
    except msgspec.DecodeError:
        response.status = "failed"
        response.error = ResponseError(code="server_error", message="the engine's answer is not a Response")


def _output_item(raw: Any) -> OutputItem | None:
    """An output item the gateway stores (a message's text, a function call); others (reasoning, hosted
    tools' calls) are the engine's and are not carried into the conversation."""
    if not isinstance(raw, dict):
        return None
    if raw.get("type") == "message":
        parts = [OutputText(text=part["text"]) for part in raw.get("content") or ()
                 if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str)]
        return MessageItem(role="assistant", content=parts, id=raw.get("id"), status=raw.get("status"))
    if raw.get("type") == "function_call":
        try:
            return msgspec.convert(raw, FunctionCallItem)
        except msgspec.ValidationError:
            return None
    return None


def _usage(usage: _Usage) -> ResponseUsage:
    prompt, generated = usage.input_tokens or 0, usage.output_tokens or 0
    cached = (usage.input_tokens_details or {}).get("cached_tokens") or 0
    return ResponseUsage(input_tokens=prompt, output_tokens=generated, total_tokens=usage.total_tokens or prompt + generated,
                         input_tokens_details=InputTokensDetails(cached_tokens=int(cached)))


def _reported(answer: _Answer | None) -> UsageOnly | None:
    if answer is None:
        return None
    reason = "length" if answer.status == "incomplete" else "stop" if answer.status == "completed" else None
    usage = None
    if answer.usage is not None:
        prompt, generated = answer.usage.input_tokens or 0, answer.usage.output_tokens or 0
        usage = Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)
    return UsageOnly(usage=usage, choices=[FinishOnly(finish_reason=reason)] if reason else [])


def read_answer(body: bytes) -> UsageOnly | None:
    """A whole Response's usage and end, as the gateway's metrics and token quotas read a chat answer's."""
    try:
        return _reported(_answer_decoder.decode(body))
    except msgspec.DecodeError:
        return None


def read_event(data: bytes) -> UsageOnly | None:
    """The same of a stream event's data (its ``response``, in the events that end the stream)."""
    try:
        event = _event_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return _reported(event.response) if event.type in _LIFECYCLE_END else None


class UpstreamEvents:
    """The engine's stream as the client gets it: each event as it came but for the response it carries (the
    ``response.*`` lifecycle events'), which is the gateway's (``adopt``ed); ``[DONE]`` dropped (the Responses API
    ends without it); an engine failing mid-stream (the gateway's SSE error object) ends it with ``response.failed``."""

    def __init__(self, response: Response):
        self.response = response
        self._buffer = b""
        self._sequence = -1
        self.ended = False  # the event that ends the response was read: it is stored before it goes out

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [framed for framed in map(self._event, events) if framed]

    def _event(self, event: bytes) -> bytes:
        payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not payload or payload == b"[DONE]":
            return b""
        try:
            raw = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return b""
        if not isinstance(raw, dict):
            return b""
        if "error" in raw and "type" not in raw:  # the gateway's own: the engine failed mid-stream
            error = raw["error"] if isinstance(raw["error"], dict) else {}
            self.response.status = "failed"
            self.response.error = ResponseError(code=str(error.get("code") or error.get("type") or "server_error"),
                                                message=str(error.get("message") or "the engine failed"))
            raw = {"type": "response.failed", "sequence_number": self._sequence + 1, "response": None}
        elif isinstance(raw.get("response"), dict):
            adopt(self.response, msgspec.convert(raw["response"], _Answer))
        if isinstance(raw.get("sequence_number"), int):
            self._sequence = raw["sequence_number"]
        kind = str(raw.get("type") or "")
        if "response" in raw:
            raw["response"] = msgspec.to_builtins(self.response)
            payload = msgspec.json.encode(raw)
        self.ended = self.ended or kind in _LIFECYCLE_END
        return (b"event: " + kind.encode() + b"\n" if kind else b"") + b"data: " + payload + b"\n\n"

    def close(self) -> bytes:
        """What ends a stream the engine left without its end: ``response.failed``."""
        if self.ended:
            return b""
        self.response.status = "failed"
        self.response.error = self.response.error or ResponseError(
            code="server_error", message="the engine's stream ended before the response did")
        return self._event(b"data: " + msgspec.json.encode(
            {"type": "response.failed", "sequence_number": self._sequence + 1, "response": {}}))
