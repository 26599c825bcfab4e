"""Compat fixtures: a real gateway (uvicorn on loopback) in front of the fake upstream (the root conftest's
``fake_url``), and openai clients on it."""

from __future__ import annotations

import openai
import pytest

from gateway.server.app import create_app
from gateway.config import SemanticConfig
from tests.support.gateways import fake_gateway_config


@pytest.fixture(scope="module")
def gateway_url(serve_module, fake_url) -> str:
    """A gateway serving MODEL from the fake upstream (which answers "echo: " + the last user message/prompt)."""
    return serve_module(create_app(fake_gateway_config(
        fake_url, semantic=SemanticConfig(input_timeout_s=20, var_timeout_s=10))))


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=15) as client:
        yield client


@pytest.fixture
async def async_client(gateway_url) -> openai.AsyncOpenAI:
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0,
                                  timeout=15) as client:
        yield client

