"""Bodies of the semantic-variable extension and the native API."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from wire.sampling import Criteria, Sampling, sampling_of


class VarRef(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A placeholder's binding, one of: an existing variable (possibly not produced yet), a literal value, or
    ``call``: a request of the same endpoint (model, messages or prompt, sampling, and a ``parrot`` object
    with only ``vars`` and ``criteria``) run in the same session, whose output binds the placeholder. Inline
    calls make one HTTP request carry a whole tree of calls (a reduce and its maps): one round trip."""

    id: str | None = None
    value: str | None = None
    call: dict[str, Any] | None = None


class InlineExtension(msgspec.Struct, forbid_unknown_fields=True):
    """The ``parrot`` object of an inline call: its session, output and waiting are its consumer's."""

    vars: dict[str, VarRef] = {}
    criteria: Criteria | None = None


class OutputRef(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Where a completion's text goes: a new variable called ``name``, or an existing variable ``id``."""

    name: str | None = None
    id: str | None = None


class ParrotExtension(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """The top-level ``parrot`` object of /v1/chat/completions and /v1/completions."""

    session_id: str | None = None
    vars: dict[str, VarRef] = {}
    output: Union[str, OutputRef, None] = None
    criteria: Criteria | None = None
    wait: bool = True


class VarView(msgspec.Struct):
    id: str
    name: str | None
    session_id: str
    ready: bool
    value: str | None = None
    error: str | None = None
    producer: str | None = None


class OutputView(msgspec.Struct):
    id: str
    name: str | None


class ParrotResult(msgspec.Struct, omit_defaults=True):
    session_id: str
    output: OutputView | None = None
    # The output variables of the request's inline calls (``vars.NAME.call``) by placeholder, nested ones too.
    inline: dict[str, OutputView] = {}
    call_id: str | None = None
    status: str | None = None


class Accepted(msgspec.Struct):
    """The 202 answer of ``wait: false``."""

    parrot: ParrotResult
    object: str = "parrot.accepted"


# ---------------------------------------------------------------- native API


class SessionView(msgspec.Struct):
    id: str
    created: int
    object: str = "parrot.session"


class SessionDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    freed_variables: int = 0
    freed_contexts: int = 0
    object: str = "parrot.session.deleted"


class VarCreate(msgspec.Struct, forbid_unknown_fields=True):
    session_id: str | None = None
    name: str | None = None
    value: str | None = None


class VarSet(msgspec.Struct, forbid_unknown_fields=True):
    """Exactly one of: the value, or an error that fails the variable (and so its consumers)."""

    value: str | None = None
    error: str | None = None


class VarList(msgspec.Struct):
    data: list[VarView]
    object: str = "list"


class OutputSpec(Sampling, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Sampling for one ``{{output:NAME}}`` of a semantic call: the sampling fields (wire/sampling.py), and
    chat's ``max_completion_tokens``, which takes precedence over max_tokens."""

    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def sampling(self) -> dict[str, Any]:
        """The fields as a /v1/completions body would carry them."""
        return sampling_of(msgspec.to_builtins(self))


class SemanticCall(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt template whose ``{{input:NAME}}`` (or ``{{NAME}}``) placeholders read variables and whose
    ``{{output:NAME}}`` placeholders are generated in order, each seeing everything before it."""

    model: str
    template: str
    session_id: str | None = None
    inputs: dict[str, VarRef] = {}
    outputs: dict[str, OutputSpec] = {}
    criteria: Criteria | None = None


class SemanticCallView(msgspec.Struct):
    id: str
    session_id: str
    outputs: dict[str, OutputView]
    object: str = "parrot.semantic_call"


# ---------------------------------------------------------------- graph view (GET /v1/sessions, /graph)


CallState = Literal["waiting", "running", "done", "failed", "cancelled"]


class CallNode(msgspec.Struct, kw_only=True):
    """One call of a session's graph: its state, where it ran, its timings (Unix seconds)."""

    id: str
    state: CallState  # waiting: for its inputs (its shared prefix may be filling); running: on an engine
    criteria: Criteria  # latency: someone waits on it (it goes first); throughput: it may wait for a batch
    group: str | None  # its task group (named by the consumer that waits for all its members), if any
    engine: str | None  # the engine it runs or ran on (an id of GET /v1/engines)
    inputs: dict[str, str]  # placeholder -> variable id
    outputs: dict[str, str]  # output name -> variable id
    submitted: float
    # Sent to its engine before its inputs were ready, to start there as soon as they are produced (their
    # text handed over on the engine); it is waiting until they are bound here, then running.
    handed: float | None = None
    started: float | None = None  # its inputs were ready: it went to an engine (or, handed, runs there)
    finished: float | None = None
    error: str | None = None
    # Where its time went (graph.CallTimings): prompt warmed ahead (a context filled, or prefilled on an
    # upstream), first request sent to its engine, first token back (its text streamed from the engine), last
    # answer back.
    warmed: float | None = None
    dispatched: float | None = None
    first_token: float | None = None
    answered: float | None = None


class VariableEdge(msgspec.Struct, kw_only=True):
    """A variable: an edge from its producer to its consumers, with the start of its value."""

    id: str
    name: str | None
    producer: str | None  # a call id; None: a value the client gives
    consumers: list[str]  # call ids (among the calls shown)
    ready: bool  # it has its value (a failed one has an error instead)
    preview: str | None  # the value's first characters ("…" ends a truncated one)
    size: int  # UTF-8 bytes of the whole value
    error: str | None = None


class SessionGraph(msgspec.Struct, kw_only=True):
    session_id: str
    created: int
    default: bool  # the key's default session (requests without a session_id)
    now: float  # the gateway's clock (Unix seconds), to age running calls by
    calls: list[CallNode]  # running and waiting ones, and the latest finished ones ([semantic] finished_calls_kept)
    variables: list[VariableEdge]
    object: str = "parrot.session.graph"


class SessionSummary(msgspec.Struct, kw_only=True):
    id: str
    created: int
    default: bool
    owner: str  # a fingerprint of the API key that owns it (the start of its SHA-256), never the key
    variables: int
    pending_calls: int
    finished_calls: int
    object: str = "parrot.session"


class SessionList(msgspec.Struct):
    data: list[SessionSummary]
    object: str = "list"
