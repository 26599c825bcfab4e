"""Configuration: defaults < TOML file < environment < command line, and typos caught early."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from gateway.server.cli import _serve_parser, config_from_args
from gateway.config import GatewayConfig, load_config

TOML = """
[server]
port = 7000
host = "0.0.0.0"
log_level = "debug"

[auth]
api_keys = ["from-file"]

[limits]
max_tokens = 256

[[upstreams]]
model = "gpt-4o-mini"
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY"
"""


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "parrot.toml"
    path.write_text(TOML)
    return path


def test_defaults_without_file_or_environment():
    config = load_config(env={})

    assert config == GatewayConfig()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.auth.api_keys == []
    assert config.builtin_enabled()


def test_file_overrides_defaults(toml_file):
    config = load_config(toml_file, env={})

    assert (config.server.host, config.server.port, config.server.log_level) == ("0.0.0.0", 7000, "debug")
    assert config.auth.api_keys == ["from-file"]
    assert config.limits.max_tokens == 256
    assert config.limits.max_body_bytes == GatewayConfig().limits.max_body_bytes  # untouched keys keep defaults
    (upstream,) = config.upstreams
    assert (upstream.model, upstream.served_model(), upstream.api_key_env) == (
        "gpt-4o-mini", "gpt-4o-mini", "OPENAI_API_KEY")
    assert not config.builtin_enabled()  # an upstream is configured


def test_environment_overrides_file(toml_file):
    config = load_config(toml_file, env={"PARROT_PORT": "7100", "PARROT_API_KEYS": " k1, k2 ,,",
                                         "PARROT_MAX_TOKENS": "512", "PARROT_BUILTIN": "yes"})

    assert config.server.port == 7100
    assert config.server.host == "0.0.0.0"  # from the file still
    assert config.auth.api_keys == ["k1", "k2"]
    assert config.limits.max_tokens == 512
    assert config.builtin_enabled()


def test_config_file_from_environment(toml_file):
    assert load_config(env={"PARROT_CONFIG": str(toml_file)}).server.port == 7000


def test_overrides_beat_environment(toml_file):
    config = load_config(toml_file, env={"PARROT_PORT": "7100", "PARROT_API_KEYS": "k1"},
                         overrides={"server": {"port": 7200, "host": None}, "auth": {"api_keys": ["cli"]},
                                    "upstreams": [{"model": "local", "base_url": "http://127.0.0.1:9/v1"}]})

    assert config.server.port == 7200
    assert config.server.host == "0.0.0.0"  # None means "not given on the command line"
    assert config.auth.api_keys == ["cli"]
    assert [u.model for u in config.upstreams] == ["gpt-4o-mini", "local"]


def test_command_line_flags(toml_file):
    args = _serve_parser().parse_args(["--config", str(toml_file), "--port", "7300", "--api-key", "a",
                                       "--api-key", "b", "--upstream", "m=http://127.0.0.1:9/v1", "--no-builtin"])

    config = config_from_args(args)

    assert config.server.port == 7300
    assert config.auth.api_keys == ["a", "b"]
    assert config.upstreams[-1].model == "m"
    assert config.builtin.enabled is False


@pytest.mark.parametrize("text, key", [
    ("[server]\nprot = 7000\n", "prot"),
    ("[limitz]\nmax_tokens = 5\n", "limitz"),
    ("[[upstreams]]\nmodel = 'm'\nbase_url = 'http://x/v1'\napi_key = 'sk-secret'\n", "api_key"),
])
def test_unknown_keys_in_the_file_are_rejected(tmp_path, text, key):
    path = tmp_path / "typo.toml"
    path.write_text(text)

    with pytest.raises(msgspec.ValidationError, match=f"unknown field `{key}`"):
        load_config(path, env={})


def test_wrong_types_in_the_file_are_rejected(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nport = 'eighty'\n")

    with pytest.raises(msgspec.ValidationError, match=r"server\.port"):
        load_config(path, env={})


@pytest.mark.subprocess
def test_serve_help_runs():
    parrot = Path(sys.executable).with_name("parrot")  # the console script pyproject.toml installs

    result = subprocess.run([str(parrot), "serve", "--help"], capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: parrot serve")
    for flag in ("--config", "--port", "--api-key", "--upstream", "--no-builtin"):
        assert flag in result.stdout


@pytest.mark.subprocess
def test_parrot_without_a_command_prints_usage():
    result = subprocess.run([sys.executable, "-m", "gateway.server.cli"], capture_output=True, text=True, timeout=60)

    assert result.returncode == 2
    assert "usage: parrot" in result.stderr


def test_log_and_tracing_settings_from_file_env_and_flags(tmp_path, monkeypatch):
    path = tmp_path / "parrot.toml"
    path.write_text('[server]\nlog_format = "json"\n[tracing]\nexporter = "console"\n')
    from_file = load_config(path, env={})
    assert (from_file.server.log_format, from_file.server.access_log, from_file.tracing.exporter) == ("json", False,
                                                                                                      "console")
    from_env = load_config(env={"PARROT_LOG_FORMAT": "json", "PARROT_ACCESS_LOG": "1", "PARROT_TRACING": "true"})
    assert (from_env.server.log_format, from_env.server.access_log, from_env.tracing.enabled) == ("json", True, True)
    from_flags = config_from_args(_serve_parser().parse_args(["--log-format", "json", "--access-log",
                                                              "--tracing-exporter", "otlp"]))
    assert (from_flags.server.log_format, from_flags.server.access_log) == ("json", True)
    assert (from_flags.tracing.enabled, from_flags.tracing.exporter) == (True, "otlp")
    assert GatewayConfig().server.log_format == "text" and not GatewayConfig().server.access_log
    monkeypatch.setenv("PARROT_ACCESS_LOG", "1")
    assert config_from_args(_serve_parser().parse_args([])).server.access_log is True
    assert config_from_args(_serve_parser().parse_args(["--no-access-log"])).server.access_log is False
    with pytest.raises(msgspec.ValidationError):
        load_config(env={"PARROT_LOG_FORMAT": "xml"})


def test_engine_log_flags_from_env_and_command_line(monkeypatch):
    from engines.builtin.server.cli import build_parser

    assert (build_parser().parse_args([]).log_format, build_parser().parse_args([]).access_log) == ("text", False)
    monkeypatch.setenv("PARROT_ENGINE_LOG_FORMAT", "json")
    monkeypatch.setenv("PARROT_ENGINE_ACCESS_LOG", "true")
    args = build_parser().parse_args([])
    assert (args.log_format, args.access_log) == ("json", True)
    assert build_parser().parse_args(["--log-format", "text"]).log_format == "text"


def test_an_upstreams_kv_events_endpoint_from_the_file_the_flags_or_the_environment(tmp_path, monkeypatch):
    toml_file = tmp_path / "parrot.toml"
    toml_file.write_text('[[upstreams]]\nmodel = "m"\nbase_url = "http://a/v1"\nkv_events = "tcp://a:5557"\n'
                         'kv_events_replay = "tcp://a:5558"\n[kv_events]\nsilence_s = 2.5\nrewarm = false\n')
    config = load_config(toml_file, env={})
    assert (config.upstreams[0].kv_events, config.upstreams[0].kv_events_replay) == ("tcp://a:5557", "tcp://a:5558")
    assert (config.kv_events.silence_s, config.kv_events.rewarm) == (2.5, False)
    assert load_config(env={"PARROT_KV_EVENTS_REWARM": "0", "PARROT_KV_EVENTS_SILENCE_S": "1"}).kv_events == \
        msgspec.convert({"silence_s": 1.0, "rewarm": False}, type(config.kv_events))
    flags = ["--upstream", "m=http://a/v1", "--upstream", "m=http://b/v1", "--upstream-kv-events", "",
             "--upstream-kv-events", "tcp://b:5557"]
    config = config_from_args(_serve_parser().parse_args(flags))
    assert [u.kv_events for u in config.upstreams] == [None, "tcp://b:5557"]
    monkeypatch.setenv("PARROT_UPSTREAM_KV_EVENTS", "tcp://a:5557,")
    config = config_from_args(_serve_parser().parse_args(flags[:4]))
    assert [u.kv_events for u in config.upstreams] == ["tcp://a:5557", None]
    with pytest.raises(SystemExit):
        config_from_args(_serve_parser().parse_args([*flags[:2], *flags[4:]]))  # two endpoints, one upstream
