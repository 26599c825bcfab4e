"""Each HTTP request's id, known to everything that runs for it (logs, engine calls, DAG calls it starts)
through a context variable, and its access-log line.

``RequestContext`` wraps an app's ASGI handler (in front of routing, so that 404s carry the id too): it
takes the client's ``x-request-id`` or makes one, sets ``request_id`` for the request's task (tasks it
starts copy it: a semantic call's engine requests log and forward its submitting request's id), adds
the header to the response, and, with the access log on, logs one line when the response has ended.
Being in front of routing, it also gives every response what HTTP asks of all of them: HEAD answered
as GET is (the server sends no body for a HEAD; routes are declared for GET only), and
``x-content-type-options: nosniff`` (a JSON answer echoing a client's text is never run as a page).
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import secrets
import time

from litestar.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
NOSNIFF = (b"x-content-type-options", b"nosniff")
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

access_log = logging.getLogger("parrot.access")

# Paths polled by machines (probes, scrapers, heartbeats): their access lines are DEBUG, not INFO.
_QUIET_SUFFIXES = ("/heartbeat", "/metrics", "/health", "/health/live", "/health/ready")

# Ids only need to be unique, not secret: a random per-process prefix and a counter (urandom per
# request showed in the gateway's CPU profile of a proxied stream).
_PREFIX = secrets.token_hex(8)
_numbers = itertools.count()


def new_request_id() -> str:
    return f"{_PREFIX}{next(_numbers):016x}"


def forwarded_headers() -> list[tuple[bytes, bytes]]:
    """The header that carries the current request's id to an engine (none outside a request)."""
    current = request_id.get()
    return [(REQUEST_ID_HEADER, current.encode())] if current else []


class RequestContext:
    """Wraps an ASGI app: ``app.asgi_handler = RequestContext(app.asgi_handler, access=...)``."""

    def __init__(self, app: ASGIApp, *, access: bool = False):
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "HEAD":  # the server's own scope still says HEAD: it drops the body
            scope = {**scope, "method": "GET"}
        sent = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER), None)
        current = sent.decode("latin-1") if sent else new_request_id()
        request_id.set(current)  # the request's own task: set for it and every task it starts
        header = (REQUEST_ID_HEADER, sent or current.encode())
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # A new list: responses may share theirs.
                message["headers"] = [*message.get("headers", ()), header, NOSNIFF]
            await send(message)

        if not self.access:
            await self.app(scope, receive, send_with_id)
            return
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope["path"]
            level = logging.DEBUG if path.endswith(_QUIET_SUFFIXES) else logging.INFO
            access_log.log(level, "%s %s %d %.1fms", scope["method"], path, status,
                           (time.perf_counter() - started) * 1000)
