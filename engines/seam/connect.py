"""From what an engine announces to the object the gateway talks to it through."""

from __future__ import annotations

import httpx

from engines.seam.builtin_client import BuiltinEngineClient
from engines.seam.interface import ContextEngine, Engine, HintedEngine
from engines.seam.upstream import UpstreamEngine

# What an engine may announce on registration; the builtin engine announces both.
CAPABILITIES = ("contexts", "scheduling_hints")


def connect(name: str, url: str, client: httpx.AsyncClient, *, capabilities: list[str], api_key: str | None = None,
            transport: httpx.AsyncBaseTransport | None = None) -> Engine:
    """An engine at ``url`` (its base URL, without /v1) with the announced ``capabilities``: the builtin
    engine's client when it has them all, a plain OpenAI-compatible one otherwise."""
    engine_class = BuiltinEngineClient if set(CAPABILITIES) <= set(capabilities) else UpstreamEngine
    return engine_class(name, f"{url.rstrip('/')}/v1", client, api_key=api_key, transport=transport)


_FOUND: dict[tuple[type, type], bool] = {}


def has_capability(engine: Engine, capability: type) -> bool:
    """``isinstance(engine, capability)``, once per engine class: a capability is its class's (an
    ``isinstance`` against a Protocol inspects every member, too slow for each proxied request)."""
    key = (type(engine), capability)
    found = _FOUND.get(key)
    if found is None:
        found = _FOUND[key] = isinstance(engine, capability)
    return found


def capabilities_of(engine: Engine) -> list[str]:
    """The names of the capabilities an engine object has (by its class, never by a name or URL)."""
    found = {"contexts": has_capability(engine, ContextEngine), "scheduling_hints": has_capability(engine, HintedEngine)}
    return [name for name in CAPABILITIES if found[name]]
