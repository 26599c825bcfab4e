"""The exception the OpenAI error boundary (http_plumbing/http_errors.py) answers with its own HTTP status.

Engines' failures (engines/seam/errors.py, ``EngineError``) are its subclasses. It lives here, below the seam, so
that the boundary needs no import of ``engines``: the seam's clients already depend on this package."""

from __future__ import annotations


class StatusError(Exception):
    """A failure that carries the HTTP status, OpenAI error type and code it is answered with, and optionally
    the upstream's own OpenAI error body (passed through) and how long the client should wait before retrying."""

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
