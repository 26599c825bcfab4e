"""The gateway supervises the builtin engine process it starts: a real `parrot serve` (tiny model) whose
engine is killed with SIGKILL mid-stream, then reaped, taken out of routing and restarted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import msgspec
import pytest

from engines.builtin.server.cli import SECRET_ENV, build_parser
from gateway.config import ENV_OVERRIDES, SECRET_SETTINGS, BuiltinConfig, GatewayConfig
from gateway.server.cli import _serve_parser, config_from_args
from gateway.registry import EngineRegistry
from gateway.supervisor import EngineSupervisor
from tests.support.markers import marks_users
from tests.support.servers import free_port
from tests.support import plain_http

CLIENT_KEY = "client-key-never-in-an-engine"
ADMIN_KEY = "admin-key-never-in-an-engine"


def bearer(credential: str) -> dict[str, str]:
    return {"authorization": f"Bearer {credential}"}


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def secret_fields() -> set[tuple[str, str]]:
    """The config fields whose names say they hold keys or secrets (``api_key_env`` holds a variable's name)."""
    found = set()
    for section in msgspec.structs.fields(GatewayConfig):
        if isinstance(section.type, type) and issubclass(section.type, msgspec.Struct):
            found |= {(section.name, field.name) for field in msgspec.structs.fields(section.type)
                      if re.search(r"(key|secret|password|credential)s?$", field.name)}
    return found


def test_every_secret_setting_is_kept_out_of_the_engine_environment(monkeypatch):
    """One list of the settings that hold secrets, checked against the config's fields; the variable of each
    is missing from the engine's environment (PARROT_ADMIN_KEYS once reached it)."""
    assert secret_fields() <= SECRET_SETTINGS
    planted = {var: f"secret-of-{var}" for var, setting in ENV_OVERRIDES.items() if setting in SECRET_SETTINGS}
    assert {"PARROT_API_KEYS", "PARROT_ADMIN_KEYS", "PARROT_ENGINE_SECRET"} <= planted.keys()
    for var, value in planted.items():
        monkeypatch.setenv(var, value)

    supervisor = EngineSupervisor(GatewayConfig(), EngineRegistry())

    leaked = [var for var, value in planted.items() if value in supervisor._env.values()]
    assert leaked == [] and supervisor._env[SECRET_ENV] == supervisor.secret


def engine_compiles(config: GatewayConfig) -> bool:
    """Whether the engine process the gateway would start runs compiled: its command line as the engine reads it."""
    command = EngineSupervisor(config, EngineRegistry())._command
    return build_parser().parse_args(command[4:]).compile == "true"


def test_the_engine_parrot_serve_starts_runs_compiled_unless_told_otherwise(monkeypatch):
    """`make serve`'s default (docs/engine.md, "Compiled by default"): compiled on CPU; off by --no-compile,
    PARROT_ENGINE_COMPILE or [builtin] compile; never on another device; a --no-compile in extra_args wins."""
    monkeypatch.delenv("PARROT_ENGINE_COMPILE", raising=False)  # tests/conftest.py sets it for the tests' gateways
    assert engine_compiles(config_from_args(_serve_parser().parse_args([])))
    assert not engine_compiles(config_from_args(_serve_parser().parse_args(["--no-compile"])))
    assert not engine_compiles(GatewayConfig(builtin=BuiltinConfig(compile=False)))
    assert not engine_compiles(GatewayConfig(builtin=BuiltinConfig(extra_args=["--no-compile"])))
    assert not engine_compiles(GatewayConfig(builtin=BuiltinConfig(extra_args=["--device", "cuda"])))
    monkeypatch.setenv("PARROT_ENGINE_COMPILE", "false")
    assert not engine_compiles(config_from_args(_serve_parser().parse_args([])))
    assert engine_compiles(config_from_args(_serve_parser().parse_args(["--compile"])))


def gone(pid: int) -> bool:
    """Whether the process is gone, reaped too (a zombie still has its /proc entry)."""
    return not Path(f"/proc/{pid}").exists()


class ParrotServe:
    def __init__(self, model_dir: Path):
        self.port, self.engine_port = free_port(), free_port()
        self.model = model_dir.name  # the engine serves a checkpoint directory under its name
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_API_KEYS": CLIENT_KEY, "PARROT_ADMIN_KEYS": ADMIN_KEY,
               "PARROT_ENGINE_NUM_BLOCKS": "160", "PARROT_ENGINE_HEARTBEAT_INTERVAL": "0.5"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.server.cli", "serve", "--port", str(self.port),
             "--engine-port", str(self.engine_port), "--model", str(model_dir), "--log-level", "warning"], env=env)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", headers=bearer(CLIENT_KEY), timeout=30)

    def status(self, path: str) -> int | None:
        try:
            return self.http.get(path).status_code
        except httpx.TransportError:
            return None

    def engine_pid(self) -> int | None:
        engines = self.http.get("/v1/engines").json()
        return engines[0]["pid"] if engines else None

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture
@marks_users("subprocess")
def parrot_serve(tiny_model_dir) -> Iterator[ParrotServe]:
    served = ParrotServe(tiny_model_dir)
    try:
        yield served
    finally:
        served.close()


@pytest.mark.timeout(240)
def test_a_killed_engine_is_reaped_taken_out_and_restarted(parrot_serve, wait_until):
    gateway = parrot_serve
    wait_until(lambda: gateway.status("/health/live") == 200, timeout_s=60)
    loading = gateway.http.get("/health/ready")
    assert loading.status_code == 503  # the engine is still loading: its model has no engine yet
    assert loading.json()["models_without_engine"] == [gateway.model]
    wait_until(lambda: gateway.status("/health/ready") == 200, timeout_s=90)
    pid = gateway.engine_pid()
    assert pid

    # The engine process holds its own secret, never a client key; its port refuses anyone without it.
    environment = environment_of(pid)
    assert CLIENT_KEY not in "\n".join(environment.values()) and ADMIN_KEY not in "\n".join(environment.values())
    secret = environment["PARROT_ENGINE_SECRET"]
    assert secret not in gateway.http.get("/v1/engines").text
    engine_url = f"http://127.0.0.1:{gateway.engine_port}/v1/models"
    assert plain_http.get(engine_url).status_code == 401
    assert plain_http.get(engine_url, headers=bearer(CLIENT_KEY)).status_code == 401
    assert plain_http.get(engine_url, headers=bearer(secret)).status_code == 200

    # SIGKILL mid-stream: the client's stream ends with an error event, then [DONE].
    request = {"model": gateway.model, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    with gateway.http.stream("POST", "/v1/completions", json={**request, "stream": True}) as stream:
        events = (line for line in stream.iter_lines() if line.startswith("data: "))
        assert '"text"' in next(events)
        os.kill(pid, signal.SIGKILL)
        rest = list(events)
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2]

    # At once: the engine is out of routing and /health says why; requests get a clean 503.
    wait_until(lambda: gateway.status("/health") == 503, timeout_s=5)
    report = gateway.http.get("/health").json()
    assert (report["status"], report["models_without_engine"], report["engine_restarts"]) == (
        "degraded", [gateway.model], 1)
    refused = gateway.http.post("/v1/completions", json={**request, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_healthy_engine"
    assert gateway.status("/health/live") == 200
    wait_until(lambda: gone(pid), timeout_s=5)  # reaped, not a zombie

    # Restarted, registered again and answering within 30 s.
    wait_until(lambda: gateway.status("/health/ready") == 200, timeout_s=30)
    new_pid = gateway.engine_pid()
    assert new_pid and new_pid != pid
    assert gateway.http.post("/v1/completions", json={**request, "max_tokens": 2}).status_code == 200

    # Stopping the gateway stops its engine.
    gateway.process.send_signal(signal.SIGTERM)
    gateway.process.wait(timeout=30)
    wait_until(lambda: gone(new_pid), timeout_s=15)


@pytest.mark.subprocess  # `parrot serve` and its engine process
@pytest.mark.timeout(240)
def test_an_engine_refusing_its_model_is_not_restarted_and_health_says_why(tmp_path, wait_until):
    """A checkpoint of an architecture the engine does not run: the engine process exits at once naming it, the
    gateway does not start it again (no crash loop) and /health reports the refusal."""
    model_dir = tmp_path / "tiny-gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    gateway = ParrotServe(model_dir)
    try:
        wait_until(lambda: gateway.status("/health/live") == 200, timeout_s=60)
        # The engine's imports alone take a while on a busy 2-core host.
        wait_until(lambda: gateway.http.get("/health").json().get("engine_errors"), timeout_s=150)
        report = gateway.http.get("/health").json()
        assert report["status"] == "degraded" and report["models_without_engine"] == [gateway.model]
        assert "GPT2LMHeadModel" in report["engine_errors"][0] and "qwen3" in report["engine_errors"][0]
        restarts = report["engine_restarts"]
        assert restarts == 1
        time.sleep(2.5)  # past the first restart backoff (1 s): still not started again
        assert gateway.http.get("/health").json()["engine_restarts"] == restarts
    finally:
        gateway.close()


@pytest.mark.subprocess  # an engine process
def test_the_engine_process_refuses_an_unsupported_architecture_at_once(tmp_path):
    from engines.builtin.families import EXIT_UNSUPPORTED_MODEL

    (tmp_path / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    done = subprocess.run([sys.executable, "-m", "engines.builtin.server.cli", "--model", str(tmp_path), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_UNSUPPORTED_MODEL
    assert "cannot run MambaForCausalLM (model_type 'mamba')" in done.stderr
