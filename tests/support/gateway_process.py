"""A gateway as its own process (`parrot serve --no-builtin` against an upstream), started, killed and started
again on the same port: what replicas and restarts are made of."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.fake_upstream import MODEL
from tests.support.servers import free_port
from tests.support import plain_http


class GatewayProcess:
    def __init__(self, upstream_url: str, state: str, *, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "gateway.server.cli", "serve", "--no-builtin", "--port", str(self.port),
                        "--upstream", f"{MODEL}={upstream_url}/v1", "--state", state, "--log-level", "warning", *args]
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> "GatewayProcess":
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=out)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if plain_http.get(f"{self.url}/health/live", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway {self.command} did not start (exit {self.process.poll()})")
            time.sleep(0.1)

    def kill(self) -> None:
        """kill -9: nothing of the process's shutdown runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
