"""What the gateway's own logic refuses (sessions, variables, calls, quotas, limits), named by kind.

Domain code raises these and knows nothing of HTTP; gateway/errors.py maps each kind to its status and
OpenAI error type in one table. Each carries what the client is told: the message, the field at fault
(``param``), a machine-readable ``code``, and for a 429 when (or whether) to retry.
"""

from __future__ import annotations


class DomainError(Exception):
    error_type: str | None = None  # OpenAI's "type" when not the one usual for the kind's status

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if error_type is not None:
            self.error_type = error_type
        self.retry_after_s = retry_after_s


class Invalid(DomainError):
    """The request cannot be served as asked (a limit it exceeds, a cycle it would close)."""


class NotFound(DomainError):
    """A session or variable that does not exist (or not for this key)."""


class Conflict(DomainError):
    """The state forbids it: a variable already bound, a call whose session was deleted."""


class TooLarge(DomainError):
    """A value larger than its quota allows."""


class QuotaExceeded(DomainError):
    """A count or size quota: waiting does not help, freeing something does."""

    error_type = "insufficient_quota"


class RateLimited(DomainError):
    """Too many requests or tokens per minute, or requests at once: retry after ``retry_after_s``."""


class DependencyFailed(DomainError):
    """A call could not run: a variable it reads failed."""

    error_type = "dependency_failed"


class NotReady(DomainError):
    """A variable was not ready within the wait."""


def model_not_found(model: str) -> NotFound:
    return NotFound(f"The model `{model}` does not exist or is not served here.", param="model",
                    code="model_not_found", error_type="invalid_request_error")
