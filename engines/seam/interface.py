"""The engine seam: the one small interface the gateway routes every request through.

An engine takes an OpenAI-shaped request body (already validated by the gateway, ``model``
rewritten to the engine's own model name, the ``parrot`` extension removed) and returns the
response body as JSON bytes, or streams SSE events (``data: {json}\n\n``; one or more whole
events per item, never ``[DONE]``). Bytes rather than Structs keep upstream pass-through free of
re-encoding and keep fields this project does not know about; several events per item let
whatever arrived together leave in one write.

Failures are raised as ``EngineError`` subclasses; the gateway turns them into OpenAI error
objects at one boundary.
"""

from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Literal, Protocol, runtime_checkable

import msgspec

Route = Literal["chat/completions", "completions"]


class EngineError(Exception):
    """Base class of every engine failure; carries the HTTP status the gateway answers with."""

    status_code = 502
    error_type = "upstream_error"
    code: str | None = "upstream_error"

    def __init__(self, message: str, *, status_code: int | None = None, body: bytes | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        if status_code is not None:
            self.status_code = status_code
        self.body = body  # an upstream's own OpenAI error body, passed through when present
        self.retry_after_s = retry_after_s  # how long the engine asked to be left alone (its retry-after)


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused, reset, DNS)."""

    status_code = 502
    code = "upstream_unavailable"


class EngineOverloaded(EngineError):
    """No healthy engine can take the request right now."""

    status_code = 503
    error_type = "service_unavailable"
    code = "no_healthy_engine"


class EngineTimeout(EngineError):
    status_code = 504
    error_type = "timeout"
    code = "upstream_timeout"


class EngineRejected(EngineError):
    """The engine answered with an error status of its own (its body is passed through)."""


# Routing sorts engines by reported load: a negative count would draw every request to its reporter.
Count = Annotated[int, msgspec.Meta(ge=0)]


class EngineStats(msgspec.Struct, kw_only=True):
    """What an engine reports on heartbeat; fields an engine cannot know stay at their defaults."""

    running: Count = 0
    waiting: Count = 0
    blocks_total: Count = 0
    blocks_free: Count = 0
    cached_tokens: Count = 0
    prefix_hit_tokens: Count = 0
    prompt_tokens: Count = 0
    generation_tokens: Count = 0


@runtime_checkable
class Engine(Protocol):
    name: str  # unique within a gateway, e.g. "builtin-0" or "openai"

    async def create(self, route: Route, body: dict[str, Any]) -> bytes:
        """Run one non-streaming request; returns the OpenAI response body."""
        ...

    def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """Run one streaming request; yields whole SSE events (several per item when they arrived
        together). When the engine ends its stream with ``[DONE]``, that event closes the last item,
        with the events that came with it. Closing it cancels the request."""
        ...

    async def health(self) -> bool: ...

    async def stats(self) -> EngineStats: ...

    async def aclose(self) -> None: ...
