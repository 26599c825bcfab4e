"""What one API key holds at the gateway between its requests: calls not yet finished, and shared prefixes
pinned on engines ahead of its waiting calls, each held to the key's quotas (QuotaLimits). Calls submitted
with wait=false outlive their request, so no request quota covers them."""

from __future__ import annotations

from gateway.config import QuotaLimits
from gateway.domain_errors import QuotaExceeded


class Holdings:
    __slots__ = ("limits", "calls", "pinned_tokens", "refused_pins", "_pins")

    def __init__(self, limits: QuotaLimits):
        self.limits = limits
        self.calls = 0  # waiting for inputs or running, in all the key's sessions
        self.pinned_tokens = 0  # of the distinct prefixes in _pins
        self.refused_pins = 0  # prefixes its calls could not hold ahead, over its quota (ever)
        self._pins: dict[str, tuple[int, int]] = {}  # prefix key -> (its tokens, calls holding it)

    def add_call(self) -> None:
        """One more call of the key's; a 429 when it holds its quota of them already."""
        limit = self.limits.pending_calls
        if limit is not None and self.calls >= limit:
            raise QuotaExceeded(f"this API key already has {self.calls} calls waiting or running, its quota; "
                                "read or wait for their outputs, or delete sessions you no longer need",
                                code="pending_calls_quota_exceeded")
        self.calls += 1

    def call_ended(self) -> None:
        self.calls -= 1

    def pin(self, key: str, tokens: int) -> bool:
        """Whether a waiting call may hold prefix ``key`` (``tokens`` long) ahead of its inputs: a prefix the key
        holds already is free, another must fit in its quota of pinned tokens. Each True needs an ``unpin``."""
        held = self._pins.get(key)
        if held is None:
            limit = self.limits.pinned_prefix_tokens
            if limit is not None and self.pinned_tokens + tokens > limit:
                self.refused_pins += 1
                return False
            held = (tokens, 0)
            self.pinned_tokens += tokens
        self._pins[key] = (held[0], held[1] + 1)
        return True

    def unpin(self, key: str) -> None:
        tokens, holders = self._pins[key]
        if holders > 1:
            self._pins[key] = (tokens, holders - 1)
            return
        del self._pins[key]
        self.pinned_tokens -= tokens
