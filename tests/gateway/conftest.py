"""Gateway fixtures: gateways in front of the fake OpenAI upstream (the root conftest's ``fake_url``), each a real
uvicorn on loopback."""

from __future__ import annotations

from typing import Any, Callable

import httpx
import pytest

from gateway.server.app import create_app
from gateway.config import UpstreamConfig
from tests.support.gateways import fake_gateway_config, gateway_config


@pytest.fixture(scope="session")
def http() -> httpx.Client:
    """One client for the session: a new httpx.Client per call would cost an SSL context each time."""
    with httpx.Client(timeout=10) as client:
        yield client


@pytest.fixture
def fake_stats(http, fake_url) -> Callable[[], dict[str, Any]]:
    """Reads the fake upstream's counters and the last request body it received."""
    return lambda: http.get(f"{fake_url}/fake/stats").json()


@pytest.fixture
def start_gateway(serve, fake_url) -> Callable[..., str]:
    """``start_gateway(upstreams=None, **sections)`` serves a gateway for this test; returns its root URL.

    Without ``upstreams`` it serves MODEL from the fake upstream.
    """

    def start(upstreams: list[UpstreamConfig] | None = None, **sections: Any) -> str:
        if upstreams is None:
            return serve(create_app(fake_gateway_config(fake_url, **sections)))
        return serve(create_app(gateway_config(upstreams, **sections)))

    return start


@pytest.fixture(scope="module")
def gateway_url(serve_module, fake_url) -> str:
    """One gateway shared by a module's tests, serving MODEL from the fake upstream with default limits."""
    return serve_module(create_app(fake_gateway_config(fake_url)))

