"""The tests' fake OpenAI-compatible upstream: the benchmark's echoing fake (benchmarks/fake_upstream.py, whose
answers it gives) that tests can also steer and watch.

Behaviour is steered per request by the extra body field ``"fake": {...}`` (which the gateway forwards untouched
like any unknown field):
  words         number of content words to produce (default: echo the prompt)
  text          the answer's exact text instead
  delay_s       sleep before answering (timeouts)
  chunk_delay_s sleep between streamed chunks
  status        answer with this HTTP status and an OpenAI error body
  die_after     streaming: drop the connection after this many chunks (mid-stream failure)
  chunks        streaming: exactly these chat chunks (an upstream's own way of splitting tool calls and usage)
POST /v1/embeddings answers a deterministic unit vector per input (``embedding``), a token per word.
``GET /fake/stats`` reports requests seen (and abandoned by their client during a delay) and streams
opened/finished/cancelled, and the last request body: counters of this process, shared by every fake it serves.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import struct
from typing import Any

import msgspec

from benchmarks.fake_upstream import (MODELS, NOT_FOUND, ROUTES, chunks, completion, event, lifespan, read_body,
                                      send_json)

__all__ = ["CHAT", "MODEL", "app", "chunks", "completion"]

MODEL = "fake-model"  # what /v1/models lists (any name is answered)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}  # a chat body to send it directly

_stats = {"requests": 0, "requests_abandoned": 0, "streams_open": 0, "streams_done": 0, "streams_cancelled": 0,
          "last_body": None}


async def _watch_disconnect(receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _sleep_unless_gone(receive, seconds: float) -> bool:
    """Sleeps ``seconds``; False, at once, if the client disconnects meanwhile."""
    gone = asyncio.Event()
    watcher = asyncio.create_task(_watch_disconnect(receive, gone))
    try:
        await asyncio.wait_for(gone.wait(), seconds)
        return False
    except asyncio.TimeoutError:
        return True
    finally:
        watcher.cancel()


async def _stream(send, receive, body: dict[str, Any], fake: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    _stats["streams_open"] += 1
    # uvicorn's send() silently drops writes to a closed connection: only receive() tells that the client left.
    gone = asyncio.Event()
    watcher = asyncio.create_task(_watch_disconnect(receive, gone))
    try:
        for k, chunk in enumerate(fake.get("chunks") or chunks(body)):
            if gone.is_set():
                raise ConnectionResetError("the client closed the stream")
            if "die_after" in fake and k >= int(fake["die_after"]):
                raise ConnectionAbortedError("fake upstream drops the stream")
            await send({"type": "http.response.body", "body": event(chunk), "more_body": True})
            if fake.get("chunk_delay_s"):
                await asyncio.sleep(float(fake["chunk_delay_s"]))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        _stats["streams_done"] += 1
    except ConnectionResetError:
        _stats["streams_cancelled"] += 1  # the client left: nobody to answer
    except (asyncio.CancelledError, OSError):
        _stats["streams_cancelled"] += 1
        raise
    finally:
        watcher.cancel()


def embedding(text: str | list[int], dimensions: int = 8) -> list[float]:
    """A deterministic unit vector for an input (its bytes' hash): equal inputs embed equally."""
    digest = hashlib.sha256(str(text).encode()).digest()
    vector = [b / 255 - 0.5 for b in digest[:dimensions]]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def embeddings(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI embeddings answer: one vector per input, a token a word (or a token id)."""
    inputs = body["input"]
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    dimensions = int(body.get("dimensions") or 8)
    data = [{"object": "embedding", "index": i, "embedding": embedding(text, dimensions)}
            for i, text in enumerate(inputs)]
    tokens = sum(len(text.split()) if isinstance(text, str) else len(text) for text in inputs)
    if body.get("encoding_format") == "base64":
        for item in data:
            item["embedding"] = base64.b64encode(struct.pack(f"<{dimensions}f", *item["embedding"])).decode()
    return {"object": "list", "data": data, "model": body["model"],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/fake/stats":
        return await send_json(send, 200, _stats)
    if method == "GET" and path == "/v1/models":
        return await send_json(send, 200, MODELS)
    if method != "POST" or path not in (*ROUTES, "/v1/embeddings"):
        return await send_json(send, 404, NOT_FOUND)
    body = msgspec.json.decode(await read_body(receive))
    _stats["requests"] += 1
    _stats["last_body"] = body
    fake = body.get("fake") or {}
    if fake.get("delay_s") and not await _sleep_unless_gone(receive, float(fake["delay_s"])):
        _stats["requests_abandoned"] += 1  # the client (a gateway) gave up on this request
        return
    if fake.get("status"):
        return await send_json(send, int(fake["status"]), {"error": {
            "message": "fake upstream error", "type": "invalid_request_error", "param": None, "code": "fake"}})
    if path == "/v1/embeddings":
        return await send_json(send, 200, embeddings(body))
    if body.get("stream"):
        return await _stream(send, receive, body, fake)
    await send_json(send, 200, completion(body))
