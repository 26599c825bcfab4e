"""OpenAI-style error responses for litestar apps: the one boundary where exceptions become
``{"error": {"message", "type", "param", "code"}}``. The gateway and the engine server both use it."""

from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from http_plumbing.status_error import StatusError
from wire.openai import ErrorBody, ErrorResponse

log = logging.getLogger("parrot.http")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}
MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def error_payload(body: ErrorBody) -> bytes:
    return msgspec.json.encode(ErrorResponse(error=body))


def error_response(status_code: int, body: ErrorBody, headers: dict[str, str] | None = None) -> Response:
    return Response(content=error_payload(body), status_code=status_code, media_type="application/json",
                    headers=headers)


def engine_error_body(exc: Exception) -> ErrorBody:
    """An upstream's own OpenAI error body when it sent one, else one made from the exception."""
    if not isinstance(exc, StatusError):
        return ErrorBody(message="The server had an internal error.", type="api_error", code="internal_error")
    if exc.body:
        try:
            return msgspec.json.decode(exc.body, type=ErrorResponse).error
        except msgspec.DecodeError:
            pass
    return ErrorBody(message=str(exc), type=exc.error_type, param=getattr(exc, "param", None), code=exc.code)


def handle_engine_error(_: Request, exc: StatusError) -> Response:
    if exc.status_code >= 500:  # with its cause: what the client is not told (an address, a socket error)
        log.warning("engine error: %s%s", exc, f" ({exc.__cause__!r})" if exc.__cause__ else "")
    # An engine's own pause request (a 429's retry-after) reaches the client, whose SDK honours it.
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after is not None else None
    return error_response(exc.status_code, engine_error_body(exc), headers)


def _validation_problem(error: dict) -> tuple[str | None, str]:
    """(param, message) of one litestar validation error; ``data`` is litestar's name for the whole body."""
    key, message = error.get("key"), error.get("message")
    if key in (None, "data"):
        missing = MISSING_FIELD.search(message or "")  # msgspec names a missing field only in its message
        if missing:
            return missing.group(1), f"body: {message}"
        return None, f"body: {'expected a JSON object, got nothing' if message == repr(key) else message}"
    return key, f"{key}: {message}"


def handle_http_exception(_: Request, exc: HTTPException) -> Response:
    message, param = exc.detail, None
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        problems = [_validation_problem(e) if isinstance(e, dict) else (None, str(e)) for e in exc.extra]
        param = problems[0][0]
        message = "; ".join(m for _, m in problems)
    error_type = ERROR_TYPES.get(exc.status_code, "api_error" if exc.status_code >= 500 else "invalid_request_error")
    return error_response(exc.status_code, ErrorBody(message=message, type=error_type, param=param), exc.headers)


def handle_recursion(request: Request, exc: RecursionError) -> Response:
    """msgspec gives up on JSON nested deeper than Python's recursion limit: the client's mistake."""
    if "deserializing" not in str(exc):
        return handle_unexpected(request, exc)
    return error_response(400, ErrorBody(message="We could not parse the JSON body of your request: it is "
                                                 "nested too deeply.", type="invalid_request_error"))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(500, ErrorBody(message="The server had an internal error.", type="api_error",
                                         code="internal_error"))


OPENAI_EXCEPTION_HANDLERS = {
    StatusError: handle_engine_error,  # engines.seam.EngineError and its kinds
    HTTPException: handle_http_exception,
    RecursionError: handle_recursion,
    Exception: handle_unexpected,
}
