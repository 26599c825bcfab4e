"""vllm-router (the vLLM project's Rust router, ``pip install vllm-router``) started by a benchmark itself, in front of
engines the benchmark started: the router people put before a vLLM fleet, as the peer Parrot is compared with.

It runs from its own venv (``python -m venv V && V/bin/pip install vllm-router``; 0.1.17 checked), given by its
``vllm-router`` executable, with ``--policy cache_aware`` by default (its prefix tree over request text, with
load-balance thresholds: what it offers closest to Parrot's placement).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.gateway_overhead import free_port
from benchmarks.vllm_server import launch, stop_group


class LaunchedRouter:
    def __init__(self, executable: str, engine_urls: list[str], log_path: Path, *, policy: str = "cache_aware",
                 ready_timeout_s: float = 120):
        """``engine_urls``: the engines' OpenAI base URLs (``…/v1``); the router is given their roots."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        workers = [url.removesuffix("/v1") for url in engine_urls]
        command = [executable, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                   "--log-level", "warning", "--worker-urls", *workers]
        self.log_path = log_path
        self.process = launch(command, log_path, self.url, "vllm-router", ready_timeout_s, poll_s=1)

    def close(self) -> None:
        stop_group(self.process, 10)
