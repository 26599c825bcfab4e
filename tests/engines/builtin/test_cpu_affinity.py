"""``cpu_cores``: the engine's intra-op threads one to a core, its HTTP server's threads off those cores."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from tests.support import plain_http
import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.cpu_affinity import PROCESS_CORES, parse_cores
from engines.builtin.types import SamplingParams

two_cores = pytest.mark.skipif(len(PROCESS_CORES) < 2 or not Path("/proc/self/task").exists(),
                               reason="needs Linux and two cores available to this process")


def test_cores_parse_from_ranges_and_lists():
    assert parse_cores("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cores("1,0") == (1, 0)
    assert parse_cores("2, 2-3") == (2, 3)
    for bad in ("", "a", "3-1", "1-", "-2", "0,,1"):
        with pytest.raises(ValueError, match="cpu_cores"):
            parse_cores(bad)


def test_config_gives_one_thread_per_core():
    core = min(PROCESS_CORES)
    assert EngineConfig(cpu_cores=str(core)).num_threads == 1
    with pytest.raises(ValueError, match="one thread computes on each core"):
        EngineConfig(cpu_cores=str(core), num_threads=2)
    with pytest.raises(ValueError, match="not available"):
        EngineConfig(cpu_cores=str(max(PROCESS_CORES) + 1000))


def thread_cores(pid: int | str = "self") -> dict[int, set[int]]:
    """Each live thread of a process by its id: the cores it may run on."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = _allowed(task)
        except (OSError, StopIteration):  # the thread ended meanwhile
            continue
    return found


@two_cores
def test_step_thread_and_its_worker_each_get_a_core(make_engine):
    first, second = sorted(PROCESS_CORES)[:2]
    engine = make_engine(cpu_cores=f"{second},{first}")
    engine.generate_batch([[1, 2, 3] * 40], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    step_thread = next(thread for thread in threading.enumerate() if thread.name == "llm-engine-step")
    threads = thread_cores()
    assert [tid for tid, cores in threads.items() if cores == {second}] == [step_thread.native_id]
    on_first = [tid for tid, cores in threads.items() if cores == {first}]
    assert len(on_first) == 1 and on_first != [step_thread.native_id], "one intra-op worker, on the other core"


@pytest.mark.subprocess
@two_cores
@pytest.mark.timeout(120)
def test_engine_process_keeps_its_server_off_the_compute_cores(tiny_model_dir, wait_until):
    compute, other = sorted(PROCESS_CORES)[:2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "engines.builtin.server.cli", "--model", str(tiny_model_dir), "--port", str(port),
               "--served-model-name", "tiny", "--max-model-len", "128", "--num-blocks", "16", "--cpu-cores", str(compute),
               "--log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process.poll() is not None or _healthy(url), timeout_s=90)
        request = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        assert plain_http.post(f"{url}/v1/completions", json=request, timeout=30).status_code == 200
        threads = thread_cores(process.pid)
        assert [cores for cores in threads.values() if cores == {compute}], "the step thread computes on its core"
        server = threads[process.pid]  # the main thread runs the HTTP server's event loop
        assert compute not in server and other in server, "the server's thread stays off the compute core"
    finally:
        process.terminate()
        process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return plain_http.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _allowed(task: Path) -> set[int]:
    line = next(line for line in (task / "status").read_text().splitlines() if line.startswith("Cpus_allowed_list"))
    return set(parse_cores(line.split(":")[1].strip()))
