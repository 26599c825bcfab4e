"""A client that hangs up mid-stream must not leave the upstream generating for nobody."""

from __future__ import annotations

import httpx
import openai
import pytest
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve

LONG_STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "talk"}], "stream": True,
               "fake": {"words": 400, "chunk_delay_s": 0.02}}  # about 8 s if nobody hangs up


def in_flight(http: httpx.Client, gateway_url: str) -> int:
    return sum(e["in_flight"] for e in http.get(f"{gateway_url}/v1/engines").json())


def test_closing_the_response_closes_the_upstream_stream(http, gateway_url, fake_stats, wait_until):
    before = fake_stats()["streams_cancelled"]

    with http.stream("POST", f"{gateway_url}/v1/chat/completions", json=LONG_STREAM, timeout=10) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert in_flight(http, gateway_url) == 1
    assert len(received) == 3  # three events, each followed by its blank separator line

    wait_until(lambda: fake_stats()["streams_cancelled"] > before, timeout_s=5)
    wait_until(lambda: in_flight(http, gateway_url) == 0, timeout_s=5)


async def test_async_sdk_closing_a_stream_closes_the_upstream_stream(http, gateway_url, fake_stats, wait_until):
    before = fake_stats()["streams_cancelled"]

    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=LONG_STREAM["messages"], stream=True,
                                                      extra_body={"fake": LONG_STREAM["fake"]})
        async for chunk in stream:
            if chunk.choices[0].delta.content == " w2":
                break
        await stream.close()

    wait_until(lambda: fake_stats()["streams_cancelled"] > before, timeout_s=5)
    wait_until(lambda: in_flight(http, gateway_url) == 0, timeout_s=5)


def test_client_leaving_during_a_long_wait_for_the_first_chunk_abandons_the_upstream_request(
        http, gateway_url, fake_stats, wait_until):
    """A long prefill: the gateway notices the hang-up itself, not when the first token arrives (5 s)."""
    before = fake_stats()["requests_abandoned"]
    slow_start = {**LONG_STREAM, "fake": {**LONG_STREAM["fake"], "delay_s": 5}}

    with pytest.raises(httpx.ReadTimeout):
        http.post(f"{gateway_url}/v1/chat/completions", json=slow_start, timeout=0.3)

    wait_until(lambda: fake_stats()["requests_abandoned"] > before, timeout_s=3)
    assert in_flight(http, gateway_url) == 0


def test_client_leaving_while_the_engine_is_silent_releases_it_at_once(http, gateway_url, wait_until):
    """No event is due for 5 s: the gateway must notice the hang-up itself, not at the next event.
    (The fake upstream itself only notices when it next writes, so the gateway's count is checked.)"""
    stalled = {**LONG_STREAM, "fake": {"words": 4, "chunk_delay_s": 5.0}}

    with http.stream("POST", f"{gateway_url}/v1/chat/completions", json=stalled, timeout=10) as response:
        lines = response.iter_lines()  # kept: closing this iterator would close the connection
        first = next(line for line in lines if line.startswith("data:"))
        assert '"role":"assistant"' in first
        assert in_flight(http, gateway_url) == 1
    wait_until(lambda: in_flight(http, gateway_url) == 0, timeout_s=2)


def test_client_leaving_a_non_streaming_request_abandons_the_upstream_request(http, gateway_url, fake_stats,
                                                                              wait_until):
    before = fake_stats()["requests_abandoned"]
    slow = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "fake": {"delay_s": 5}}

    with pytest.raises(httpx.ReadTimeout):
        http.post(f"{gateway_url}/v1/chat/completions", json=slow, timeout=0.3)

    wait_until(lambda: fake_stats()["requests_abandoned"] > before, timeout_s=3)
    assert in_flight(http, gateway_url) == 0
