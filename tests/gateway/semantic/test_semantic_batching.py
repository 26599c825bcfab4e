"""Performance criteria reach the builtin engine's batches. The engine gives latency-critical work a
batch of one (``latency_max_num_seqs=1``): plain requests (someone reads each as it streams) run one
at a time, while the maps of a map-reduce, a task group the gateway knows its reduce waits for as a
whole, run together as throughput work. Real gateway and engine (a tiny random Llama) on loopback."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engines.builtin.config import EngineConfig

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

MODEL = "tiny"
MAPS = 3
SAMPLING = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def urls(tiny_model_dir, engine_behind_gateway) -> dict[str, str]:
    return engine_behind_gateway(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, latency_max_num_seqs=1), MODEL)


class BatchWatch:
    """Samples the engine's running and waiting counts while a workload runs."""

    def __init__(self, engine_url: str):
        self.engine_url = engine_url
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def _watch(self) -> None:
        with httpx.Client(base_url=self.engine_url, timeout=10) as client:
            while not self._stop.is_set():
                stats = client.get("/v1/stats").json()
                self.samples.append((stats["running"], stats["waiting"]))
                time.sleep(0.005)

    def __enter__(self) -> "BatchWatch":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def most_running(self) -> int:
        return max((running for running, _ in self.samples), default=0)

    @property
    def most_waiting(self) -> int:
        return max((waiting for _, waiting in self.samples), default=0)


def completion(prompt: str, **extra) -> dict:
    # Prompts too short to pin a shared prefix: the engine runs generations only, no prefix fills.
    return {"model": MODEL, "prompt": prompt, **SAMPLING, **extra}


@pytest.mark.timeout(120)
def test_plain_requests_are_latency_critical_and_run_one_at_a_time(urls):
    with httpx.Client(base_url=urls["gateway"], timeout=60) as gw, BatchWatch(urls["engine"]) as watch:
        with ThreadPoolExecutor(MAPS) as pool:
            answers = list(pool.map(lambda i: gw.post("/v1/completions", json=completion(f"Tell me about {i}.")),
                                    range(MAPS)))
    assert all(answer.status_code == 200 for answer in answers)
    assert watch.most_running == 1
    assert watch.most_waiting >= 1  # they did overlap: the others queued behind the one running


@pytest.mark.timeout(120)
def test_the_maps_of_a_map_reduce_run_as_one_batch_though_their_reduce_is_urgent(urls):
    with httpx.Client(base_url=urls["gateway"], timeout=60) as gw, BatchWatch(urls["engine"]) as watch:
        session = gw.post("/v1/sessions").json()["id"]
        summaries = [gw.post("/v1/vars", json={"session_id": session, "name": f"s{i}"}).json()["id"]
                     for i in range(MAPS)]
        # The reduce comes first, latency-critical: each map is urgent from the start, and still batched.
        reduce = gw.post("/v1/completions", json=completion(
            "Combine: " + " ".join(f"{{{{s{i}}}}}" for i in range(MAPS)),
            parrot={"session_id": session, "wait": False, "output": "final", "criteria": "latency",
                    "vars": {f"s{i}": {"id": var} for i, var in enumerate(summaries)}}))
        assert reduce.status_code == 202, reduce.text
        final = reduce.json()["parrot"]["output"]["id"]
        for i, var in enumerate(summaries):
            queued = gw.post("/v1/completions", json=completion(
                "Summarize: {{part}}", parrot={"session_id": session, "wait": False, "output": {"id": var},
                                               "vars": {"part": {"value": f"part {i} of the report"}}}))
            assert queued.status_code == 202, queued.text
        result = gw.get(f"/v1/vars/{final}", params={"wait": "true", "timeout": 60}).json()
        gw.delete(f"/v1/sessions/{session}")
    assert result["ready"] and result["error"] is None
    assert watch.most_running == MAPS
