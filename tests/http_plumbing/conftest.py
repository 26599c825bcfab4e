"""Fixtures of the HTTP plumbing tests: the fake OpenAI upstream on loopback."""

from __future__ import annotations

import pytest

from benchmarks import fake_upstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def upstream(serve_module) -> str:
    return serve_module(fake_upstream.app)
