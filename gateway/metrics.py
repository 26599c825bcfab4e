"""Prometheus metrics, named as vLLM names them where an equivalent exists (``vllm:`` → ``parrot:``), with
an ``engine`` label (the engine's name) where a request or a count belongs to one engine; and Parrot's own
(semantic calls, variables, task groups, forks).

Measured here, per model and engine: requests in flight, tokens (as the engines report them in usage),
end-to-end latency, time to the first generated token and between tokens of a stream, and the time a
request spent in the gateway before the engine that answered it was sent it (routing, retries,
backoff). Mirrored from what each engine reports (heartbeats, or its own /metrics), at scrape time:
requests waiting, KV-cache use, prefix-cache queries and hits, preemptions.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, Sized

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from gateway.registry import EngineRecord


# What the metrics read of the semantic layer (gateway/semantic/: graph.py's Session and Call, holdings.py's
# Holdings), which sits above this module.


class CallState(Protocol):
    @property
    def started(self) -> float | None: ...  # None while pending (waiting for its inputs)

    @property
    def group(self) -> str | None: ...  # its task group, if any


class SessionState(Protocol):
    @property
    def variables(self) -> Sized: ...

    @property
    def calls(self) -> Mapping[str, CallState]: ...


class HeldState(Protocol):
    """What a key holds between requests."""

    @property
    def pinned_tokens(self) -> int: ...

    @property
    def refused_pins(self) -> int: ...


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# A streamed event that carries generated text: a content, text or reasoning delta that is not empty (a
# Responses stream's text and arguments deltas are "delta" strings), or a tool call. (A chat stream's first
# event, the role with empty content, carries none.)
_TOKEN = re.compile(rb'"(?:content|text|reasoning_content|delta)": ?"(?!")|"tool_calls": ?\[')


def carries_token(events: bytes) -> bool:
    return _TOKEN.search(events) is not None


class GatewayMetrics:
    """One registry per app, so several apps (tests) in one process never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, per_engine = self.registry, ["model_name", "engine"]
        self.requests_running = Gauge("parrot:num_requests_running", "Requests in flight on an engine.", per_engine,
                                      registry=r)
        self.request_success = Counter("parrot:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.request_errors = Counter("parrot:request_errors", "Failed requests by HTTP status.",
                                      ["model_name", "status"], registry=r)
        self.prompt_tokens = Counter("parrot:prompt_tokens", "Prompt tokens processed.", per_engine, registry=r)
        self.generation_tokens = Counter("parrot:generation_tokens", "Tokens generated.", per_engine, registry=r)
        self.e2e_latency = Histogram("parrot:e2e_request_latency_seconds", "End-to-end request latency.",
                                     per_engine, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("parrot:time_to_first_token_seconds", "Time from a streamed request's arrival to "
                              "its first generated token.", per_engine, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("parrot:inter_token_latency_seconds", "Time between a stream's successive events "
                             "carrying generated tokens.", per_engine, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("parrot:request_queue_time_seconds", "Time from a request's arrival to its "
                                    "dispatch to the engine that answered it (routing, retries, backoff).",
                                    per_engine, buckets=_LATENCY_BUCKETS, registry=r)
        self.forks = Counter("parrot:forks", "Requests run as a fork of a shared prefix pinned on the engine.",
                             per_engine, registry=r)
        self.prefills = Counter("parrot:prefill_ahead", "Prefill-only requests that warmed an upstream's prefix cache "
                                "with a waiting call's prompt.", per_engine, registry=r)
        self.prefill_skips = Counter("parrot:prefill_ahead_skipped", "Waiting calls not prefilled ahead: their "
                                     "engine was saturated (its queue, or its KV cache full).", per_engine, registry=r)
        self.prefix_hit_tokens = Gauge("parrot:prefix_cache_hit_tokens", "Prompt tokens served from a cached "
                                       "prefix, summed over engines (as reported on heartbeat).", registry=r)
        self.shared_prefix_fork_tokens = Gauge("parrot:shared_prefix_fork_tokens", "Prompt tokens forked from "
                                               "a shared prefix the gateway pinned, instead of recomputed.",
                                               registry=r)
        self.engines_healthy = Gauge("parrot:engines_healthy", "Healthy engines per model.", ["model_name"],
                                     registry=r)
        self.state_write_latency = Histogram("parrot:state_write_seconds", "Time one batch of writes took to reach "
                                             "the state store (one round trip).", buckets=_LATENCY_BUCKETS, registry=r)

        self._models: dict[str, ModelMetrics] = {}

    def model(self, name: str) -> ModelMetrics:
        """``name``'s labelled children, bound on first use (only served models reach the hot path)."""
        bound = self._models.get(name)
        if bound is None:
            bound = self._models[name] = ModelMetrics(self, name)
        return bound

    def on(self, model: str, engine: str) -> "RouteMetrics":
        return self.model(model).on(engine)

    def mirror(self, engines: Callable[[], Iterable[EngineRecord]], sessions: Callable[[], Iterable[SessionState]],
               holdings: Callable[[], Iterable[HeldState]] = list) -> None:
        """Reads, at each scrape, what ``engines()`` report, the state of the semantic graphs of ``sessions()``
        and what keys hold between requests (``holdings()``)."""
        self.registry.register(_EngineReports(engines))
        self.registry.register(_SemanticState(sessions, holdings))

    def mirror_store(self, errors: Callable[[], int], pending: Callable[[], int]) -> None:
        """Reads, at each scrape, the state store's failed operations and the writes waiting for it."""
        self.registry.register(_StateStore(errors, pending))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's children, bound once: every ``labels()`` call takes a lock and builds a key, and a
    proxied request made eight of them."""

    def __init__(self, metrics: GatewayMetrics, model: str):
        self._metrics = metrics
        self._model = model
        self._success_family = metrics.request_success
        self._errors_family = metrics.request_errors
        self._children: dict[tuple[Counter, str], Counter] = {}
        self._engines: dict[str, RouteMetrics] = {}

    def on(self, engine: str) -> "RouteMetrics":
        """The children of this model on ``engine`` (its name)."""
        bound = self._engines.get(engine)
        if bound is None:
            bound = self._engines[engine] = RouteMetrics(self._metrics, self._model, engine)
        return bound

    def success(self, reason: str) -> Counter:
        return self._child(self._success_family, reason)

    def error(self, status: int) -> Counter:
        return self._child(self._errors_family, str(status))

    def _child(self, family: Counter, label: str) -> Counter:
        key = (family, label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(self._model, label)
        return child


class RouteMetrics:
    """One model's children on one engine."""

    __slots__ = ("requests_running", "prompt_tokens", "generation_tokens", "e2e_latency", "ttft", "itl",
                 "queue_time", "forks", "prefills", "prefill_skips")

    def __init__(self, metrics: GatewayMetrics, model: str, engine: str):
        for name in self.__slots__:
            setattr(self, name, getattr(metrics, name).labels(model, engine))


def _family(kind: type, name: str, documentation: str, values: dict[tuple[str, str], float]):
    family = kind(name, documentation, labels=["model_name", "engine"])
    for labels, value in values.items():
        family.add_metric(list(labels), value)
    return family


class _EngineReports:
    """What each engine reported last (heartbeat, or its own /metrics), under vLLM's names."""

    def __init__(self, engines: Callable[[], Iterable[EngineRecord]]):
        self._engines = engines

    def collect(self):
        # By name: an engine restarted under its old name while its old record lingers reports once, as its newest.
        latest = {(",".join(r.models), r.engine.name): r.stats for r in self._engines()}
        for kind, name, documentation, read in (
                (GaugeMetricFamily, "parrot:num_requests_waiting", "Requests waiting in the engine's queue.",
                 lambda s: s.waiting),
                (GaugeMetricFamily, "parrot:kv_cache_usage_perc", "Fraction of the engine's KV cache in use (1 = all).",
                 lambda s: s.kv_use()),
                (CounterMetricFamily, "parrot:prefix_cache_queries", "Prompt tokens the engine looked up in its "
                 "prefix cache.", lambda s: s.prefix_cache_queries),
                (CounterMetricFamily, "parrot:prefix_cache_hits", "Of those, tokens it found there.",
                 lambda s: s.prefix_cache_hits),
                (CounterMetricFamily, "parrot:num_preemptions", "Requests the engine preempted.",
                 lambda s: s.num_preemptions)):
            yield _family(kind, name, documentation, {labels: read(stats) for labels, stats in latest.items()})


class _StateStore:
    def __init__(self, errors: Callable[[], int], pending: Callable[[], int]):
        self._errors, self._pending = errors, pending

    def collect(self):
        yield CounterMetricFamily("parrot:state_errors", "State store operations that failed (unreachable, timed "
                                  "out): each a 503, or a batch of writes retried.", value=self._errors())
        yield GaugeMetricFamily("parrot:state_writes_pending", "Changes not yet written to the state store.",
                                value=self._pending())


class _SemanticState:
    """The semantic graphs now: calls pending (waiting for inputs) and running, variables, task groups."""

    def __init__(self, sessions: Callable[[], Iterable[SessionState]], holdings: Callable[[], Iterable[HeldState]]):
        self._sessions = sessions
        self._holdings = holdings

    def collect(self):
        pending = running = variables = sessions = 0
        groups: set[str] = set()
        for session in self._sessions():
            sessions += 1
            variables += len(session.variables)
            for call in list(session.calls.values()):
                if call.started is not None:
                    running += 1
                else:
                    pending += 1
                if call.group is not None:
                    groups.add(call.group)
        calls = GaugeMetricFamily("parrot:dag_calls", "Semantic calls in the graphs: pending (waiting for inputs) "
                                  "or running.", labels=["state"])
        calls.add_metric(["pending"], pending)
        calls.add_metric(["running"], running)
        yield calls
        yield GaugeMetricFamily("parrot:variables", "Semantic variables alive.", value=variables)
        yield GaugeMetricFamily("parrot:task_groups", "Task groups with a member running now.", value=len(groups))
        yield GaugeMetricFamily("parrot:sessions", "Open sessions (API keys' default sessions included).",
                                value=sessions)
        held = self._holdings()
        yield GaugeMetricFamily("parrot:pinned_prefix_tokens", "Prompt tokens of shared prefixes held on engines "
                                "ahead of waiting calls, summed over keys (each key's quota: pinned_prefix_tokens).",
                                value=sum(h.pinned_tokens for h in held))
        yield CounterMetricFamily("parrot:prefix_pins_refused", "Shared prefixes a waiting call could not hold "
                                  "ahead, its key at its pinned_prefix_tokens quota (filled when the call runs).",
                                  value=sum(h.refused_pins for h in held))
