"""The engine's load and KV cache as Prometheus text under vLLM's metric names, so that whatever reads a vLLM
fleet (Parrot's gateway in front of it as a plain upstream, routers, dashboards) reads a builtin engine alike."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engines.seam import EngineStats


class _Snapshot:
    """A collector of one stats reading (what prometheus_client renders)."""

    def __init__(self, stats: EngineStats, model: str):
        self.stats, self.model = stats, model

    def collect(self):
        labels = ["model_name"]
        for name, documentation, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", self.stats.running),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", self.stats.waiting),
                ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all).", self.stats.kv_use())):
            family = GaugeMetricFamily(name, documentation, labels=labels)
            family.add_metric([self.model], value)
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(self.stats.block_size), str(self.stats.blocks_total)], 1.0)
        yield info


def metrics_text(stats: EngineStats, model: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, model))
    return generate_latest(registry)
