"""Server-sent events out of the gateway: litestar's ``Stream``, with a cheaper disconnect watch.

litestar's streaming response runs every body in an anyio task group beside a task that waits for
the client to disconnect. Setting those up was a sizeable share of the gateway's CPU for a proxied stream.
Here the body is sent from the request's own task under ``CancelledOnDisconnect``, whose watch
cancels that task if the client leaves, which closes the engine's stream at once (the iterator's
``finally`` runs) even while no event is due."""

from __future__ import annotations

import itertools
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from litestar import Response

from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send

from http_plumbing.disconnect import CancelledOnDisconnect
from wire.sse import SSE_DONE


async def send_events(events: AsyncIterator[bytes], send: Send, receive: Receive) -> None:
    """Sends SSE ``events`` as the body of a started response, up to ``[DONE]`` or the iterator's end.
    Nothing after ``[DONE]`` is sent, but the iterator still runs to its end (its accounting, the
    engine connection's drain) unless the client disconnects, which stops it early."""
    try:
        async with CancelledOnDisconnect(receive):
            done = False
            async for chunk in events:
                if done:
                    continue
                # ``[DONE]`` ends the body in the same write as the last chunk's framing: one syscall less.
                done = chunk.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": not done})
            if not done:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class _EventStreamBody(ASGIStreamingResponse):
    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        await send_events(self.iterator, send, receive)


class EventStream(Stream):
    """``Stream`` of SSE bytes (an async iterator) whose body is sent by ``_EventStreamBody``; the body
    ends at a ``data: [DONE]`` event (nothing after it is sent) or with the iterator."""

    def to_asgi_response(self, app: Any, request: Any, *, background=None, cookies=None, encoded_headers=None,
                         headers=None, is_head_response: bool = False, media_type=None, status_code=None,
                         type_encoders=None) -> ASGIStreamingResponse:
        return _EventStreamBody(
            background=self.background or background,
            content_length=0,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=is_head_response,
            iterator=self.iterator,
            media_type=self.media_type or media_type,
            status_code=self.status_code or status_code,
        )


async def after_first(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first`` (read ahead, so that failures before it were still the request's status), then ``rest``,
    which is closed with this iterator."""
    try:
        yield first
        async for events in rest:
            yield events
    finally:
        await rest.aclose()


async def streamed_or_whole(receive: Receive, events: AsyncIterator[bytes] | None,
                            whole: Callable[[], Awaitable[Any]]) -> Response:
    """A translated API's answer: ``events`` as a stream once its first event is read (failures before it are the
    request's status), else ``whole()`` encoded as JSON (or as it is, when it is an HTTP response already: a
    semantic request's 202), the engine's work cancelled if the client leaves first."""
    if events is not None:
        events = events.__aiter__()
        first = await anext(events)
        return EventStream(after_first(first, events), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    answer = None
    async with CancelledOnDisconnect(receive):
        answer = await whole()
    if isinstance(answer, Response):
        return answer
    return Response(msgspec.json.encode(answer) if answer is not None else b"", media_type="application/json")
