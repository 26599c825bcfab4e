"""What an operator sees of a builtin engine: vLLM's metrics moving under load, the client's request id on
the engine's log lines (behind a real gateway, in JSON), no log line per heartbeat, and /health following
the step loop (503 when it stalls or its thread dies)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.builtin.config import EngineConfig
from engines.builtin.server.app import GatewayRegistration, create_app as create_engine_app
from gateway.server.app import create_app as create_gateway_app
from gateway.config import BuiltinConfig, EnginesConfig, GatewayConfig
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support.markers import marks_users
from tests.support import plain_http

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.model]
SECRET = "observability-engine-secret"
MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several full KV blocks, shared by every request


def samples(text: str) -> dict[str, float]:
    """Every sample of a /metrics page, parsed by prometheus_client, as {name: value} (label sets summed)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


class EngineProcess:
    """``parrot engine`` on the tiny model, registered with a gateway in this process; its stderr kept."""

    def __init__(self, tiny_model_dir: Path, gateway_url: str, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "gateway.server.cli", "engine", "--model", str(tiny_model_dir), "--port",
                   str(self.port), "--served-model-name", MODEL, "--name", "tiny-engine",
                   # 24 blocks of 16 tokens: two 300-token generations cannot both fit, so one is preempted.
                   "--num-blocks", "24", "--max-model-len", "384", "--max-num-seqs", "2",
                   "--gateway-url", gateway_url, "--heartbeat-interval", "0.1", "--log-format", "json", "--access-log"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_ENGINE_SECRET": SECRET}
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, env=env, stderr=self._log)
        self.http = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {SECRET}"}, timeout=60)

    def metrics(self) -> dict[str, float]:
        return samples(self.http.get("/metrics").text)

    def log_lines(self) -> list[str]:
        self._log.flush()
        return [line for line in self.log_path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        self.http.close()
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="module")
def gateway(serve_module) -> tuple[str, Any]:
    app = create_gateway_app(GatewayConfig(builtin=BuiltinConfig(enabled=False),
                                           engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=30)))
    return serve_module(app), app


@pytest.fixture(scope="module")
@marks_users("subprocess")
def engine_process(tiny_model_dir, gateway, tmp_path_factory) -> Iterator[EngineProcess]:
    gateway_url, _ = gateway
    process = EngineProcess(tiny_model_dir, gateway_url, tmp_path_factory.mktemp("engine-log") / "stderr.jsonl")
    try:
        wait_until(lambda: process.process.poll() is not None or MODEL in plain_http.get(f"{gateway_url}/v1/models").text,
                   timeout_s=120)
        assert process.process.poll() is None, "\n".join(process.log_lines())
        yield process
    finally:
        process.close()


def test_a_scraper_reads_metrics_and_health_without_the_secret_and_nothing_else(engine_process):
    """What `parrot serve` users point Prometheus at: the engine's /metrics and /health answer without the
    per-start secret they never see (they carry no prompt); every other route still wants it."""
    metrics = plain_http.get(f"{engine_process.url}/metrics")
    assert metrics.status_code == 200
    assert "vllm:num_requests_running" in samples(metrics.text)  # parsed by prometheus_client
    assert plain_http.get(f"{engine_process.url}/health").status_code == 200
    for path in ("/v1/stats", "/v1/models"):
        refused = plain_http.get(f"{engine_process.url}{path}")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_engine_secret"


def completion(http: httpx.Client, base: str, max_tokens: int, **extra: Any) -> dict:
    response = http.post(f"{base}/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_metrics_move_under_load_and_parse_with_vllm_names(engine_process, gateway, wait_until):
    before = engine_process.metrics()
    requests = 4  # on 2 seats: two wait; 24 KV blocks for two 300-token sequences: one is preempted
    seen = {"waiting": 0.0, "kv": 0.0}
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        answers = [pool.submit(completion, engine_process.http, engine_process.url, 300) for _ in range(requests)]
        while not all(answer.done() for answer in answers):
            # A poll every 50 ms, not back to back: on 2 cores a tight loop of /metrics requests slowed
            # the engine's steps until a completion ran past the client's 60 s timeout (2 of ~6 full runs).
            time.sleep(0.05)
            now = engine_process.metrics()
            seen["waiting"] = max(seen["waiting"], now["vllm:num_requests_waiting"])
            seen["kv"] = max(seen["kv"], now["vllm:kv_cache_usage_perc"])
        usages = [answer.result()["usage"] for answer in answers]
    after = engine_process.metrics()

    assert seen["waiting"] >= 1 and seen["kv"] > 0.5  # both moved while the work ran
    assert after["vllm:num_requests_waiting"] == after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] < seen["kv"]

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == requests * 300
    assert grew("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert grew(name) == requests, name
    assert grew("vllm:inter_token_latency_seconds_count") == requests * 299  # every token after the first
    assert grew("vllm:request_queue_time_seconds_sum") > 0  # two of them waited for a seat
    assert grew("vllm:request_success_total") == requests
    assert grew("vllm:num_preemptions_total") >= 1
    # The same prompt each time: later requests find its full blocks in the prefix cache.
    assert 0 < grew("vllm:prefix_cache_hits_total") <= grew("vllm:prefix_cache_queries_total")

    # The gateway mirrors what the engine reports on its heartbeats, per engine.
    gateway_url, _ = gateway
    labels = {"model_name": MODEL, "engine": "tiny-engine"}

    def mirrored() -> dict[str, float]:
        families = text_string_to_metric_families(plain_http.get(f"{gateway_url}/metrics").text)
        return {s.name: s.value for f in families for s in f.samples if s.labels == labels}

    wait_until(lambda: mirrored().get("parrot:num_preemptions_total", 0) >= after["vllm:num_preemptions_total"])
    assert mirrored()["parrot:prefix_cache_hits_total"] > 0


def test_the_clients_request_id_is_on_the_engines_json_log_lines(engine_process, gateway, wait_until):
    gateway_url, _ = gateway
    with httpx.Client(timeout=60) as http:
        response = http.post(f"{gateway_url}/v1/chat/completions", headers={"x-request-id": "client-req-42"},
                             json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert response.status_code == 200 and response.headers["x-request-id"] == "client-req-42"
        # A semantic call runs on the engine through the context primitives: its lines carry the id of the
        # request that submitted it.
        dag = http.post(f"{gateway_url}/v1/chat/completions", headers={"x-request-id": "dag-req-7"}, json={
            "model": MODEL, "max_tokens": 4, "parrot": {"vars": {"topic": {"value": "owls"}}},
            "messages": [{"role": "system", "content": "You are a terse assistant that answers in one word. " * 3},
                         {"role": "user", "content": "{{topic}}"}]})
        assert dag.status_code == 200, dag.text

    def lines_of(request_id: str) -> list[dict]:
        return [record for record in map(json.loads, engine_process.log_lines()) if record.get("request_id") == request_id]

    wait_until(lambda: lines_of("dag-req-7"))
    forks = [s.value for f in text_string_to_metric_families(plain_http.get(f"{gateway_url}/metrics").text)
             for s in f.samples if s.name == "parrot:forks_total" and s.labels.get("engine") == "tiny-engine"]
    assert forks == [1.0]  # the semantic call forked its shared system prompt
    chat_lines = lines_of("client-req-42")
    assert [line["message"].split()[:3] for line in chat_lines] == [["POST", "/v1/chat/completions", "200"]]
    assert {line["logger"] for line in chat_lines} == {"parrot.access"}
    assert any("/v1/contexts/" in line["message"] and "/generate" in line["message"] for line in lines_of("dag-req-7"))


def test_every_log_line_is_json_and_none_is_per_heartbeat(engine_process, gateway):
    _, app = gateway
    record = next(r for r in app.state.gateway.registry.records() if r.engine.name == "tiny-engine")
    before = record.last_heartbeat
    threading.Event().wait(0.5)  # five heartbeat intervals
    assert record.last_heartbeat > before  # the engine kept heartbeating meanwhile
    lines = engine_process.log_lines()
    records = [json.loads(line) for line in lines]  # every line: a JSON object
    assert {"time", "level", "logger", "message", "request_id"} <= set(records[0])
    assert not [r for r in records if "heartbeat" in r["message"].lower()]
    assert any(r["message"].startswith("ready in") for r in records)


# ---------------------------------------------------------------- /health follows the step loop


class Fatal(BaseException):
    """Ends the step loop's thread (the loop survives any Exception: this is what a fatal error looks like)."""


@pytest.fixture
def core(tiny_model_dir):
    from engines.builtin.core import EngineCore

    core = EngineCore(EngineConfig(model=str(tiny_model_dir), max_model_len=256, num_blocks=32))
    core.step_stall_timeout_s = 0.2
    core.start()
    yield core
    core.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death, as meant
def test_health_is_503_while_the_step_loop_is_stalled_and_after_it_died(core, serve, wait_until):
    # A gateway that forgets an engine silent for half a second, and the engine registered with it.
    gateway = serve(create_gateway_app(GatewayConfig(builtin=BuiltinConfig(enabled=False), engines=EnginesConfig(
        registration_secret=SECRET, heartbeat_timeout_s=0.5))))
    port = free_port()
    registration = GatewayRegistration(gateway, f"http://127.0.0.1:{port}", "stalling", heartbeat_interval_s=0.05)
    url = serve(create_engine_app(llm=core, model_name=MODEL, registration=registration, secret=SECRET), port=port)
    http = httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {SECRET}"})
    assert http.get("/health").json() == {"status": "ok"}

    def listed() -> bool:
        return "stalling" in plain_http.get(f"{gateway}/v1/engines").text

    wait_until(listed)

    run, release = core.runner.run, threading.Event()

    def hung_run(batch):  # a step that hangs (a stuck kernel, a deadlock) until the test lets it go
        release.wait()
        return run(batch)

    core.runner.run = hung_run
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http.post, "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        stalled = wait_until(lambda: (r := http.get("/health")).status_code == 503 and r.json())
        assert stalled["status"] == "unhealthy" and "no step has ended" in stalled["reason"]
        wait_until(lambda: not listed())  # it stopped heartbeating: the gateway no longer routes there
        release.set()
        assert answer.result().status_code == 200
    wait_until(lambda: http.get("/health").status_code == 200)
    wait_until(listed)  # heartbeating again, it registered anew

    def fatal(batch):
        raise Fatal()

    core.runner.run = fatal
    core.ensure_context("doomed", [1, 2, 3])  # work for the loop, which dies on its step
    dead = wait_until(lambda: (r := http.get("/health")).status_code == 503 and r.json())
    assert dead["reason"] == "the step loop's thread died"
