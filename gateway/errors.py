"""The gateway process's one error boundary: HTTP-level errors (APIError: auth, body too large), the
domain's errors (gateway/domain_errors.py, by one table of statuses), the wire's InvalidRequest and the
engines' errors, all answered as OpenAI error objects through http_plumbing/http_errors.py."""

from __future__ import annotations

import re

import msgspec
from litestar import Request, Response

from http_plumbing.http_errors import (
    ERROR_TYPES,
    MISSING_FIELD,
    OPENAI_EXCEPTION_HANDLERS,
    engine_error_body,
    error_payload,
    error_response,
)
from gateway.domain_errors import (
    Conflict,
    DependencyFailed,
    DomainError,
    Invalid,
    NotFound,
    NotReady,
    QuotaExceeded,
    RateLimited,
    TooLarge,
    model_not_found,
)
from gateway.state.store import StoreUnavailable
from wire.openai import ErrorBody
from wire.errors import InvalidRequest

__all__ = ["APIError", "EXCEPTION_HANDLERS", "body_error", "engine_error_body", "error_payload", "model_not_found"]


class APIError(Exception):
    """An error the gateway answers with directly (not an engine failure)."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers  # e.g. retry-after on a 429
        self.body = ErrorBody(message=message, type=error_type or ERROR_TYPES.get(status_code, "api_error"),
                              param=param, code=code)


def handle_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc.status_code, exc.body, exc.headers)


# The one table of the gateway's domain errors: their HTTP status.
DOMAIN_STATUS: dict[type[DomainError], int] = {
    Invalid: 400, NotFound: 404, Conflict: 409, TooLarge: 413, QuotaExceeded: 429, RateLimited: 429,
    DependencyFailed: 424, NotReady: 504,
}


def domain_status(exc: DomainError) -> int:
    return next(DOMAIN_STATUS[kind] for kind in type(exc).__mro__ if kind in DOMAIN_STATUS)


def domain_error_body(exc: DomainError) -> ErrorBody:
    return ErrorBody(message=exc.message, type=exc.error_type or ERROR_TYPES.get(domain_status(exc), "api_error"),
                     param=exc.param, code=exc.code)


def handle_domain_error(_: Request, exc: DomainError) -> Response:
    headers = {}
    if exc.retry_after_s is not None:
        headers["retry-after"] = str(exc.retry_after_s)
    if isinstance(exc, QuotaExceeded):
        headers["x-should-retry"] = "false"  # the openai SDK retries a 429 unless told not to
    return error_response(domain_status(exc), domain_error_body(exc), headers or None)


def handle_store_unavailable(_: Request, exc: StoreUnavailable) -> Response:
    """The state store is away: a 503 the client may retry (nothing it asked for was acknowledged)."""
    return error_response(503, ErrorBody(message=exc.message, type="api_error", code=exc.code),
                          {"retry-after": str(exc.retry_after_s)})


def handle_invalid_request(_: Request, exc: InvalidRequest) -> Response:
    return error_response(400, ErrorBody(message=str(exc), type="invalid_request_error", param=exc.param))


# A \\uD800-\\uDBFF escape not followed by a \\uDC00-\\uDFFF one, or one of those alone: no Unicode character.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def body_error(exc: msgspec.DecodeError | UnicodeDecodeError, raw: bytes = b"") -> APIError:
    """A 400 for a request body (``raw``) that is not JSON, or not of the expected shape (``param`` names
    the field)."""
    message = str(exc)
    if message == "Input data was truncated" and (lone := _LONE_SURROGATE.search(raw)):
        # msgspec's words for a lone surrogate escape, which the body's end has nothing to do with
        message = f"a string holds {lone.group().decode()}, half of a surrogate pair: not a Unicode character"
    if not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"We could not parse the JSON body of your request ({message}). "
                             "The API expects a JSON object.")
    return APIError(400, f"body: {message}", param=invalid_field(exc))


def invalid_field(exc: msgspec.ValidationError) -> str | None:
    """The dotted path of the field a validation error is about (a missing one's included), if it names one."""
    message = str(exc)
    at = message.rsplit("`$.", 1)[1].rstrip("`") if "`$." in message else None
    missing = MISSING_FIELD.search(message)
    return f"{at}.{missing.group(1)}" if at and missing else at or (missing and missing.group(1))


def handle_validation(request: Request, exc: msgspec.ValidationError) -> Response:
    return handle_api_error(request, body_error(exc))


EXCEPTION_HANDLERS = {
    **OPENAI_EXCEPTION_HANDLERS,
    APIError: handle_api_error,
    DomainError: handle_domain_error,
    InvalidRequest: handle_invalid_request,
    StoreUnavailable: handle_store_unavailable,
    msgspec.ValidationError: handle_validation,
}
