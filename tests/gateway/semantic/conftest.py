"""A builtin engine behind a gateway, both real and on loopback, for the semantic tests that watch the engine."""

from __future__ import annotations

from typing import Callable

from tests.support import plain_http
import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.server.app import create_app as create_engine_app
from gateway.server.app import create_app as create_gateway_app
from gateway.config import BuiltinConfig, EnginesConfig, GatewayConfig


@pytest.fixture(scope="module")
def engine_behind_gateway(serve_module) -> Callable[[EngineConfig, str], dict[str, str]]:
    """Starts an engine serving ``model`` with ``config`` and a gateway it registers with; returns
    ``{"gateway": url, "engine": url}``. Both live as long as the test module."""

    def start(config: EngineConfig, model: str) -> dict[str, str]:
        engine = serve_module(create_engine_app(config, model_name=model))
        gateway = serve_module(create_gateway_app(GatewayConfig(
            builtin=BuiltinConfig(enabled=False),
            engines=EnginesConfig(registration_secret="s", heartbeat_timeout_s=600.0))))
        registered = plain_http.post(f"{gateway}/v1/engines", json={"name": model, "url": engine, "models": [model]},
                                headers={"authorization": "Bearer s"})
        assert registered.status_code == 201, registered.text
        return {"gateway": gateway, "engine": engine}

    return start
