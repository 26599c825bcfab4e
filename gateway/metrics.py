"""Prometheus metrics, named as vLLM names them where an equivalent exists (``vllm:`` → ``parrot:``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """One registry per app, so several apps (tests) in one process never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("parrot:num_requests_running", "Requests in flight.", ["model_name"],
                                      registry=r)
        self.request_success = Counter("parrot:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.request_errors = Counter("parrot:request_errors", "Failed requests by HTTP status.",
                                      ["model_name", "status"], registry=r)
        self.prompt_tokens = Counter("parrot:prompt_tokens", "Prompt tokens processed.", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("parrot:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=r)
        self.e2e_latency = Histogram("parrot:e2e_request_latency_seconds", "End-to-end request latency.",
                                     ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("parrot:time_to_first_token_seconds", "Time to the first streamed chunk.",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prefix_hit_tokens = Gauge("parrot:prefix_cache_hit_tokens", "Prompt tokens served from a cached "
                                       "prefix, summed over engines (as reported on heartbeat).", registry=r)
        self.shared_prefix_fork_tokens = Gauge("parrot:shared_prefix_fork_tokens", "Prompt tokens forked from "
                                               "a shared prefix the gateway pinned, instead of recomputed.",
                                               registry=r)
        self.engines_healthy = Gauge("parrot:engines_healthy", "Healthy engines per model.", ["model_name"],
                                     registry=r)

        self._models: dict[str, ModelMetrics] = {}

    def model(self, name: str) -> ModelMetrics:
        """``name``'s labelled children, bound on first use (only served models reach the hot path)."""
        bound = self._models.get(name)
        if bound is None:
            bound = self._models[name] = ModelMetrics(self, name)
        return bound

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's children, bound once: every ``labels()`` call takes a lock and builds a key, and a
    proxied request made eight of them."""

    def __init__(self, metrics: GatewayMetrics, model: str):
        self.requests_running = metrics.requests_running.labels(model)
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.generation_tokens = metrics.generation_tokens.labels(model)
        self.e2e_latency = metrics.e2e_latency.labels(model)
        self.ttft = metrics.ttft.labels(model)
        self._model = model
        self._success_family = metrics.request_success
        self._errors_family = metrics.request_errors
        self._children: dict[tuple[Counter, str], Counter] = {}

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
