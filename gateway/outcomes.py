"""What the gateway records of each request's outcome, per model and engine: latency, tokens (charged to the
key's token quota too), finish reasons, errors, and forks of a shared prefix. The plain request path and the
semantic one record through the same ``Outcomes``, so a forked request is counted as a plain one is."""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

import msgspec

from engines.seam import EngineError, EngineOverloaded
from gateway.metrics import GatewayMetrics, RouteMetrics
from gateway.quotas import count_tokens
from wire.openai import Usage
from wire.usage import UsageOnly, usage_decoder


class _Finished(Protocol):
    @property
    def finish_reason(self) -> str | None: ...


class Reported(Protocol):
    """What a finished answer reports: wire/usage.py's ``UsageOnly`` read off a body, or a whole response Struct."""

    @property
    def usage(self) -> Usage | None: ...

    @property
    def choices(self) -> Sequence[_Finished]: ...


class Outcomes:
    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics

    def succeeded(self, model: str, engine: str, reported: Reported | None, started: float) -> None:
        """A finished non-streamed request on ``engine`` (its name); ``reported``: its answer as read
        (None when it could not be read: no tokens counted)."""
        measured = self.metrics.on(model, engine)
        measured.e2e_latency.observe(time.perf_counter() - started)
        self.count_success(model, self._count_usage(measured, reported))

    def count_success(self, model: str, reasons: list[str]) -> None:
        for reason in reasons or ["stop"]:
            self.metrics.model(model).success(reason).inc()

    def failed(self, model: str, exc: EngineError) -> None:
        self.metrics.model(model).error(exc.status_code).inc()

    def forked(self, model: str, engine: str) -> None:
        """A request ran as a fork of a shared prefix on ``engine`` (its name)."""
        self.metrics.on(model, engine).forks.inc()

    def prefilled(self, model: str, engine: str, *, skipped: bool = False) -> None:
        """A waiting call's prompt was prefilled ahead on ``engine`` (or not: ``skipped``, the engine queueing)."""
        measured = self.metrics.on(model, engine)
        (measured.prefill_skips if skipped else measured.prefills).inc()

    def no_engine(self, model: str, last_error: EngineError | None) -> EngineError:
        """The error of a request no engine answered, counted."""
        if last_error is not None:
            self.failed(model, last_error)
            return last_error
        self.metrics.model(model).error(503).inc()
        return EngineOverloaded(f"no healthy engine serves model {model!r} right now")

    @staticmethod
    def _count_usage(measured: RouteMetrics, reported: Reported | None) -> list[str]:
        """Counts the tokens an answer reports; returns its choices' finish reasons."""
        if reported is None:
            return []
        if reported.usage is not None:
            measured.prompt_tokens.inc(reported.usage.prompt_tokens)
            measured.generation_tokens.inc(reported.usage.completion_tokens)
            count_tokens(reported.usage.prompt_tokens + reported.usage.completion_tokens)  # the key's quota
        return [c.finish_reason for c in reported.choices if c.finish_reason]

    def count_events(self, measured: RouteMetrics, events: bytes,
                     read: Callable[[bytes], Reported | None] | None = None) -> list[str]:
        """Token usage and finish reasons in a run of SSE events (most carry neither: skipped unparsed), each
        marked one read by ``read`` (``read_usage``: a chat or completions chunk's)."""
        marks = [at for at in (events.find(b'"usage"'), events.find(b'"finish_reason":"')) if at >= 0]
        if not marks:
            return []
        reasons: list[str] = []
        start = events.rfind(b"\n\n", 0, min(marks))
        tail = events[start + 2:] if start >= 0 else events  # from the first marked event on
        for event in tail.split(b"\n\n"):
            if event.startswith(b"data: ") and (b'"usage"' in event or b'"finish_reason":"' in event):
                reasons += self._count_usage(measured, (read or read_usage)(event[6:]))
        return reasons


def read_usage(body: bytes) -> UsageOnly | None:
    """A body's usage and finish reasons (wire/usage.py's UsageOnly); None when it is not such a body."""
    try:
        return usage_decoder.decode(body)
    except msgspec.DecodeError:
        return None
