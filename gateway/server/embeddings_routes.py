"""POST /v1/embeddings: passed through to an engine of the model that computes embeddings (an upstream marked
``embeddings = true``), with the chat path's auth, quotas, body limit, retries and metrics. A model served only
for chat (the builtin engine's) is a 400 naming it; an unknown model a 404."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, post
from litestar.datastructures import State

from gateway.auth import owner
from gateway.errors import body_error
from gateway.service import ENGINE_HEADER, Gateway
from http_plumbing.disconnect import CancelledOnDisconnect
from wire.openai import EmbeddingRequest

JSON = "application/json"


def parse_embedding(raw: bytes) -> tuple[EmbeddingRequest, dict]:
    """The body as a dict (forwarded with the fields the gateway does not know) and as its checked Struct."""
    try:
        body = msgspec.json.decode(raw)
        data = msgspec.convert(body, EmbeddingRequest)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise body_error(exc, raw) from None
    data.validate()
    return data, body


@post("/v1/embeddings", status_code=200)
async def create_embeddings(request: Request, state: State) -> Response:
    data, body = parse_embedding(await request.body())
    gateway: Gateway = state.gateway
    gateway.embedding_engines(data.model)  # 404 / 400 before a quota seat is taken
    answer = None
    async with state.quotas.admitted(owner(request)):
        async with CancelledOnDisconnect(request.receive):  # a client that leaves cancels the upstream request
            answer = await gateway.embed(data.model, body)
    if answer is None:
        return Response(b"", media_type=JSON)
    return Response(answer.body, media_type=JSON, headers={ENGINE_HEADER: answer.engine_id})


EMBEDDINGS_ROUTES = [create_embeddings]

