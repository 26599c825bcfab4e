"""Fences around the private parts of libraries the code relies on: when an upgrade renames or drops one,
the test named for it fails here, instead of a user's gateway failing (or silently slowing) at run time.

Each test names the place that relies on the private part. pyproject.toml bounds these libraries below their next
major version; torch is pinned, so its fences speak when the pin moves."""

from __future__ import annotations

import asyncio
import functools
import inspect

import pytest
import torch

from tests.support.servers import asgi_app, serve_in_thread
from tests.support import plain_http


def test_aiohttp_connector_builds_its_protocols_with_its_private_factory():
    """http_plumbing/aiohttp_transport.py replaces ``TCPConnector._factory`` to give the pool its own protocol;
    an aiohttp without that attribute would quietly keep its own (and the per-chunk parser re-entry)."""
    import aiohttp
    from aiohttp.client_proto import ResponseHandler

    async def factory_of_a_new_connector():
        connector = aiohttp.TCPConnector()
        try:
            return connector._factory
        finally:
            await connector.close()

    factory = asyncio.run(factory_of_a_new_connector())
    assert isinstance(factory, functools.partial) and factory.func is ResponseHandler


def test_aiohttp_response_handler_keeps_its_pause_flags_and_resume_reading():
    """http_plumbing/aiohttp_transport.py's ``_ResponseHandler.resume_reading`` reads ``_reading_paused`` and
    ``_buffer_paused`` (on a rename every call goes through to aiohttp again: correct, but the saving is gone)."""
    from aiohttp.client_proto import ResponseHandler

    handler = ResponseHandler(loop=asyncio.new_event_loop())
    try:
        assert handler._reading_paused is False and handler._buffer_paused is False
        assert "resume_parser" in inspect.signature(ResponseHandler.resume_reading).parameters
    finally:
        handler._loop.close()


def test_uvicorn_httptools_protocol_writes_a_response_head_on_its_own(monkeypatch):
    """http_plumbing/http_protocol.py subclasses uvicorn's internal ``HttpToolsProtocol`` (its ``loop`` attribute,
    its ``connection_made``) and holds a write that starts with ``HTTP/1.1 `` for the body's first bytes."""
    from http_plumbing import http_protocol

    writes: list[bytes] = []
    original = http_protocol._HeldHeadersTransport.write
    monkeypatch.setattr(http_protocol._HeldHeadersTransport, "write",
                        lambda self, data: writes.append(bytes(data)) or original(self, data))

    async def hello(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"hello"})

    with serve_in_thread(asgi_app(hello)) as url:
        assert plain_http.get(url).text == "hello"
    assert writes[0].startswith(http_protocol._RESPONSE_HEAD) and b"hello" not in writes[0], writes


def test_torch_cpu_feature_probes():
    """engines/builtin/cpu_linear.py (``cpu_has_fast_bf16``) and tests/kernels/conftest.py ask torch's private
    CPU probes whether the CPU has AVX-512 BF16 and AMX tiles."""
    assert isinstance(torch.cpu._is_avx512_bf16_supported(), bool)
    assert isinstance(torch.cpu._is_amx_tile_supported(), bool)


def test_torch_int4_cpu_operators():
    """engines/builtin/quantization.py's TorchInt4Linear packs and multiplies through aten's private int4 ops."""
    assert callable(torch.ops.aten._convert_weight_to_int4pack_for_cpu)
    assert callable(torch.ops.aten._weight_int4pack_mm_for_cpu)


def test_torch_operator_registry_listing():
    """kernels/native.py's ``operators_cache_tag`` lists the operators of its namespaces and their schemas."""
    library = torch.library.Library("parrot_fence", "DEF")
    library.define("probe(Tensor x, int n) -> Tensor")
    names = [name for name in torch._C._dispatch_get_all_op_names() if name.split("::")[0] == "parrot_fence"]
    assert names == ["parrot_fence::probe"]
    assert [str(schema) for schema in torch._C._jit_get_schemas_for_operator(names[0])] == [
        "parrot_fence::probe(Tensor x, int n) -> Tensor"]


@pytest.mark.slow  # importing inductor takes ~15 s
@pytest.mark.parametrize(("module", "setting"), [("torch._inductor.config", "freezing"),
                                                  ("torch._inductor.config", "emulate_precision_casts"),
                                                  ("torch._dynamo.config", "specialize_float")])
def test_torch_compile_settings(module, setting):
    """engines/builtin/compiled_model.py patches these settings of dynamo and inductor (``config.patch``)."""
    import importlib

    config = importlib.import_module(module)
    with config.patch(**{setting: getattr(config, setting)}):
        pass


@pytest.mark.model  # imports transformers: seconds
def test_transformers_rope_table():
    """engines/builtin/model.py's ``rope_inverse_frequencies`` takes scaled ropes from transformers' table."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert {"linear", "dynamic", "yarn", "llama3"} <= set(ROPE_INIT_FUNCTIONS)


def test_litestar_openapi_plugin_serves_the_document_it_holds():
    """gateway/server/openapi.py hands each new app the document made for the first one through
    ``OpenAPIPlugin._openapi``; a litestar that dropped it would build each one again (correct, but slow), and one
    that renamed the plugin's module fails the import."""
    from litestar import Litestar, get
    from litestar._openapi.plugin import OpenAPIPlugin

    @get("/")
    async def root() -> str:
        return ""

    held = Litestar([root]).openapi_schema  # another app's
    plugin = Litestar([root]).plugins.get(OpenAPIPlugin)
    plugin._openapi = held
    assert plugin.provide_openapi() is held
