"""Gateway fixtures: the fake OpenAI upstream and gateways in front of it, each a real uvicorn on loopback."""

from __future__ import annotations

from typing import Any, Callable

import httpx
import pytest

from benchmarks import fake_upstream
from gateway.app import create_app
from gateway.config import BuiltinConfig, GatewayConfig, UpstreamConfig

MODEL = "fake-model"


@pytest.fixture(scope="session")
def fake_url(serve_session) -> str:
    """The fake upstream's root URL (its OpenAI API lives under /v1)."""
    return serve_session(fake_upstream.app)


@pytest.fixture(scope="session")
def http() -> httpx.Client:
    """One client for the session: a new httpx.Client per call would cost an SSL context each time."""
    with httpx.Client(timeout=10) as client:
        yield client


@pytest.fixture
def fake_stats(http, fake_url) -> Callable[[], dict[str, Any]]:
    """Reads the fake upstream's counters and the last request body it received."""
    return lambda: http.get(f"{fake_url}/fake/stats").json()


def gateway_config(upstreams: list[UpstreamConfig], **sections: Any) -> GatewayConfig:
    sections.setdefault("builtin", BuiltinConfig(enabled=False))
    return GatewayConfig(upstreams=upstreams, **sections)


@pytest.fixture
def start_gateway(serve, fake_url) -> Callable[..., str]:
    """``start_gateway(upstreams=None, **sections)`` serves a gateway for this test; returns its root URL.

    Without ``upstreams`` it serves MODEL from the fake upstream.
    """

    def start(upstreams: list[UpstreamConfig] | None = None, **sections: Any) -> str:
        if upstreams is None:
            upstreams = [UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1")]
        return serve(create_app(gateway_config(upstreams, **sections)))

    return start


@pytest.fixture(scope="module")
def gateway_url(serve_module, fake_url) -> str:
    """One gateway shared by a module's tests, serving MODEL from the fake upstream with default limits."""
    return serve_module(create_app(gateway_config([UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1")])))
