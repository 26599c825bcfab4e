"""Compat fixtures: a real gateway (uvicorn on loopback) in front of the fake upstream, and openai clients on it."""

from __future__ import annotations

import openai
import pytest

from benchmarks import fake_upstream
from gateway.app import create_app
from gateway.config import BuiltinConfig, GatewayConfig, SemanticConfig, UpstreamConfig

MODEL = "fake-model"


@pytest.fixture(scope="session")
def fake_url(serve_session) -> str:
    return serve_session(fake_upstream.app)


@pytest.fixture(scope="module")
def gateway_url(serve_module, fake_url) -> str:
    """A gateway serving MODEL from the fake upstream (which answers "echo: " + the last user message/prompt)."""
    config = GatewayConfig(upstreams=[UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1")],
                           builtin=BuiltinConfig(enabled=False),
                           semantic=SemanticConfig(input_timeout_s=20, var_timeout_s=10))
    return serve_module(create_app(config))


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=15) as client:
        yield client


@pytest.fixture
async def async_client(gateway_url) -> openai.AsyncOpenAI:
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0,
                                  timeout=15) as client:
        yield client

