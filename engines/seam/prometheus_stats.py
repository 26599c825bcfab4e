"""An engine's load and KV capacity read from its own Prometheus ``/metrics`` (vLLM, SGLang): a fleet needs no
agent beside it for the scheduler to see how busy each server is.

vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (before
v0.10: ``vllm:gpu_cache_usage_perc``) and ``vllm:cache_config_info`` (labels ``num_gpu_blocks``, ``block_size``);
for the gateway's /metrics also ``vllm:prefix_cache_queries_total``, ``…_hits_total`` and ``vllm:num_preemptions_total``.
SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` and
``sglang:max_total_num_tokens``. A server serving several models reports a sample per model: they are summed.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engines.seam.interface import EngineStats

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)
_PREFIX_HITS = ("vllm:prefix_cache_hits_total",)
_PREEMPTIONS = ("vllm:num_preemptions_total",)
# Without a capacity, the fraction in use is kept over this many notional blocks (of size 0: capacity unknown).
_NOTIONAL_BLOCKS = 10_000


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in samples:
            return sum(value for _, value in samples[name])
    return None


def _capacity(samples: dict[str, list[tuple[dict[str, str], float]]]) -> tuple[int, int]:
    """(blocks, tokens per block) the server's KV cache holds; (0, 0) when it does not say."""
    for labels, _ in samples.get("vllm:cache_config_info", []):
        blocks, block_size = labels.get("num_gpu_blocks"), labels.get("block_size")
        if blocks and block_size and blocks.isdigit() and block_size.isdigit():
            return int(blocks), int(block_size)
    tokens = _total(samples, ("sglang:max_total_num_tokens",))
    return (int(tokens), 1) if tokens else (0, 0)


def stats_from_metrics(text: str) -> EngineStats:
    """The scheduler's view of a vLLM or SGLang server from its ``/metrics`` page; ValueError if it is not
    Prometheus text."""
    samples = _samples(text)
    blocks, block_size = _capacity(samples)
    use = _total(samples, _KV_USE)
    total = blocks or (_NOTIONAL_BLOCKS if use is not None else 0)
    return EngineStats(
        running=int(_total(samples, _RUNNING) or 0),
        waiting=int(_total(samples, _WAITING) or 0),
        blocks_total=total,
        blocks_free=round(total * (1 - min(1.0, max(0.0, use or 0.0)))),
        block_size=block_size,
        prefix_cache_queries=int(_total(samples, _PREFIX_QUERIES) or 0),
        prefix_cache_hits=int(_total(samples, _PREFIX_HITS) or 0),
        num_preemptions=int(_total(samples, _PREEMPTIONS) or 0),
    )
