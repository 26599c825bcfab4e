"""What an operator sees of the gateway: time to first token measured at the first generated token (not
the role chunk), request ids forwarded to engines and on every log line (JSON), no line per heartbeat,
and OpenTelemetry spans laying out a semantic DAG."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import TracingConfig, UpstreamConfig
from tests.support.servers import asgi_app, free_port, read_asgi_body
from tests.support.waiting import wait_until
from tests.support import plain_http

SCRIPTED = "scripted-model"
FIRST_TOKEN_DELAY_S = 0.6
NEXT_TOKEN_DELAY_S = 0.2


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    return b"data: " + msgspec.json.encode({"id": "s-1", "object": "chat.completion.chunk", "created": 0,
                                            "model": SCRIPTED, "choices": [choice]}) + b"\n\n"


class ScriptedUpstream:
    """An OpenAI-compatible stream whose role chunk comes at once and whose first token comes late; it keeps
    the x-request-id of each request it was sent."""

    def __init__(self) -> None:
        self.request_ids: list[str | None] = []

    async def __call__(self, scope, receive, send) -> None:
        await read_asgi_body(receive)
        if scope["method"] == "GET":  # the gateway's health check: GET /v1/models
            body = msgspec.json.encode({"object": "list", "data": [{"id": SCRIPTED, "object": "model"}]})
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.request_ids.append(dict(scope["headers"]).get(b"x-request-id", b"").decode() or None)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for delay_s, event in ((0.0, _chunk({"role": "assistant", "content": ""})),
                               (FIRST_TOKEN_DELAY_S, _chunk({"content": "Hello"})),
                               (NEXT_TOKEN_DELAY_S, _chunk({"content": " there"})),
                               (0.0, _chunk({}, "stop") + b"data: [DONE]\n\n")):
            await asyncio.sleep(delay_s)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def histogram(url: str, name: str, labels: dict[str, str]) -> dict[str, float]:
    """A histogram's _count and _sum on a gateway's /metrics, parsed by prometheus_client."""
    found = {}
    for family in text_string_to_metric_families(plain_http.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in (f"{name}_count", f"{name}_sum") and sample.labels == labels:
                found[sample.name.rpartition("_")[2]] = sample.value
    return found


def test_time_to_first_token_is_the_first_generated_token_not_the_role_chunk(serve, start_gateway):
    upstream = ScriptedUpstream()
    upstream_url = serve(asgi_app(upstream))
    url = start_gateway([UpstreamConfig(model=SCRIPTED, base_url=f"{upstream_url}/v1", name="scripted")])

    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", headers={"x-request-id": "ttft-req-1"},
                         json={"model": SCRIPTED, "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
            text = r.read().decode()
        assert "Hello" in text and r.headers["x-request-id"] == "ttft-req-1"
        plain = http.post(f"{url}/v1/chat/completions", json={"model": SCRIPTED, "stream": True,
                                                               "messages": [{"role": "user", "content": "hi"}]})

    labels = {"model_name": SCRIPTED, "engine": "scripted"}
    ttft = histogram(url, "parrot:time_to_first_token_seconds", labels)
    itl = histogram(url, "parrot:inter_token_latency_seconds", labels)
    assert ttft["count"] == 2 and ttft["sum"] >= 2 * FIRST_TOKEN_DELAY_S  # the role chunk came at once
    # One gap per stream, between its two tokens (their sum with the first token's time is at least both delays:
    # the gap alone may look a little shorter, when the first token was read a little late).
    assert itl["count"] == 2 and ttft["sum"] + itl["sum"] >= 2 * (FIRST_TOKEN_DELAY_S + NEXT_TOKEN_DELAY_S)
    assert itl["sum"] > NEXT_TOKEN_DELAY_S  # gaps of the delay, not of back-to-back events
    # The id went on to the engine: the client's own, else the one the gateway made (and answered with).
    assert upstream.request_ids == ["ttft-req-1", plain.headers["x-request-id"]]


def test_dag_state_on_metrics_while_a_map_reduce_runs(start_gateway):
    url = start_gateway()

    def state() -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(plain_http.get(f"{url}/metrics").text)
        return {(s.name, s.labels.get("state", "")): s.value for f in families for s in f.samples
                if s.name in ("parrot:dag_calls", "parrot:variables", "parrot:task_groups", "parrot:sessions")}

    with httpx.Client(base_url=url, timeout=30) as http:
        session = http.post("/v1/sessions").json()["id"]
        parts = [http.post("/v1/vars", json={"session_id": session, "name": f"part{i}"}).json()["id"] for i in range(2)]
        reduce = http.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "{{a}} {{b}}"}],
            "parrot": {"session_id": session, "wait": False, "vars": {"a": {"id": parts[0]}, "b": {"id": parts[1]}}}})
        assert reduce.status_code == 202
        assert state()[("parrot:dag_calls", "pending")] == 1 and state()[("parrot:variables", "")] == 3
        for part in parts:  # the maps: slow on the engine, so they are seen running, as one task group
            http.post("/v1/chat/completions", json={
                "model": "fake-model", "messages": [{"role": "user", "content": "map"}], "fake": {"delay_s": 1.0},
                "parrot": {"session_id": session, "wait": False, "output": {"id": part}}})
        running = wait_until(lambda: (now := state())[("parrot:dag_calls", "running")] == 2 and now)
        assert running[("parrot:dag_calls", "pending")] == 1 and running[("parrot:task_groups", "")] == 1
        wait_until(lambda: state()[("parrot:dag_calls", "running")] + state()[("parrot:dag_calls", "pending")] == 0)
        assert state()[("parrot:task_groups", "")] == 0 and state()[("parrot:sessions", "")] >= 1


# ---------------------------------------------------------------- logs of a real gateway process


ENGINE_SECRET = "observability-gateway-secret"


@pytest.mark.subprocess
def test_gateway_json_log_lines_carry_the_request_id_and_none_is_per_heartbeat(fake_url, tmp_path):
    port = free_port()
    log_path = tmp_path / "gateway.jsonl"
    with log_path.open("w") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.server.cli", "serve", "--no-builtin", "--port", str(port),
             "--log-format", "json", "--access-log", "--upstream", f"fake-model={fake_url}/v1"],
            env={**os.environ, "PARROT_ENGINE_SECRET": ENGINE_SECRET, "PARROT_NUM_RETRIES": "1"},
            stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                wait_until(lambda: gateway.poll() is not None or _answers(http), timeout_s=60)
                assert gateway.poll() is None, log_path.read_text()
                ok = http.post("/v1/chat/completions", headers={"x-request-id": "json-ok-1"},
                               json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
                failed = http.post("/v1/chat/completions", headers={"x-request-id": "json-failed-2"},
                                   json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                                         "fake": {"status": 500}})
                assert (ok.status_code, failed.status_code) == (200, 500)
                engine = http.post("/v1/engines", headers={"authorization": f"Bearer {ENGINE_SECRET}"},
                                   json={"name": "hb", "url": "http://127.0.0.1:9", "models": ["hb-model"]}).json()
                for _ in range(5):
                    beat = http.post(f"/v1/engines/{engine['id']}/heartbeat", json={"running": 0},
                                     headers={"authorization": f"Bearer {engine['token']}"})
                    assert beat.status_code == 200
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]  # all JSON
    by_request = {rid: [r for r in records if r["request_id"] == rid] for rid in ("json-ok-1", "json-failed-2")}
    assert [r["message"].split()[:3] for r in by_request["json-ok-1"]] == [["POST", "/v1/chat/completions", "200"]]
    failed_lines = [(r["logger"], r["level"]) for r in by_request["json-failed-2"]]
    # Both attempts' failures, the error answered, the access line: every line about it carries its id.
    assert failed_lines == [("gateway.attempts", "WARNING")] * 2 + [("parrot.http", "WARNING"), ("parrot.access", "INFO")]
    assert not [r for r in records if "heartbeat" in r["message"]]  # at the default level, with the access log on


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/health/live").status_code == 200
    except httpx.TransportError:
        return False


# ---------------------------------------------------------------- tracing


@pytest.fixture(scope="module")
def spans():
    """The process's tracer provider, exporting to memory (a provider is set once per process)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_a_two_call_dag_makes_one_span_per_call_under_its_submitting_request(spans, start_gateway):
    url = start_gateway(tracing=TracingConfig(enabled=True))
    with httpx.Client(base_url=url, timeout=30) as http:
        session = http.post("/v1/sessions").json()["id"]
        first = http.post("/v1/chat/completions", headers={"x-request-id": "dag-first"}, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "a fact about owls"}],
            "parrot": {"session_id": session, "wait": False, "output": "fact"}})
        assert first.status_code == 202
        fact = first.json()["parrot"]["output"]["id"]
        second = http.post("/v1/chat/completions", headers={"x-request-id": "dag-second"}, json={
            "model": "fake-model", "messages": [{"role": "user", "content": "a poem on {{fact}}"}],
            "parrot": {"session_id": session, "vars": {"fact": {"id": fact}}}})
        assert second.status_code == 200

    def finished() -> dict[str, Any] | None:
        done = spans.get_finished_spans()
        requests = {s.attributes.get("parrot.request_id"): s for s in done if s.kind.name == "SERVER"}
        calls = [s for s in done if s.name.startswith("parrot call")]
        if {"dag-first", "dag-second"} <= requests.keys() and len(calls) == 2:
            return {"requests": requests, "calls": calls}
        return None

    found = wait_until(finished)
    submitted_by = {call.parent.span_id: call for call in found["calls"]}
    first_call = submitted_by[found["requests"]["dag-first"].context.span_id]
    second_call = submitted_by[found["requests"]["dag-second"].context.span_id]
    assert first_call.context.trace_id == found["requests"]["dag-first"].context.trace_id
    assert [link.context.span_id for link in second_call.links] == [first_call.context.span_id]  # its producer
    assert first_call.end_time <= second_call.start_time  # the consumer ran once its input was bound
    for call in (first_call, second_call):  # where its time went, as events of its span
        moments = {event.name: event.timestamp for event in call.events}
        assert {"dispatched", "answered"} <= moments.keys()
        assert call.start_time <= moments["dispatched"] <= moments["answered"] <= call.end_time
    assert found["requests"]["dag-second"].name == "POST /v1/chat/completions"


@pytest.mark.subprocess
def test_without_opentelemetry_tracing_is_off_and_nothing_fails():
    code = """
import sys
sys.modules["opentelemetry"] = None  # as if the tracing extra were not installed: importing it fails
from gateway import tracing
from gateway.server.app import create_app
from gateway.config import GatewayConfig, TracingConfig
assert tracing.trace is None
assert not tracing.Tracing(TracingConfig(enabled=True)).enabled
create_app(GatewayConfig(tracing=TracingConfig(enabled=True)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
