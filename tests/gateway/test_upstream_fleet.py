"""A fleet of vLLM-style upstreams: the gateway reads each one's load from its own /metrics and places work by
it, and sends criteria as the `priority` of a server run with priority scheduling."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engines.seam.prometheus_stats import stats_from_metrics
from gateway.config import RoutingConfig, UpstreamConfig
from tests.support.servers import asgi_app, read_asgi_body

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"}} 1.0
"""


class FakeVLLM:
    """An OpenAI chat endpoint that names itself in its answers, with a /metrics page of given load."""

    def __init__(self, name: str, running: int = 0, waiting: int = 0, kv: float = 0.0):
        self.name, self.running, self.waiting, self.kv = name, running, waiting, kv
        self.bodies: list[dict[str, Any]] = []
        self.app = asgi_app(self.handle)

    async def handle(self, scope, receive, send) -> None:
        path = scope["path"]
        if path == "/metrics":
            text = VLLM_METRICS.format(running=self.running, waiting=self.waiting, kv=self.kv)
            await self._send(send, text.encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            await self._send(send, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode())
        else:
            self.bodies.append(json.loads(await read_asgi_body(receive)))
            answer = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": self.name}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            await self._send(send, json.dumps(answer).encode())

    @staticmethod
    async def _send(send, body: bytes, content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})


def chat(http, gateway: str, content: str = "Hi") -> Any:
    return http.post(f"{gateway}/v1/chat/completions",
                     json={"model": "m", "messages": [{"role": "user", "content": content}]})


def test_the_metrics_of_vllm_and_sglang_are_read_into_engine_stats():
    vllm = stats_from_metrics(VLLM_METRICS.format(running=3, waiting=5, kv=0.25))
    assert (vllm.running, vllm.waiting, vllm.kv_capacity_tokens(), vllm.kv_use()) == (3, 5, 2048 * 16, 0.25)
    sglang = stats_from_metrics('sglang:num_running_reqs{model_name="m"} 2\nsglang:num_queue_reqs{model_name="m"} 7\n'
                                'sglang:token_usage{model_name="m"} 0.5\nsglang:max_total_num_tokens{model_name="m"} 16000\n')
    assert (sglang.running, sglang.waiting, sglang.kv_capacity_tokens(), sglang.kv_use()) == (2, 7, 16000, 0.5)
    with pytest.raises(ValueError):
        stats_from_metrics("this is { not prometheus")


def test_load_read_from_metrics_steers_requests_to_the_idle_server(http, serve, start_gateway, wait_until):
    busy, idle = FakeVLLM("busy", running=16, waiting=40, kv=0.9), FakeVLLM("idle")
    upstreams = [UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1", name=server.name)
                 for server in (busy, idle)]
    gateway = start_gateway(upstreams, routing=RoutingConfig(health_check_interval_s=0.1))

    def busy_seen() -> bool:
        listed = {e["name"]: e for e in http.get(f"{gateway}/v1/engines").json()}
        return listed["busy"]["stats"]["waiting"] == 40 and listed["busy"]["load"] == 56

    wait_until(busy_seen)
    answers = {chat(http, gateway, f"question {i}").json()["choices"][0]["message"]["content"] for i in range(6)}
    assert answers == {"idle"}

    busy.running = busy.waiting = 0  # drained: both are used again
    idle.running = 30
    wait_until(lambda: {e["name"]: e["load"] for e in http.get(f"{gateway}/v1/engines").json()}["idle"] == 30)
    assert chat(http, gateway).json()["choices"][0]["message"]["content"] == "busy"


def test_criteria_travel_as_the_priority_of_a_server_with_priority_scheduling(http, serve, start_gateway):
    server = FakeVLLM("vllm")
    gateway = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(server.app)}/v1",
                                            priority_scheduling="lower_first")])
    assert chat(http, gateway).status_code == 200
    assert server.bodies[-1]["priority"] == 0  # a plain request is latency work: first in vLLM's order
    throughput = http.post(f"{gateway}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "Summarise {{doc}}"}],
        "parrot": {"criteria": "throughput", "vars": {"doc": {"value": "a long report"}}}})
    assert throughput.status_code == 200, throughput.text
    assert server.bodies[-1]["priority"] == 1  # a semantic call marked throughput: after latency work
    assert server.bodies[-1]["messages"][0]["content"] == "Summarise a long report"

    plain = FakeVLLM("plain")
    gateway = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(plain.app)}/v1")])
    assert chat(http, gateway).status_code == 200
    assert "priority" not in plain.bodies[-1]  # a server without priority scheduling would refuse the field
