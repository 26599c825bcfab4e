"""This engine's place at a Parrot gateway: registration, heartbeats with its stats, leaving on shutdown."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import httpx
import msgspec

from engines.seam.connect import CAPABILITIES

if TYPE_CHECKING:
    from engines.builtin.serving import BuiltinEngine


@dataclass
class GatewayRegistration:
    """Where and as what this engine announces itself to a Parrot gateway (with the app's secret)."""

    gateway_url: str
    advertise_url: str
    name: str
    heartbeat_interval_s: float = 2.0


# ---------------------------------------------------------------- errors


class GatewayMembership:
    """This engine's place at a gateway: registers with the engine secret, heartbeats with the token
    the gateway answered, registers again whenever the gateway forgets it, and leaves on shutdown.

    An unreachable gateway is normal (it may start after us), so failures are retried quietly; a
    refusal is logged once (a URL still held by our predecessor's record frees when it expires).
    """

    def __init__(self, client: httpx.AsyncClient, registration: GatewayRegistration, engine: "BuiltinEngine",
                 secret: str | None, log: Callable[[str], None]):
        self._client = client
        self._registration = registration
        self._gateway = registration.gateway_url.rstrip("/")
        self._engine = engine
        self._secret = secret
        self._log = log
        self._engine_id: str | None = None
        self._token: str | None = None
        self._refusal: int | None = None

    def _announcement(self) -> dict[str, Any]:
        return {"name": self._registration.name, "url": self._registration.advertise_url,
                "models": [self._engine.model_name], "capabilities": list(CAPABILITIES)}

    def _token_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._token}", "content-type": "application/json"}

    async def _register(self) -> None:
        headers = {"authorization": f"Bearer {self._secret}"} if self._secret else {}
        response = await self._client.post(f"{self._gateway}/v1/engines", json=self._announcement(), headers=headers)
        if response.is_client_error:
            if response.status_code != self._refusal:
                self._log(f"{self._gateway} refused the registration ({response.status_code}): {response.text}")
            self._refusal = response.status_code
            return
        response.raise_for_status()
        answer = response.json()
        self._engine_id, self._token, self._refusal = answer["id"], answer["token"], None
        self._log(f"registered with {self._gateway} as {self._engine_id}")

    async def _heartbeat(self) -> None:
        if not await self._engine.health():
            return  # a stalled step loop stops heartbeating: the gateway routes elsewhere once it expires us
        stats = msgspec.json.encode(await self._engine.stats())
        response = await self._client.post(f"{self._gateway}/v1/engines/{self._engine_id}/heartbeat",
                                           content=stats, headers=self._token_headers())
        if response.status_code in (401, 404):
            self._engine_id = None  # the gateway restarted or expired us
            return
        response.raise_for_status()

    async def run(self) -> None:
        while True:
            try:
                if self._engine_id is None:
                    await self._register()
                if self._engine_id is not None:
                    await self._heartbeat()
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(self._registration.heartbeat_interval_s)

    async def leave(self) -> None:
        """Deregisters (best effort): the gateway stops routing here at once, not after the timeout."""
        if self._engine_id is None:
            return
        try:
            await self._client.delete(f"{self._gateway}/v1/engines/{self._engine_id}",
                                      headers=self._token_headers(), timeout=2.0)
        except httpx.HTTPError:
            pass


# ---------------------------------------------------------------- app
