"""Gateway configurations for tests: upstreams only, the builtin engine off unless a test turns it on."""

from __future__ import annotations

from typing import Any

from gateway.config import BuiltinConfig, GatewayConfig, UpstreamConfig
from tests.support.fake_upstream import MODEL


def gateway_config(upstreams: list[UpstreamConfig], **sections: Any) -> GatewayConfig:
    sections.setdefault("builtin", BuiltinConfig(enabled=False))
    return GatewayConfig(upstreams=upstreams, **sections)


def fake_gateway_config(fake_url: str, **sections: Any) -> GatewayConfig:
    """A gateway serving MODEL from the fake upstream at ``fake_url``."""
    return gateway_config([UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1")], **sections)
