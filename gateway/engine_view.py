"""What the global scheduler sees of one engine: the models it serves, its load and its KV capacity.

The registry's records are views with the engine attached (registry.EngineRecord); the scheduler simulator
(benchmarks/scheduler_sim.py) makes bare ones. What an engine holds is the scheduler's own memory of what it
placed there (scheduler.py), not part of the view.
"""

from __future__ import annotations

import msgspec

from engines.seam import EngineStats


class EngineView(msgspec.Struct, kw_only=True):
    id: str
    models: list[str]
    in_flight: int = 0  # requests this gateway has on it now (known at once, unlike reported stats)
    # What it last reported: heartbeats (builtin engines), /metrics (vLLM, SGLang), nothing (hosted APIs).
    stats: EngineStats = msgspec.field(default_factory=EngineStats)

    def load(self) -> int:
        """Requests on it now, ours and (when it reports them) other clients' too."""
        return max(self.in_flight, self.stats.running + self.stats.waiting)

    def waiting(self) -> int:
        """Requests in its queue, not yet running: what it reports waiting, or more where ours outnumber what it
        reports running (sent since its last report)."""
        return max(self.stats.waiting, self.in_flight - self.stats.running)
