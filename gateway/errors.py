"""The gateway's own errors on top of the shared OpenAI error boundary (http_plumbing/http_errors.py)."""

from __future__ import annotations

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


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or is not served here.", param="model",
                    code="model_not_found", error_type="invalid_request_error")


def handle_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc.status_code, exc.body, exc.headers)


def handle_invalid_request(_: Request, exc: InvalidRequest) -> Response:
    return error_response(400, ErrorBody(message=str(exc), type="invalid_request_error", param=exc.param))


def body_error(exc: msgspec.DecodeError | UnicodeDecodeError) -> APIError:
    """A 400 for a request body that is not JSON, or not of the expected shape (``param`` names the field)."""
    message = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"We could not parse the JSON body of your request ({message}). "
                             "The API expects a JSON object.")
    at = message.rsplit("`$.", 1)[1].rstrip("`") if "`$." in message else None
    missing = MISSING_FIELD.search(message)
    param = f"{at}.{missing.group(1)}" if at and missing else at or (missing and missing.group(1))
    return APIError(400, f"body: {message}", param=param)


def handle_validation(request: Request, exc: msgspec.ValidationError) -> Response:
    return handle_api_error(request, body_error(exc))


EXCEPTION_HANDLERS = {
    **OPENAI_EXCEPTION_HANDLERS,
    APIError: handle_api_error,
    InvalidRequest: handle_invalid_request,
    msgspec.ValidationError: handle_validation,
}
