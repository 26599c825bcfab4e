"""The engine seam: what the gateway knows of an engine, and the clients that reach engines over HTTP.

``interface``: the ``Engine`` Protocol every engine implements, its errors and stats.
"""

from engines.seam.interface import (
    Count,
    Engine,
    EngineError,
    EngineOverloaded,
    EngineRejected,
    EngineStats,
    EngineTimeout,
    EngineUnavailable,
    Route,
)

__all__ = ["Count", "Engine", "EngineError", "EngineOverloaded", "EngineRejected", "EngineStats", "EngineTimeout",
           "EngineUnavailable", "Route"]
