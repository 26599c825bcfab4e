"""Capabilities are found on the engine object (its class), never from a kind string or a URL; what
an engine announces on registration picks the object."""

from __future__ import annotations

import httpx
import pytest

from engines.seam import ContextEngine, Engine, HintedEngine, PrefillEngine, PrioritizedEngine, ResponsesEngine
from engines.seam.builtin_client import BuiltinEngineClient
from engines.seam.connect import CAPABILITIES, capabilities_of, connect, has_capability
from engines.seam.upstream import UpstreamEngine, upstream_class


@pytest.fixture
async def client():
    async with httpx.AsyncClient() as shared:
        yield shared


async def test_an_engine_announcing_every_capability_gets_the_builtin_client(client):
    engine = connect("e", "http://127.0.0.1:9/", client, capabilities=list(CAPABILITIES))
    assert isinstance(engine, BuiltinEngineClient) and engine.base_url == "http://127.0.0.1:9/v1"
    assert capabilities_of(engine) == ["contexts", "scheduling_hints"]
    assert has_capability(engine, ContextEngine) and has_capability(engine, HintedEngine)


@pytest.mark.parametrize("announced", [[], ["scheduling_hints"], ["contexts"]])
async def test_anything_less_is_a_plain_openai_engine(client, announced):
    engine = connect("e", "http://127.0.0.1:9", client, capabilities=announced)
    assert type(engine) is UpstreamEngine and isinstance(engine, Engine)
    assert capabilities_of(engine) == [] and not has_capability(engine, ContextEngine)


@pytest.mark.parametrize("responses", [False, True])
@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("prioritized", [False, True])
async def test_an_upstreams_configuration_gives_its_class_exactly_those_capabilities(client, prioritized, prefill,
                                                                                     responses):
    engine_class = upstream_class(prioritized=prioritized, prefill=prefill, responses=responses)
    engine = engine_class("e", "http://127.0.0.1:9/v1", client)

    assert [has_capability(engine, kind) for kind in (PrioritizedEngine, PrefillEngine, ResponsesEngine)] == [
        prioritized, prefill, responses]
    assert not has_capability(engine, ContextEngine) and not has_capability(engine, HintedEngine)
    assert upstream_class(prioritized=prioritized, prefill=prefill, responses=responses) is engine_class  # one each
