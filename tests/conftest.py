"""Shared fixtures: ASGI apps served by a real uvicorn in a background thread, the fake OpenAI upstream, and
models: the real SmolLM2 GGUF and a tiny random Llama saved as an HF checkpoint (with SmolLM2's real
tokenizer beside it). What they are built from lives in tests/support/."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.support import fake_upstream, plain_http
from tests.support.markers import MARKS_OF_FIXTURES, marks_users
from tests.support.models import SMOLLM, tiny_llama_config
from tests.support.module_marks import deselects_whole_module
from tests.support.module_order import CpuMeter, ModuleTimer, longest_first
from tests.support.servers import free_port, serve_in_thread
from tests.support.waiting import wait_until

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests run two at a time (xdist) beside engine processes on two cores: more compute threads than cores. libgomp's
# threads spin at each barrier by default, and a spinning thread holds the core its descheduled peer needs, which
# made a 24-token request take 30 s instead of 1.9 s beside one busy process. Set here, before any test imports
# torch (libgomp reads it when loaded); engine processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# `parrot serve` compiles its engine by default (gateway/config.py, BuiltinConfig.compile), most of a minute a start
# here: the gateways the tests start run theirs eagerly; the compiled forward has tests of its own.
os.environ.setdefault("PARROT_ENGINE_COMPILE", "false")
# Gateways the tests start keep their state in memory unless a test names a store: the many gateways of one test
# process must not share the default SQLite file (gateway processes through PARROT_STATE, in-process ones here).
# PARROT_TEST_STATE runs the in-process ones on another store: "sqlite" (a file per test process) or a redis:// URL.
os.environ.setdefault("PARROT_STATE", "memory://")
import gateway.state  # noqa: E402

_test_state = os.environ.get("PARROT_TEST_STATE", "memory://")
gateway.state.UNCONFIGURED_URL = None if _test_state == "sqlite" else _test_state
if _test_state == "sqlite":  # each in-process gateway a file of its own (one gateway per file)
    import tempfile

    import msgspec

    import gateway.server.app

    _directory = tempfile.mkdtemp(prefix="parrot-test-state-")
    _open_store = gateway.state.open_store

    def _own_file(config):
        if config.url is None and config.path is None:
            config = msgspec.structs.replace(config, path=tempfile.mktemp(suffix=".sqlite3", dir=_directory))
        return _open_store(config)

    gateway.server.app.open_store = _own_file


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test module whose ``pytestmark`` the ``-m`` expression deselects whole is not imported: each xdist worker
    of `make test-fast` would otherwise import the model, process and Triton tests' libraries to deselect them."""
    if collection_path.name.startswith("test_") and collection_path.suffix == ".py":
        return deselects_whole_module(collection_path, config.option.markexpr) or None
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CpuMeter(), "parrot-cpu-meter")
    if not hasattr(config, "workerinput"):  # the controlling process sees every worker's reports
        config.pluginmanager.register(ModuleTimer(), "parrot-module-timer")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by markers
def pytest_collection_modifyitems(config, items):
    """Each test gets the markers of the fixtures it uses (tests/support/markers.py); a gpu test is skipped on a
    machine without a CUDA GPU (hardware, not a missing feature); modules go longest first
    (tests/support/module_order.py)."""
    for item in items:
        for fixture in item.fixturenames:
            for mark in MARKS_OF_FIXTURES.get(fixture, ()):
                item.add_marker(mark)
    if any(item.get_closest_marker("gpu") for item in items):
        import torch

        if not torch.cuda.is_available():
            for item in items:
                if item.get_closest_marker("gpu"):
                    item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    longest_first(config, items)


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


@pytest.fixture(scope="module")
@marks_users("subprocess")
def redis_server(tmp_path_factory) -> Iterator[Any]:
    """A real redis-server (or valkey-server) on a free loopback port for the module (tests/support/redis_server.py)."""
    from tests.support.redis_server import redis_server as started

    with started(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """``wait_until(condition, timeout_s=...)``: bounded polling for things that happen asynchronously."""
    return wait_until


@pytest.fixture(scope="session")
def fake_url(serve_session) -> str:
    """The fake OpenAI upstream's root URL (its API lives under /v1; tests/support/fake_upstream.py)."""
    return serve_session(fake_upstream.app)


# ---------------------------------------------------------------- the real default model behind a real gateway


@pytest.fixture(scope="session")
@marks_users("model", "subprocess")
def smollm_gateway(serve_session) -> Iterator[dict[str, str]]:
    """A gateway (in this process) and a builtin SmolLM2 engine process that registers with it and
    heartbeats, as `parrot serve` runs them. Yields {"gateway": url, "engine": url, "secret": the engine
    secret, which the engine's own routes require}; one per test session."""
    import os
    import subprocess
    import sys

    from gateway.server.app import create_app
    from gateway.config import BuiltinConfig, EnginesConfig, GatewayConfig

    secret = "smollm-engine-secret"
    config = GatewayConfig(builtin=BuiltinConfig(enabled=False),
                           engines=EnginesConfig(registration_secret=secret, heartbeat_timeout_s=60.0))
    gateway = serve_session(create_app(config))
    engine_port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "gateway.server.cli", "engine", "--port", str(engine_port), "--gateway-url", gateway,
         "--heartbeat-interval", "0.5"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_ENGINE_SECRET": secret})
    try:
        deadline = time.monotonic() + 300
        while SMOLLM not in plain_http.get(f"{gateway}/v1/models").text:
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
@marks_users("model")
def smollm2_source():
    """SmolLM2 where the engine reads it from: the GGUF converted once into an HF directory under ~/.cache/parrot
    (tests/engines/builtin/test_loader_cache.py checks it holds the GGUF's own weights and tokenizer). transformers
    loads that in seconds, where parsing the GGUF again takes tens in every pytest worker."""
    from engines.builtin.loader import ModelSource, cached_source

    return cached_source(ModelSource(None))


@pytest.fixture(scope="session")
@marks_users("model")
def smollm2_tokenizer_dir(tmp_path_factory, smollm2_source) -> Path:
    """SmolLM2's tokenizer (and chat template) alone, as plain HF files, to copy beside tiny random weights."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(smollm2_source.directory, **smollm2_source.hf_kwargs()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
@marks_users("model")
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
