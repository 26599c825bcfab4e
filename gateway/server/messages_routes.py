"""Anthropic's Messages API: POST /v1/messages (plain or streamed) and POST /v1/messages/count_tokens. Thin: the
service (gateway/messages/service.py) decodes the body (errors name the block at fault); every error these
routes answer is Anthropic's error object, the same statuses as the OpenAI routes answer."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.auth import owner
from gateway.errors import EXCEPTION_HANDLERS
from gateway.messages.service import MessagesService
from gateway.streaming import streamed_or_whole
from wire.anthropic import AnthropicErrorDetail, AnthropicError, TokenCount

JSON = "application/json"
# Anthropic's error types by status (its "overloaded_error" is a 529 there; here the gateway's 503 keeps its status).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}


def anthropic_error(request: Request, exc: Exception) -> Response:
    """The error the gateway answers on its OpenAI routes (gateway/errors.py), in Anthropic's shape."""
    handler = next(EXCEPTION_HANDLERS[kind] for kind in type(exc).__mro__ if kind in EXCEPTION_HANDLERS)
    answered = handler(request, exc)
    error = msgspec.json.decode(answered.content).get("error") or {}
    message = error.get("message") or "error"
    if error.get("param"):
        message = f"{error['param']}: {message}" if not message.startswith(error["param"]) else message
    kind = ERROR_TYPES.get(answered.status_code, "api_error" if answered.status_code >= 500 else "invalid_request_error")
    body = AnthropicError(error=AnthropicErrorDetail(type=kind, message=message))
    return Response(msgspec.json.encode(body), status_code=answered.status_code, media_type=JSON,
                    headers=dict(answered.headers))


ANTHROPIC_ERRORS: dict[Any, Any] = {kind: anthropic_error for kind in EXCEPTION_HANDLERS}


@post("/v1/messages", status_code=200, exception_handlers=ANTHROPIC_ERRORS)
async def create_message(request: Request, state: State) -> Response:
    service: MessagesService = state.messages
    prepared = service.prepare(await request.body(), owner(request))
    return await streamed_or_whole(request.receive, service.stream(prepared) if prepared.request.stream else None,
                                   lambda: service.create(prepared))


@post("/v1/messages/count_tokens", status_code=200, exception_handlers=ANTHROPIC_ERRORS)
async def count_message_tokens(request: Request, state: State) -> TokenCount:
    return await state.messages.count_tokens(await request.body(), owner(request))


MESSAGES_ROUTES = [create_message, count_message_tokens]
