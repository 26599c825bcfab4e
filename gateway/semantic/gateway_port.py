"""What the semantic runner needs of the gateway, and nothing more: gateway/service.py's ``Gateway`` is one."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from engines.seam import Engine, Route
from gateway.engine_events import EngineEvents
from gateway.outcomes import Outcomes, Reported
from gateway.registry import EngineRecord
from gateway.scheduler import Placement, Work
from gateway.service import Answer, OpenedStream


class GatewayPort(Protocol):
    outcomes: Outcomes  # requests' latency, tokens and errors, counted as the plain path counts them
    events: EngineEvents  # engines' KV-cache events, where configured: what they hold, exactly

    async def work(self, route: Route, body: dict[str, Any], placement: Placement,
                   records: Sequence[EngineRecord]) -> Work:
        """A request as the scheduler sees it among ``records`` (its token ids where they publish KV events)."""

    @property
    def retries(self) -> int:
        """How many more engines a failed request may be tried on."""

    def engines_for(self, model: str) -> list[EngineRecord]:
        """The healthy engines serving ``model``."""

    def place(self, work: Work, records: list[EngineRecord]) -> EngineRecord | None:
        """The global scheduler's engine for ``work`` among ``records``."""

    def best(self, work: Work, records: list[EngineRecord]) -> EngineRecord | None:
        """``place``'s pick, not yet remembered as placed there."""

    def placed(self, work: Work, record: EngineRecord) -> None:
        """``work`` went to ``record``'s engine (what ``best`` picked): it holds the work's prefix from now on."""

    def token_defaults(self, route: Route, body: dict[str, Any], engine: Engine) -> dict[str, Any]:
        """The fields that bound a body without max_tokens on ``engine``, as for a plain request."""

    async def create(self, route: Route, model: str, body: dict[str, Any], hints: dict[str, Any] | None = None,
                     placement: Placement = Placement(),
                     read: Callable[[bytes], Reported | None] = ...) -> Answer:
        """A plain request, placed, retried and counted; its body read once by ``read``."""

    async def open_stream(self, route: Route, model: str, body: dict[str, Any], hints: dict[str, Any] | None = None,
                          placement: Placement = Placement()) -> OpenedStream:
        """A plain streamed request, placed and retried until its first chunk."""

    def sse_events(self, model: str, opened: OpenedStream) -> AsyncIterator[bytes]:
        """The opened stream's SSE events, counted; a failure mid-stream as an SSE error object."""
