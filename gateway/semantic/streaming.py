"""A semantic request's answer streamed while its call generates (``stream: true`` with ``wait: true``).

The call runs as any call does (it goes on if the client leaves: its output variable still gets its value);
its text is handed to a ``TextSink`` as the engine generates it, and the client's stream reads from there.
Chunks are OpenAI's: a role delta first (with the ``parrot`` result, so the output variable's id is known
at once), content deltas, then the finish reason (with ``parrot`` again), the usage chunk when asked for,
and ``[DONE]``. A failure before any text is an HTTP error, as for a non-streamed request; after, an SSE
error event.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from engines.seam import Route
from http_plumbing.http_errors import engine_error_body, error_payload
from wire.openai import ErrorBody, new_id
from wire.sse import SSE_DONE, sse_event

if TYPE_CHECKING:
    from gateway.semantic.answer import Answer
    from gateway.semantic.schema import ParrotResult

_END = None  # queued once the call has ended


class TextSink:
    """Where a streamed call's text goes as it is generated, until its call ends."""

    def __init__(self) -> None:
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self.started = False  # some text went out: the call can no longer be re-run elsewhere unseen
        self.engine_id: str | None = None  # where the call generates (the x-parrot-engine header)

    def put(self, text: str) -> None:
        if text:
            self.started = True
            self._pieces.put_nowait(text)

    def follow(self, task: asyncio.Task) -> None:
        """Ends the pieces when ``task`` (the call) ends, however it ends."""
        task.add_done_callback(lambda _: self._pieces.put_nowait(_END))

    async def first(self) -> str | None:
        """The first piece, or None if the call ended without text."""
        return await self._pieces.get()

    async def rest(self) -> AsyncIterator[str]:
        while (piece := await self._pieces.get()) is not _END:
            yield piece


class StreamedAnswer:
    """The OpenAI chunks of one streamed semantic answer."""

    def __init__(self, route: Route, model: str, parrot: ParrotResult, include_usage: bool):
        self.route, self.parrot, self.include_usage = route, parrot, include_usage
        chat = route == "chat/completions"
        self._base = {"id": new_id("chatcmpl" if chat else "cmpl"),
                      "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": int(time.time()), "model": model}

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> bytes:
        return sse_event(msgspec.json.encode({**self._base, "choices": [{"index": 0, **choice}], **extra}))

    def _piece(self, text: str, **extra: Any) -> dict[str, Any]:
        if self.route == "completions":
            return {"text": text, **extra}
        return {"delta": {"content": text}, **extra}

    def opening(self, text: str) -> bytes:
        if self.route == "completions":
            return self._chunk(self._piece(text, finish_reason=None), parrot=self.parrot)
        return self._chunk({"delta": {"role": "assistant", "content": text}, "finish_reason": None},
                           parrot=self.parrot)

    def piece(self, text: str) -> bytes:
        return self._chunk(self._piece(text, finish_reason=None))

    def closing(self, answer: Answer) -> bytes:
        """The finish reason (and usage, when asked for) from the call's whole answer, then ``[DONE]``."""
        events = self._chunk(self._piece("", finish_reason=answer.finish_reason), parrot=self.parrot)
        if self.include_usage and answer.usage is not None:
            events += sse_event(msgspec.json.encode({**self._base, "choices": [], "usage": answer.usage}))
        return events + SSE_DONE

    @staticmethod
    def failed(exc: Exception) -> bytes:
        return sse_event(error_payload(engine_error_body(exc))) + SSE_DONE

    def cut(self, call_id: str) -> bytes:
        """The stream ends before its call does (the gateway stops): the call goes on (here, on another replica, or
        after the restart) and its output variable gets its value."""
        output = self.parrot.output.id
        return sse_event(error_payload(ErrorBody(
            message=f"the stream was cut (the gateway is stopping); call {call_id} goes on: read its output with "
                    f"GET /v1/vars/{output}?wait=true", type="api_error", code="stream_cut"))) + SSE_DONE
