"""Shared fixtures: free loopback ports, ASGI apps served by a real uvicorn in a background thread, and
models: the real SmolLM2 GGUF and a tiny random Llama saved as an HF checkpoint (with SmolLM2's real
tokenizer beside it)."""

from __future__ import annotations

import asyncio

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import uvicorn

from http_plumbing.http_protocol import HttpProtocol

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    """A loopback port nothing listens on right now (also what a dead server looks like)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports nothing listens on (engines on port, port + 1, ...)."""
    while True:
        first = free_port()
        if all(_bindable(first + i) for i in range(1, count)):
            return first


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def serve_in_thread(app: Any, *, port: int | None = None, startup_timeout_s: float = 20.0) -> Iterator[str]:
    """Runs ``app`` under uvicorn on 127.0.0.1 (on ``port``, else a free one) until the block ends; yields
    its base URL (no trailing /)."""
    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=2, loop="uvloop", http=HttpProtocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn for {app!r} exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn for {app!r} did not start in {startup_timeout_s}s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def asgi_app(handler: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    """An ASGI app of one HTTP handler ``handler(scope, receive, send)``; lifespan events acknowledged."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await handler(scope, receive, send)

    return app


async def read_asgi_body(receive: Callable[[], Any]) -> bytes:
    """The whole request body an ASGI handler receives."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def _serve_fixture(scope: str):
    @pytest.fixture(scope=scope)
    def fixture() -> Iterator[Callable[[Any], str]]:
        with contextlib.ExitStack() as stack:
            yield lambda app, **options: stack.enter_context(serve_in_thread(app, **options))

    fixture.__doc__ = (f"``serve(app, port=None)`` starts ``app`` until the end of the {scope}; returns its "
                       "base URL.")
    return fixture


serve = _serve_fixture("function")
serve_module = _serve_fixture("module")
serve_session = _serve_fixture("session")


def wait_until(condition: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    """Polls ``condition`` until it returns something truthy; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")

        time.sleep(interval_s)


async def eventually(condition: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.005) -> Any:
    """``wait_until`` inside an event loop: polls without blocking it (the engine's thread does the work)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
    return value


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """``wait_until(condition, timeout_s=...)``: bounded polling for things that happen asynchronously."""
    return wait_until


# ---------------------------------------------------------------- the real default model behind a real gateway

SMOLLM = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm_gateway(serve_session) -> Iterator[dict[str, str]]:
    """A gateway (in this process) and a builtin SmolLM2 engine process that registers with it and
    heartbeats, as `parrot serve` runs them. Yields {"gateway": url, "engine": url, "secret": the engine
    secret, which the engine's own routes require}; one per test session."""
    import os
    import subprocess
    import sys

    import httpx

    from gateway.app import create_app
    from gateway.config import BuiltinConfig, EnginesConfig, GatewayConfig

    secret = "smollm-engine-secret"
    config = GatewayConfig(builtin=BuiltinConfig(enabled=False),
                           engines=EnginesConfig(registration_secret=secret, heartbeat_timeout_s=60.0))
    gateway = serve_session(create_app(config))
    engine_port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "engine", "--port", str(engine_port), "--gateway-url", gateway,
         "--heartbeat-interval", "0.5"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_ENGINE_SECRET": secret})
    try:
        deadline = time.monotonic() + 300
        while SMOLLM not in httpx.get(f"{gateway}/v1/models").text:
            if engine.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the builtin engine did not register with the gateway")
            time.sleep(0.5)
        yield {"gateway": gateway, "engine": f"http://127.0.0.1:{engine_port}", "secret": secret}
    finally:
        engine.terminate()
        engine.wait(timeout=30)


# ---------------------------------------------------------------- models


@pytest.fixture
def kernels():
    """The native C++ kernels (kernels/native.py), which must build here: a C++ compiler is part of the set-up."""
    from kernels import native  # here, not at the top: tests/kernels must not import kernels before triton_mode

    built = native.library()
    assert built is not None, "the C++ kernels must build on this machine (a C++ compiler is part of the set-up)"
    return built


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from engines.builtin.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2's tokenizer (and chat template) saved as plain HF files: loads in a blink."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    path = Path(smollm2_gguf)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(directory)
    return directory


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    # SmolLM2's head geometry (head_dim 64, 9:3 GQA) and vocabulary, 2 layers. A wide init makes
    # the random model's greedy choices vary from token to token, so identity checks can fail.
    settings = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny random Llama as an HF checkpoint directory (safetensors + tokenizer)."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    for item in smollm2_tokenizer_dir.iterdir():
        shutil.copy(item, directory)
    return directory
