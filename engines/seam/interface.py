"""The engine seam: the one small interface the gateway routes every request through, and the optional
capabilities an engine may add to it (discovered with ``isinstance`` on the engine object).

An engine takes an OpenAI-shaped request body (already validated by the gateway, ``model``
rewritten to the engine's own model name, the ``parrot`` extension removed) and returns the
response body as JSON bytes, or streams SSE events (``data: {json}\n\n``; one or more whole
events per item, never ``[DONE]``). Bytes rather than Structs keep upstream pass-through free of
re-encoding and keep fields this project does not know about; several events per item let
whatever arrived together leave in one write.

Failures are raised as ``EngineError`` subclasses (errors.py); the gateway turns them into OpenAI
error objects at one boundary.

Capabilities: ``ContextEngine`` (named KV contexts the gateway fills once and forks per request, and the
prompt split that finds the constant prefix worth sharing), ``HintedEngine`` (takes Parrot's
scheduling fields), ``PrioritizedEngine`` (a vLLM or SGLang server with priority scheduling: takes
criteria as its own ``priority`` number) and ``PrefillEngine`` (a server with prefix caching that takes
prefill-only requests: waiting calls' prompts are warmed there), ``ResponsesEngine`` (serves OpenAI's Responses
API itself: Responses requests are passed through to it). The builtin engine's client (builtin_client.py) has the
first two; any other OpenAI-compatible server gets plain requests, and the others when configured.
"""

from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Literal, Protocol, runtime_checkable

import msgspec

from engines.seam.contexts import FillResult, ForkPart, Generation, GenerationChunk, PromptSplit

Route = Literal["chat/completions", "completions"]
ResponsesRoute = Literal["responses"]  # POST /v1/responses: only a ResponsesEngine's create and stream take it


# Routing sorts engines by reported load: a negative count would draw every request to its reporter; and
# what is listed and exported (/v1/engines, /metrics) is an int64 there, as Prometheus and JSON readers take it.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class EngineStats(msgspec.Struct, kw_only=True):
    """What an engine reports on heartbeat; fields an engine cannot know stay at their defaults."""

    running: Count = 0
    waiting: Count = 0
    blocks_total: Count = 0
    blocks_free: Count = 0
    block_size: Count = 0  # tokens per KV block: blocks_total × block_size is what the engine can hold
    cached_tokens: Count = 0
    prefix_hit_tokens: Count = 0
    prompt_tokens: Count = 0
    generation_tokens: Count = 0
    # As vLLM counts them: prompt tokens looked up in the prefix cache when a request was scheduled, and
    # of those the tokens found (a fork's tokens shared from its parent are neither).
    prefix_cache_queries: Count = 0
    prefix_cache_hits: Count = 0
    num_preemptions: Count = 0
    # Of those, latency-critical requests (someone reads them token by token): the criteria should make
    # throughput work give way first, so this stays 0 while there is throughput work to preempt.
    latency_preemptions: Count = 0

    def __post_init__(self) -> None:  # a ValueError here is a msgspec.ValidationError: the heartbeat's 400
        for part, whole in (("blocks_free", "blocks_total"), ("latency_preemptions", "num_preemptions")):
            if getattr(self, part) > getattr(self, whole):
                raise ValueError(f"{part} ({getattr(self, part)}) is more than {whole} ({getattr(self, whole)})")

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV the engine holds at most; 0: it did not say."""
        return self.blocks_total * self.block_size

    def kv_use(self) -> float:
        """The fraction of its KV blocks in use (0 when it did not say)."""
        return 1 - self.blocks_free / self.blocks_total if self.blocks_total else 0.0


@runtime_checkable
class Engine(Protocol):
    name: str  # unique within a gateway, e.g. "builtin-0" or "openai"

    async def create(self, route: Route, body: dict[str, Any]) -> bytes:
        """Run one non-streaming request; returns the OpenAI response body."""
        ...

    def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """Run one streaming request; yields whole SSE events (several per item when they arrived
        together). When the engine ends its stream with ``[DONE]``, that event closes the last item,
        with the events that came with it. Closing it cancels the request."""
        ...

    async def health(self) -> bool: ...

    async def stats(self) -> EngineStats: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class HintedEngine(Engine, Protocol):
    """Takes Parrot's scheduling fields in a request body (``wire.sampling.SCHEDULING_FIELDS``): it orders
    work by ``priority`` and ``criteria``, and bounds a request without max_tokens by ``max_tokens_limit``
    below the room its context window has left (an engine without them is sent ``max_tokens`` instead)."""

    takes_scheduling_hints: Literal[True]


@runtime_checkable
class PrioritizedEngine(Engine, Protocol):
    """Orders its queue by a request's ``priority`` field (vLLM ``--scheduling-policy priority``, SGLang
    ``--enable-priority-scheduling``): the gateway sends Parrot's criteria as that number."""

    def priority_of(self, level: int) -> int:
        """The ``priority`` this engine reads for work of urgency ``level``: 0 latency-critical (served first),
        1 a task group someone waits on, 2 throughput (served last). Only a server configured with priority
        scheduling has this capability: vLLM 0.32.0 under its default ``fcfs`` policy accepts any ``priority``
        and serves by arrival alone (checked: 0, 1, 2, -1 and 5 answered 200), and releases before V1's
        input processor refused any but 0 (400). Under ``--scheduling-policy priority`` it takes the waiting
        request of lowest (priority, arrival) first, and when KV blocks run out preempts the running request
        of highest (priority, arrival); it does not reorder requests already in the running batch."""
        ...


@runtime_checkable
class PrefillEngine(Engine, Protocol):
    """Keeps the prompt prefixes it computed (vLLM's automatic prefix caching, SGLang's radix cache) and takes a
    prefill-only request: the gateway warms it with a waiting call's prompt up to its first pending variable, so
    that when the call's inputs land its prompt is mostly cached there (the upstream counterpart of a context
    fill, without contexts: the engine's cache, not the gateway, decides how long the prefix stays)."""

    async def prefill(self, route: Route, body: dict[str, Any]) -> int:
        """Computes the prompt of ``body`` (an OpenAI request body whose prompt is a prefix of one to come: a
        completions prompt, or chat messages whose last one is cut short), generating at most one token;
        returns the prompt tokens the engine reported (0 if it did not)."""
        ...


@runtime_checkable
class ResponsesEngine(Engine, Protocol):
    """Serves OpenAI's Responses API itself (an upstream configured with ``[[upstreams]] responses = true``: vLLM,
    OpenAI, another Parrot gateway): its ``create`` and ``stream`` also take the route ``"responses"``, whose body
    and answer (a Response, or the Responses API's stream events, which end without ``[DONE]``) are that API's.
    The gateway then passes a model's Responses requests through to such engines instead of running them over
    chat completions; it keeps the conversation itself, so the engine is never asked for one it stored."""

    serves_responses: Literal[True]

    async def create(self, route: Route | ResponsesRoute, body: dict[str, Any]) -> bytes: ...

    def stream(self, route: Route | ResponsesRoute, body: dict[str, Any]) -> AsyncIterator[bytes]: ...
class TokenizingEngine(Engine, Protocol):
    """Answers a prompt's token ids as it would compute them (vLLM's ``POST /tokenize``, the builtin engine's
    too): what the gateway matches against the blocks an engine's KV-cache events say it holds."""

    async def tokenize(self, route: Route, body: dict[str, Any]) -> list[int]:
        """The token ids of ``body``'s prompt (a chat request's rendered with its template, as ``body`` asks:
        the generation prompt added, or its last message continued)."""
        ...


@runtime_checkable
class EmbeddingEngine(Engine, Protocol):
    """An engine that computes embeddings (POST /v1/embeddings) for the models it serves: an upstream
    configured as an embedding server (``[[upstreams]] embeddings = true``). Per engine, not per class:
    ``embeds`` says whether this one does."""

    embeds: bool

    async def embed(self, body: dict[str, Any]) -> bytes: ...


@runtime_checkable
class ContextEngine(Engine, Protocol):
    """Holds named KV contexts: filled once, forked by many requests, freed when asked."""

    async def split_prompt(self, route: Route, body: dict[str, Any]) -> PromptSplit:
        """The prompt ``body`` renders to, split where its first ``{{variable}}`` starts (or, with none, where
        its last message starts): the constant prefix, and the rest as text and variable segments."""
        ...

    async def fill(self, *, text: str | None = None, tokens: list[int] | None = None,
                   parent_context_id: str | None = None, context_id: str | None = None,
                   if_absent: bool = False) -> FillResult:
        """Fills a context; ``if_absent``: creates ``context_id`` unless it exists, not waiting for its fill."""
        ...

    async def generate_in_context(self, context_id: str, sampling: dict[str, Any], *,
                                  fork_with: str | list[ForkPart] | None = None, context_text: str | None = None,
                                  output_id: str | None = None, keep_as: str | None = None,
                                  trim: bool = False) -> Generation:
        """Generates after the context (appending to it), or with ``fork_with``: after the context plus that
        text, in a temporary child the engine frees itself. ``context_text`` (with ``fork_with``): the
        context's text, to create it from if it does not exist yet; the prompt is then exactly the
        tokenization of that text and the fork's as one text. ``fork_with`` as parts may name earlier
        generations' outputs (``output_id``), which the engine puts in as their text once produced
        (EngineRejected, status 424, if one is not: its generation failed). ``keep_as`` (with ``fork_with``): the
        child is not freed once its generation finishes (stop or length) but kept under that id, holding the
        prompt and the output (a next fork with ``trim`` then makes it the start of its prompt); a failed one is freed.
        ``trim`` (with ``context_text``): a context holding other tokens than that text's first ones is first trimmed
        to their common prefix (the longest, with its KV), which the fork then follows and computes the rest of the
        text from: its prompt is still exactly the plain one."""
        ...

    def stream_in_context(self, context_id: str, sampling: dict[str, Any], *,
                          fork_with: str | list[ForkPart] | None = None, context_text: str | None = None,
                          output_id: str | None = None, keep_as: str | None = None,
                          trim: bool = False) -> AsyncIterator[GenerationChunk]:
        """``generate_in_context``, its tokens yielded as they are generated. Closing it cancels the generation."""
        ...

    async def free_context(self, context_id: str) -> int:
        """Frees the context; returns the KV blocks released."""
        ...
