"""Optional OpenTelemetry tracing: a span per HTTP request and one per semantic call, the call's parent
being the request that submitted it, so that a trace viewer lays out an app's DAG on a time line and its
critical path shows (a call's span also links to the spans of the calls that produced its inputs).

Off unless configured (``[tracing]``, or the standard ``OTEL_*`` variables) and the ``tracing`` extra is
installed; off, nothing here runs per request, and without OpenTelemetry installed nothing is imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, ContextManager, Iterator, Mapping, Protocol

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import TracingConfig
from http_plumbing.request_context import request_id

try:
    from opentelemetry import propagate, trace
except ImportError:  # the tracing extra is not installed: tracing stays off
    trace = None


class _Identified(Protocol):
    @property
    def id(self) -> str: ...


class _Input(Protocol):
    @property
    def producer(self) -> TracedCall | None: ...  # the call whose output binds it, if any


class TracedCall(Protocol):
    """What a semantic call's span reads of the call (gateway/semantic/graph.py's Call), and where it leaves
    its own span's context for the calls that read its outputs."""

    span_context: Any
    timings: Any  # graph.CallTimings: its moments, each an event of its span

    @property
    def id(self) -> str: ...

    @property
    def session(self) -> _Identified: ...

    @property
    def inputs(self) -> Mapping[str, _Input]: ...

    @property
    def latency_critical(self) -> bool: ...

    @property
    def group(self) -> str | None: ...


log = logging.getLogger(__name__)
_NOT_TRACED = ("/v1/engines",)
_OFF = contextlib.nullcontext()  # heartbeats and registrations: machine chatter, not application work


def _exporter_named(env: Mapping[str, str]) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return (bool(exporter) and exporter != "none") or bool(endpoint)


def _provider_set() -> bool:
    """Whether the process already has a tracer provider (set by the application, a test, or
    ``opentelemetry-instrument``): then spans go wherever it sends them."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def _wanted(config: TracingConfig, env: Mapping[str, str]) -> bool:
    if trace is None or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if config.enabled is not None:
        return config.enabled
    return config.exporter is not None or _exporter_named(env) or _provider_set()


def _new_provider(config: TracingConfig, env: Mapping[str, str]) -> Any:
    """A tracer provider exporting in batches to the configured exporter."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    kind = config.exporter or env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip().lower() or "otlp"
    if kind == "console":
        exporter = ConsoleSpanExporter()
    elif kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("tracing exporter 'otlp' needs the package opentelemetry-exporter-otlp-proto-http"
                               ) from exc
        exporter = OTLPSpanExporter()  # its endpoint, headers and timeout from the OTEL_EXPORTER_OTLP_* variables
    else:
        raise RuntimeError(f"tracing exporter {kind!r} is not supported here: use otlp or console")
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or config.service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class Tracing:
    """The gateway's tracer, or none. ``wrap(app)`` adds request spans; ``call(call)`` is a call's span."""

    def __init__(self, config: TracingConfig, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.tracer = None
        self._own_provider = None
        if not _wanted(config, env):
            return
        if _provider_set():
            provider = trace.get_tracer_provider()
        else:
            try:
                provider = self._own_provider = _new_provider(config, env)
            except ImportError:  # the API without the SDK: nothing to export with
                log.warning("tracing is on but opentelemetry-sdk is not installed: no spans")
                return
        self.tracer = provider.get_tracer("parrot.gateway")

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """``app`` with a server span around each request (continuing the client's ``traceparent``)."""
        return app if self.tracer is None else _RequestSpans(app, self.tracer)

    def call(self, call: TracedCall) -> ContextManager[None]:
        """A semantic call's span, from its inputs being ready to its outputs being bound (nothing when off).
        Its parent is the current span: the request that submitted the call (its task copied that request's
        context). It links to the spans of the calls whose outputs it read (ended before it started)."""
        return _OFF if self.tracer is None else self._call_span(call)

    @contextlib.contextmanager
    def _call_span(self, call: TracedCall) -> Iterator[None]:
        producers = [v.producer for v in call.inputs.values() if v.producer is not None]
        links = [trace.Link(p.span_context) for p in producers if p.span_context is not None]
        attributes = {"parrot.call_id": call.id, "parrot.session_id": call.session.id,
                      "parrot.latency_critical": call.latency_critical}
        if call.group is not None:
            attributes["parrot.task_group"] = call.group
        with self.tracer.start_as_current_span(f"parrot call {call.id}", links=links, attributes=attributes) as span:
            call.span_context = span.get_span_context()
            yield
            for moment in ("warmed", "dispatched", "first_token", "answered"):  # where its time went
                at = getattr(call.timings, moment)
                if at is not None:
                    span.add_event(moment, timestamp=int(at * 1e9))

    def shutdown(self) -> None:
        """Flushes and stops the provider this gateway made (one set by the process is the process's)."""
        if self._own_provider is not None:
            self._own_provider.shutdown()


class _RequestSpans:
    def __init__(self, app: ASGIApp, tracer: Any):
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(_NOT_TRACED):
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with self.tracer.start_as_current_span(
                f"{scope['method']} {scope['path']}", context=propagate.extract(carrier), kind=trace.SpanKind.SERVER,
                attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                            "parrot.request_id": request_id.get() or ""}) as span:
            try:
                await self.app(scope, receive, send_status)
            finally:
                template = scope.get("path_template")
                if template:
                    span.update_name(f"{scope['method']} {template}")
                    span.set_attribute("http.route", template)
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
