"""The seam's errors: every engine failure is one of these, carrying the HTTP status the gateway answers
with. Each process translates them into OpenAI error objects at one boundary (http_plumbing/http_errors.py)."""

from __future__ import annotations

from http_plumbing.status_error import StatusError


class EngineError(StatusError):
    """Base class of every engine failure; carries the HTTP status the gateway answers with (502 unless a kind
    or the constructor says otherwise), an upstream's own error body and its retry-after (StatusError's)."""


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


class EngineRefusedGateway(EngineError):
    """The engine refused the gateway's own credentials (401, 403): the gateway's link to it is broken, not
    the client's request, which the gateway authenticated. A 502 (another engine is tried, the circuit
    counts it); the engine's body, about the gateway's key, is not the client's to see."""

    status_code = 502
    code = "upstream_auth_failed"


def engine_answered(name: str, status_code: int, body: bytes, *, retry_after_s: float | None = None,
                    path: str = "") -> EngineError:
    """The error of an engine's answer with an error status, by whose fault it is."""
    where = f" to {path}" if path else ""
    if status_code in (401, 403):
        return EngineRefusedGateway(f"engine {name!r} refused the gateway's credentials (HTTP {status_code}{where})")
    return EngineRejected(f"engine {name!r} answered HTTP {status_code}{where}", status_code=status_code,
                          body=body, retry_after_s=retry_after_s)
