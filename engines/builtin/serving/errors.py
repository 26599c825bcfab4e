"""The engine process's one error boundary: the core's domain errors (engines/builtin/errors.py) and
the wire's InvalidRequest become the seam's errors, each with its HTTP status; the HTTP app answers them
through http_plumbing/http_errors.py."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator


from engines.seam import EngineError
from engines.builtin.errors import ContextBusy, ContextNotFound, PromptTooLong
from wire.errors import InvalidRequest
from engines.builtin.serving.choices import Piece


class EngineBadRequest(EngineError):
    """The request cannot be served as asked (bad field, prompt longer than the context window)."""

    status_code = 400
    error_type = "invalid_request_error"
    code = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(EngineBadRequest):
    """A prompt, or a prompt and the tokens asked for, past the longest sequence this engine can ever hold: the
    model's context, or what its KV cache holds of one sequence (engines/builtin/kv_capacity.py). OpenAI's code."""

    code = "context_length_exceeded"


class EngineNotFound(EngineError):
    """A context id the engine does not hold."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "context_not_found"
    param = "context_id"


class EngineConflict(EngineError):
    """The context is busy with another fill or generation."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "context_busy"
    param = "context_id"


class InputUnavailable(EngineError):
    """An output a request takes as input was not produced: its generation failed or was aborted. The
    gateway then runs the request the ordinary way, from its input's text, or reports the failure."""

    status_code = 424
    error_type = "invalid_request_error"
    code = "input_unavailable"
    param = "parts"


class OutputTaken(EngineError):
    """An ``output_id`` already names another generation's output (produced, or being produced)."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "output_id_taken"
    param = "output_id"


async def translated(pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """``pieces`` with the core's errors as this layer's, closed however the caller stops."""
    try:
        async with aclosing(pieces):
            async for piece in pieces:
                yield piece
    except Exception as exc:
        raise translate(exc) from exc


def translate(exc: Exception) -> Exception:
    """The core's exceptions as the seam's ``EngineError``s; anything else unchanged (a KeyError raised
    by a bug is not turned into a polite 404: only the core's own ContextNotFound is)."""
    if isinstance(exc, ContextNotFound):
        return EngineNotFound(f"context {exc.args[0] if exc.args else ''!s} not found")
    if isinstance(exc, ContextBusy):
        return EngineConflict(str(exc))
    if isinstance(exc, InvalidRequest):
        return EngineBadRequest(str(exc), exc.param)
    if isinstance(exc, PromptTooLong):
        return ContextLengthExceeded(str(exc))
    if isinstance(exc, ValueError) and not isinstance(exc, EngineError):
        return EngineBadRequest(str(exc))  # a value the core cannot take (the request's, as it was checked)
    return exc
