"""POST /v1/chat/completions and /v1/completions: the proxied hot path, as plain ASGI route handlers.

Every other route is a typed litestar handler. These two were as well, but litestar's per-request
machinery (signature model, kwargs extraction, the response object and its ASGI twin) was a large share of
the gateway's CPU for a proxied stream (docs/architecture.md, "Measurements behind design choices"), and on a
small box a gateway's added latency is mostly its CPU per request. They still decode the body into the same
msgspec Structs and raise the same exceptions, which the app's exception handlers answer as OpenAI errors; the
app's guards (auth) and ``before_send`` hooks (x-request-id) apply to them like to every route.
"""

from __future__ import annotations

import msgspec
from litestar import Request, asgi
from litestar.exceptions import MethodNotAllowedException
from litestar.handlers import ASGIRouteHandler
from litestar.types import Message, Receive, Scope, Send

from engines.seam import Route
from http_plumbing.disconnect import CancelledOnDisconnect
from gateway.auth import owner
from gateway.errors import APIError, body_error
from gateway.quotas import Quotas
from gateway.service import (ENGINE_HEADER, REQUEST_SCHEMAS, Gateway, OpenAIRequest, events_with_service_tier,
                             hints_of, placement_of, with_service_tier)
from gateway.streaming import send_events


_ALLOW = b"OPTIONS, POST"
_ENGINE = ENGINE_HEADER.encode()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes.")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; a 413 as soon as it is known to be larger than ``limit`` bytes."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    pieces, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "The client disconnected before the request body was complete.")
        pieces.append(message.get("body", b""))
        size += len(pieces[-1])
        if size > limit:
            raise _too_large(limit)
        if not message.get("more_body"):
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _start(content_type: bytes, *extra: tuple[bytes, bytes]) -> Message:
    return {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type), *extra]}


async def _serve(route: Route, data: OpenAIRequest, body: dict, scope: Scope, receive: Receive, send: Send) -> None:
    state = scope["litestar_app"].state
    state.gateway.check(data)
    quotas: Quotas = state.quotas
    if not quotas.enabled:  # no rate or concurrency quotas: nothing to count on the hot path
        await _respond(route, data, body, scope, receive, send)
        return
    # Charged when no usage is reported (a stream without include_usage); a semantic request's usage
    # is reported by its call, which may outlive this response.
    estimate = 0 if data.parrot is not None else state.gateway.max_request_tokens(data) or 0
    async with quotas.admitted(owner(Request(scope, receive)), estimate):  # a seat until the response has ended
        await _respond(route, data, body, scope, receive, send)


async def _respond(route: Route, data: OpenAIRequest, body: dict, scope: Scope, receive: Receive, send: Send
                   ) -> None:
    """``body``: the client's body as sent (unknown fields kept for the engine), less Parrot's extension."""
    state = scope["litestar_app"].state
    gateway: Gateway = state.gateway
    if data.parrot is not None:
        request = Request(scope, receive)
        response = await state.semantic.serve(route, data.parrot, body, owner(request), data.stream)
        await response.to_asgi_response(None, request)(scope, receive, send)
    elif not data.stream:
        answer = None
        async with CancelledOnDisconnect(receive):  # a client that leaves cancels the engine's work
            placement = placement_of(body)
            answer = await gateway.create(route, data.model, body, hints_of(placement), placement)
        if answer is None:
            return
        content = with_service_tier(answer.body, body)
        await send(_start(b"application/json", (b"content-length", str(len(content)).encode()),
                          (_ENGINE, answer.engine_id.encode())))
        await send({"type": "http.response.body", "body": content})
    else:
        opened = None
        async with CancelledOnDisconnect(receive):  # a client that leaves during a long prefill, too
            placement = placement_of(body)
            opened = await gateway.open_stream(route, data.model, body, hints_of(placement), placement)
        if opened is None:
            return
        await send(_start(b"text/event-stream", (b"cache-control", b"no-cache"),
                          (_ENGINE, opened.record.id.encode())))
        events = gateway.sse_events(data.model, opened)
        if isinstance(body.get("service_tier"), str):
            events = events_with_service_tier(events, body)
        await send_events(events, send, receive)


def parse(raw: bytes, schema: type[OpenAIRequest]) -> tuple[OpenAIRequest, dict]:
    """The body decoded once: as a dict (forwarded with the fields this gateway does not know) and
    validated into its Struct from that dict (as fast as decoding twice, without the second parse)."""
    try:
        body = msgspec.json.decode(raw)
        data = msgspec.convert(body, schema)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # not JSON, invalid UTF-8, or the wrong shape
        raise body_error(exc, raw) from None
    body.pop("parrot", None)
    return data, body


def openai_endpoint(path: str, route: Route) -> ASGIRouteHandler:
    schema = REQUEST_SCHEMAS[route]

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", _ALLOW)]})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["method"] != "POST":
            raise MethodNotAllowedException(f"{scope['method']} is not allowed on {path}; use POST",
                                            headers={"allow": _ALLOW.decode()})
        raw = await read_body(scope, receive, scope["litestar_app"].state.gateway.config.limits.max_body_bytes)
        data, body = parse(raw, schema)
        await _serve(route, data, body, scope, receive, send)

    endpoint.__name__ = route.replace("/", "_")
    return asgi(path, copy_scope=False)(endpoint)


chat_completions = openai_endpoint("/v1/chat/completions", "chat/completions")
completions = openai_endpoint("/v1/completions", "completions")
