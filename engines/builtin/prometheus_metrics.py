"""The engine's Prometheus metrics under vLLM's names and meanings, so that whatever reads a vLLM fleet
(Parrot's gateway in front of it as a plain upstream, routers, dashboards) reads a builtin engine alike.

Latencies are histograms the step loop observes as it goes (on its thread: prometheus_client's metrics
take their own locks): time to the first generated token and between tokens, end to end, and in the
queue before the first step. Counts the core keeps anyway (tokens, prefix-cache queries and hits,
preemptions) and its load (running, waiting, KV blocks in use) are read when /metrics is scraped.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engines.seam import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards built for it read these alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
HANDOFF_BUCKETS = (1, 2, 3, 4, 8, 16, 64)


class _Stats:
    """A collector of one stats reading per scrape."""

    def __init__(self, metrics: "EngineMetrics"):
        self.metrics = metrics

    def collect(self):
        stats, model = self.metrics.read_stats(), [self.metrics.model_name]
        for name, documentation, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", stats.running),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all).", stats.kv_use())):
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(model, value)
            yield family
        for name, documentation, value in (
                ("vllm:prompt_tokens", "Prompt tokens submitted.", stats.prompt_tokens),
                ("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache when their request "
                                              "was scheduled.", stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Of those, tokens found there.", stats.prefix_cache_hits),
                ("vllm:num_preemptions", "Running requests preempted (their KV dropped, recomputed later).",
                 stats.num_preemptions),
                ("parrot:num_latency_preemptions", "Of those, latency-critical requests.", stats.latency_preemptions)):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(model, value)
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(stats.block_size), str(stats.blocks_total)], 1.0)
        yield info


class EngineMetrics:
    """One engine core's metrics, in a registry of their own (several cores in one process never collide)."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats]):
        self.read_stats = read_stats
        self.registry = CollectorRegistry(auto_describe=False)
        r, labels = self.registry, ["model_name"]
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time from a request's arrival to its first "
                               "generated token.", labels, buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's successive generated "
                              "tokens.", labels, buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from a request's arrival to its last "
                              "token.", labels, buckets=REQUEST_BUCKETS, registry=r)
        self._queue = Histogram("vllm:request_queue_time_seconds", "Time a request waited before its first step.",
                                labels, buckets=REQUEST_BUCKETS, registry=r)
        self._handoff = Histogram("parrot:handoff_wait_steps", "Engine steps from the last token of the last "
                                  "output a request takes as input (token-id handoff) to its own first token: 1 "
                                  "when it ran in the very next step.", labels, buckets=HANDOFF_BUCKETS, registry=r)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.registry.register(_Stats(self))
        self.name_model(model_name)

    def name_model(self, model_name: str) -> None:
        """The ``model_name`` label (the served name, which the HTTP app may set after the core loaded)."""
        self.model_name = model_name
        self.ttft, self.itl = self._ttft.labels(model_name), self._itl.labels(model_name)
        self.e2e, self.queue_time = self._e2e.labels(model_name), self._queue.labels(model_name)
        self.handoff_wait = self._handoff.labels(model_name)
        self._finished = {reason: self._success.labels(model_name, reason) for reason in ("stop", "length")}

    def finished(self, reason: str) -> Counter:
        return self._finished.get(reason) or self._success.labels(self.model_name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
