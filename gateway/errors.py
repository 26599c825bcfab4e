"""OpenAI-style error objects, and the exception handlers that produce every error response."""

from __future__ import annotations

import logging

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from engines.base import EngineError
from engines.protocol import ErrorBody, ErrorResponse, InvalidRequest

log = logging.getLogger("parrot.gateway")

_TYPES = {
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


class APIError(Exception):
    """An error the gateway answers with directly (not an engine failure)."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.body = ErrorBody(message=message, type=error_type or _TYPES.get(status_code, "api_error"),
                              param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or is not served here.", param="model",
                    code="model_not_found", error_type="invalid_request_error")


def error_payload(body: ErrorBody) -> bytes:
    return msgspec.json.encode(ErrorResponse(error=body))


def _respond(status_code: int, body: ErrorBody) -> Response:
    return Response(content=error_payload(body), status_code=status_code, media_type="application/json")


def engine_error_body(exc: EngineError) -> ErrorBody:
    """An engine's own OpenAI error body when it sent one, else ours."""
    if exc.body:
        try:
            return msgspec.json.decode(exc.body, type=ErrorResponse).error
        except msgspec.DecodeError:
            pass
    return ErrorBody(message=str(exc), type=exc.error_type, code=exc.code)


def handle_api_error(_: Request, exc: APIError) -> Response:
    return _respond(exc.status_code, exc.body)


def handle_engine_error(_: Request, exc: EngineError) -> Response:
    log.warning("engine error: %s", exc)
    return _respond(exc.status_code, engine_error_body(exc))


def handle_invalid_request(_: Request, exc: InvalidRequest) -> Response:
    return _respond(400, ErrorBody(message=str(exc), type="invalid_request_error", param=exc.param))


def handle_validation(_: Request, exc: msgspec.ValidationError) -> Response:
    message = str(exc)
    param = message.rsplit("`$.", 1)[1].rstrip("`") if "`$." in message else None
    return _respond(400, ErrorBody(message=message, type="invalid_request_error", param=param))


def _validation_problem(error: dict) -> tuple[str | None, str]:
    """(param, message) of one litestar validation error; ``data`` is the handler's name for the whole body."""
    key = error.get("key")
    if key in (None, "data"):
        message = error.get("message")
        return None, f"body: {'expected a JSON object, got nothing' if message == repr(key) else message}"
    return key, f"{key}: {error.get('message')}"


def handle_http_exception(_: Request, exc: HTTPException) -> Response:
    message, param = exc.detail, None
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        problems = [_validation_problem(e) if isinstance(e, dict) else (None, str(e)) for e in exc.extra]
        param = problems[0][0]
        message = "; ".join(m for _, m in problems)
    return _respond(exc.status_code, ErrorBody(message=message, type=_TYPES.get(exc.status_code, "api_error"),
                                               param=param))


def handle_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unexpected error", exc_info=exc)
    return _respond(500, ErrorBody(message="The server had an internal error.", type="api_error",
                                   code="internal_error"))


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    EngineError: handle_engine_error,
    InvalidRequest: handle_invalid_request,
    msgspec.ValidationError: handle_validation,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
