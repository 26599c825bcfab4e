"""vllm-router (the vLLM project's Rust router, ``pip install vllm-router``) started by a benchmark itself, in front of
engines the benchmark started: the router people put before a vLLM fleet, as the peer Parrot is compared with.

It runs from its own venv (``python -m venv V && V/bin/pip install vllm-router``; 0.1.17 checked), given by its
``vllm-router`` executable, with ``--policy cache_aware`` by default (its prefix tree over request text, with
load-balance thresholds: what it offers closest to Parrot's placement).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.gateway_overhead import free_port


class LaunchedRouter:
    def __init__(self, executable: str, engine_urls: list[str], log_path: Path, *, policy: str = "cache_aware",
                 ready_timeout_s: float = 120):
        """``engine_urls``: the engines' OpenAI base URLs (``…/v1``); the router is given their roots."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        workers = [url.removesuffix("/v1") for url in engine_urls]
        command = [executable, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                   "--log-level", "warning", "--worker-urls", *workers]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_serving(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm-router did not serve within {timeout_s:.0f}s; see {self.log_path}")

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
