"""The one error of the wire formats: a request that is well-typed but inconsistent."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that is well-typed but inconsistent; becomes a 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
