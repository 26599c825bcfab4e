"""``parrot engine``: flags and environment map onto EngineConfig, and a real process serves and registers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from tests.support import plain_http
import msgspec
import pytest
from litestar import Litestar, Request, post

from engines.builtin.server.cli import build_parser, engine_config
from engines.builtin.config import EngineConfig
from engines.builtin.server.app import DEFAULT_SERVED_MODEL_NAME, served_model_name


def test_engine_defaults_come_from_engine_config():
    assert engine_config(build_parser().parse_args([])) == EngineConfig()


def test_flags_and_environment_override_defaults(monkeypatch):
    monkeypatch.setenv("PARROT_ENGINE_BLOCK_SIZE", "32")
    monkeypatch.setenv("PARROT_ENGINE_MAX_NUM_SEQS", "8")
    args = build_parser().parse_args(["--max-num-seqs", "4", "--num-blocks", "100", "--dtype", "bfloat16", "--port", "9"])
    config = engine_config(args)
    assert (config.block_size, config.max_num_seqs, config.num_blocks, config.dtype) == (32, 4, 100, "bfloat16")
    assert args.port == 9


def test_the_kv_cache_budget_by_flag_or_environment(monkeypatch):
    monkeypatch.setenv("PARROT_ENGINE_KV_CACHE_MEMORY_FRACTION", "0.4")
    assert engine_config(build_parser().parse_args([])).kv_cache_memory_fraction == 0.4
    args = build_parser().parse_args(["--kv-cache-memory-fraction", "0.25", "--kv-cache-memory", "1073741824"])
    assert (engine_config(args).kv_cache_memory_fraction, engine_config(args).kv_cache_memory) == (0.25, 2**30)


@pytest.mark.parametrize("field", [f.name for f in msgspec.structs.fields(EngineConfig) if f.type is bool])
def test_every_boolean_is_a_switch_with_a_no_form(field, monkeypatch):
    """``--compile`` alone turns it on (it once wanted ``--compile true``, which still works), ``--no-compile``
    off, and the command line wins over the environment either way."""
    flag = field.replace("_", "-")
    negated = field.removeprefix("enable_").replace("_", "-")
    for argv, expected in (([f"--{flag}"], True), ([f"--{flag}", "true"], True), ([f"--{flag}", "false"], False),
                           ([f"--no-{negated}"], False)):
        assert getattr(engine_config(build_parser().parse_args(argv)), field) is expected, argv
    monkeypatch.setenv(f"PARROT_ENGINE_{field.upper()}", "true")
    assert getattr(engine_config(build_parser().parse_args([])), field) is True
    assert getattr(engine_config(build_parser().parse_args([f"--no-{negated}"])), field) is False
    monkeypatch.setenv(f"PARROT_ENGINE_{field.upper()}", "false")
    assert getattr(engine_config(build_parser().parse_args([f"--{flag}"])), field) is True


def test_access_log_switch_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("PARROT_ENGINE_ACCESS_LOG", "true")
    assert build_parser().parse_args([]).access_log is True
    assert build_parser().parse_args(["--no-access-log"]).access_log is False


def test_invalid_engine_option_exits_with_a_message():
    with pytest.raises(SystemExit, match="block_size"):
        engine_config(build_parser().parse_args(["--block-size", "sixteen"]))
    with pytest.raises(SystemExit, match="latency_max_num_seqs must be between 1 and max_num_seqs"):
        engine_config(build_parser().parse_args(["--max-num-seqs", "8", "--latency-max-num-seqs", "9"]))
    assert engine_config(build_parser().parse_args(["--latency-max-num-seqs", "2"])).latency_max_num_seqs == 2


def test_served_model_names():
    assert served_model_name(EngineConfig()) == DEFAULT_SERVED_MODEL_NAME
    assert served_model_name(EngineConfig(model="/models/llama-3-8b/")) == "llama-3-8b"
    assert served_model_name(EngineConfig(model="/models/phi.Q4_0.gguf")) == "phi.Q4_0"


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_engine_process_serves_and_registers_with_the_gateway(tiny_model_dir, serve, wait_until):
    registrations, heartbeats, secrets, tokens = [], [], set(), set()

    @post("/v1/engines", status_code=201)
    async def register(request: Request) -> dict:
        secrets.add(request.headers.get("authorization"))
        registrations.append(await request.json())
        return {"id": "e1", "token": "token-of-e1"}

    @post("/v1/engines/e1/heartbeat", status_code=200)
    async def heartbeat(request: Request) -> dict:
        tokens.add(request.headers.get("authorization"))
        heartbeats.append(await request.json())
        return {}

    gateway_url = serve(Litestar([register, heartbeat]))
    with socket.socket() as sock:  # a free loopback port for the engine process
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "engines.builtin.server.cli", "--model", str(tiny_model_dir), "--port", str(port),
        "--served-model-name", "tiny", "--max-model-len", "128", "--num-blocks", "16",
        "--gateway-url", gateway_url, "--name", "cli-test", "--heartbeat-interval", "0.1", "--log-level", "warning",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_ENGINE_SECRET": "engine-secret"}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(process.stderr), daemon=True)
    reader.start()
    try:
        wait_until(lambda: heartbeats or process.poll() is not None, timeout_s=90)
        assert process.poll() is None, "".join(log)
        assert registrations == [
            {"name": "cli-test", "url": f"http://127.0.0.1:{port}", "models": ["tiny"],
             "capabilities": ["contexts", "scheduling_hints"]}
        ]
        assert heartbeats[-1]["blocks_total"] == 16
        assert secrets == {"Bearer engine-secret"} and tokens == {"Bearer token-of-e1"}
        request = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert plain_http.post(url, json=request, timeout=30).status_code == 401  # only its gateway may use it
        reply = plain_http.post(url, json=request, headers={"authorization": "Bearer engine-secret"}, timeout=30).json()
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.wait(timeout=30)
    reader.join(timeout=10)  # stderr ends with the process: the reader has it all
    assert any("ready in" in line for line in log), "".join(log)
    assert heartbeats and not any("HTTP Request" in line for line in log)  # no line per heartbeat
