"""The engine seam: all the gateway knows of engines, and all it imports from ``engines/`` but the builtin
engine's torch-free command line (engines/builtin/server/cli.py), which gateway/supervisor.py reads to start one.

interface.py     ``Engine`` (create / stream / health / stats / aclose) and the optional capabilities
                 ``ContextEngine`` (contexts + prompt split), ``HintedEngine`` (scheduling fields),
                 ``PrioritizedEngine`` (criteria as vLLM's / SGLang's ``priority``) and ``PrefillEngine``
                 (prefill-only requests that warm a server's prefix cache), ``ResponsesEngine`` (serves
                 POST /v1/responses itself: Responses requests are passed through to it), ``TokenizingEngine`` (a
                 prompt's token ids, to match against the engine's KV-cache events)
kv_events.py     vLLM's KV-cache events (blocks stored, removed, all cleared): the schema the builtin engine
                 publishes and the gateway consumes
contexts.py      what the context capability answers: FillResult, Generation (GenerationChunk), PromptSplit;
                 ForkPart (a fork's text as pieces: text, or an earlier generation's output by name)
errors.py        ``EngineError`` and its kinds, each with the HTTP status it becomes
upstream.py      ``UpstreamEngine``: any OpenAI-compatible server over HTTP; ``upstream_class``: the one with
                 the capabilities its configuration gives it (priority scheduling, prefill ahead)
prometheus_stats.py  a vLLM or SGLang server's load and KV capacity from its /metrics
builtin_client.py  ``BuiltinEngineClient``: the builtin engine's HTTP API, with both capabilities
connect.py       announced capabilities -> the engine object; an object's capabilities -> names
"""

from engines.seam.contexts import FillResult, ForkPart, Generation, GenerationChunk, PromptSplit, Segment
from engines.seam.errors import (
    EngineError,
    EngineOverloaded,
    EngineRefusedGateway,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)
from engines.seam.interface import (
    ContextEngine,
    Count,
    EmbeddingEngine,
    Engine,
    EngineStats,
    HintedEngine,
    PrefillEngine,
    PrioritizedEngine,
    ResponsesEngine,
    ResponsesRoute,
    Route,
    TokenizingEngine,
)

__all__ = ["ContextEngine", "Count", "EmbeddingEngine", "Engine", "EngineError", "EngineOverloaded", "EngineRefusedGateway", "EngineRejected", "EngineStats",
           "EngineTimeout", "EngineUnavailable", "FillResult", "ForkPart", "Generation", "GenerationChunk", "HintedEngine", "PrefillEngine", "PrioritizedEngine",
           "PromptSplit", "ResponsesEngine", "ResponsesRoute", "Route", "TokenizingEngine",
           "Segment"]
