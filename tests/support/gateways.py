"""Gateway configurations for tests: upstreams only, the builtin engine off unless a test turns it on."""

from __future__ import annotations

import tempfile
from typing import Any

from gateway.config import BuiltinConfig, FilesConfig, GatewayConfig, UpstreamConfig
from tests.support.fake_upstream import MODEL


def gateway_config(upstreams: list[UpstreamConfig], **sections: Any) -> GatewayConfig:
    sections.setdefault("builtin", BuiltinConfig(enabled=False))
    # Files and batches in a directory of their own (never the user's ~/.local/share/parrot/files).
    sections.setdefault("files", FilesConfig(dir=tempfile.mkdtemp(prefix="parrot-files-")))
    return GatewayConfig(upstreams=upstreams, **sections)


def fake_gateway_config(fake_url: str, **sections: Any) -> GatewayConfig:
    """A gateway serving MODEL from the fake upstream at ``fake_url``."""
    return gateway_config([UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1")], **sections)
