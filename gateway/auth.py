"""API-key identity: who a request is (its owner: a hash of the key it presents), whether that key may see
every key's sessions (``[auth] admin_keys``), and the guard that admits only configured client keys.

Sessions, variables, calls and quotas all belong to an owner; everything that asks a request who it is asks here."""

from __future__ import annotations

import hashlib
from typing import Callable

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from gateway.config import AuthConfig
from gateway.errors import APIError

Guard = Callable[[ASGIConnection, BaseRouteHandler], None]


def owner_of(api_key: str | None) -> str:
    """The owner an API key stands for (no key at all is one owner too)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()


def presented_key(connection: ASGIConnection) -> str:
    """The credential of an ``Authorization: Bearer ...`` header ("" without one)."""
    scheme, _, credential = connection.headers.get("authorization", "").partition(" ")
    return credential.strip() if scheme.lower() == "bearer" else ""


def client_key(connection: ASGIConnection) -> str:
    """A client's key: ``Authorization: Bearer KEY``, else Anthropic's ``x-api-key: KEY`` ("" without either)."""
    return presented_key(connection) or connection.headers.get("x-api-key", "").strip()


def owner(connection: ASGIConnection) -> str:
    """Sessions belong to the bearer key that made them, on an open gateway (no configured keys) too:
    there the key authenticates nobody, but clients that present different keys (the openai SDK always
    sends one) expect not to see each other's sessions. Requests without a key share one owner."""
    return owner_of(client_key(connection))


def admin_owners(config: AuthConfig) -> frozenset[str]:
    """The owners of ``[auth] admin_keys`` (the app keeps them in its state as ``admin_owners``)."""
    return frozenset(owner_of(key) for key in config.admin_keys)


def is_admin(connection: ASGIConnection) -> bool:
    """Whether the presented key is one of ``[auth] admin_keys``: it may view every key's sessions."""
    return owner(connection) in connection.app.state.admin_owners


def api_key_guard(config: AuthConfig) -> Guard | None:
    """The guard that admits only the configured client keys (None: no ``api_keys``, an open gateway). A guard,
    as guards also run for plain ASGI handlers, unlike before_request hooks; routes with ``exclude_from_auth``
    in their ``opt`` pass without a key."""
    api_keys = frozenset(config.api_keys)
    if not api_keys:  # admin keys are client keys too; they alone do not turn authentication on
        return None
    api_keys |= frozenset(config.admin_keys)

    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        if handler.opt.get("exclude_from_auth"):
            return
        key = client_key(connection)
        if not key:
            raise APIError(401, "You didn't provide an API key. Pass it as 'Authorization: Bearer KEY' "
                                "(or 'x-api-key: KEY').", code="invalid_api_key")
        if key not in api_keys:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return guard
