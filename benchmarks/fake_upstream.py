"""A fast fake OpenAI-compatible server: a raw ASGI app (no framework), for tests and the overhead benchmark.

It echoes the last user message. Behaviour is steered per request by an extra body field
``"fake": {...}`` (which the gateway forwards untouched like any unknown field):
  delay_s       sleep before answering (timeouts)
  chunk_delay_s sleep between streamed chunks
  words         number of content words to produce (default: echo the prompt)
  status        answer with this HTTP status and an OpenAI error body
  die_after     streaming: drop the connection after this many chunks (mid-stream failure)
``GET /fake/stats`` reports requests seen (and abandoned by their client during a delay) and streams
opened/finished/cancelled, for tests.

Run alone: python -m benchmarks.fake_upstream --port 9000
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import msgspec

_stats = {"requests": 0, "requests_abandoned": 0, "streams_open": 0, "streams_done": 0, "streams_cancelled": 0,
          "last_body": None}


def _words(body: dict[str, Any]) -> list[str]:
    fake = body.get("fake") or {}
    if "words" in fake:
        return [f"w{i}" for i in range(int(fake["words"]))]
    if "messages" in body:
        last = body["messages"][-1].get("content") or ""
        if isinstance(last, list):
            last = "".join(p.get("text", "") for p in last)
    else:
        prompt = body.get("prompt", "")
        last = prompt if isinstance(prompt, str) else str(prompt[0])
    return ("echo: " + last).split(" ")


def _tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    if not body.get("tools") or body.get("tool_choice") == "none":
        return None
    name = body["tools"][0]["function"]["name"]
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": '{"x": 1}'}}


def _usage(body: dict[str, Any], words: list[str], n: int) -> dict[str, int]:
    prompt = len(msgspec.json.encode(body.get("messages") or body.get("prompt"))) // 4
    return {"prompt_tokens": prompt, "completion_tokens": len(words) * n, "total_tokens": prompt + len(words) * n}


def completion(body: dict[str, Any]) -> dict[str, Any]:
    words, n, chat = _words(body), int(body.get("n") or 1), "messages" in body
    text = " ".join(words)
    tool = _tool_call(body) if chat else None
    if chat:
        message = {"role": "assistant", "content": None if tool else text}
        if tool:
            message["tool_calls"] = [tool]
        choices = [{"index": i, "message": message, "finish_reason": "tool_calls" if tool else "stop",
                    "logprobs": None} for i in range(n)]
    else:
        prompts = body["prompt"] if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str) else [0]
        choices = [{"index": i, "text": text, "finish_reason": "stop", "logprobs": None}
                   for i in range(n * len(prompts))]
    return {"id": "fake-1", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": body.get("model"), "choices": choices, "usage": _usage(body, words, n)}


def chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    words, n, chat = _words(body), int(body.get("n") or 1), "messages" in body
    base = {"id": "fake-1", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": body.get("model")}
    out = []
    tool = _tool_call(body) if chat else None
    for i in range(n):
        if chat:
            out.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
        if tool:
            out.append({**base, "choices": [{"index": i, "delta": {"tool_calls": [{"index": 0, **tool}]},
                                             "finish_reason": None}]})
        else:
            for j, word in enumerate(words):
                piece = word if j == 0 else " " + word
                choice = {"index": i, "delta": {"content": piece}} if chat else {"index": i, "text": piece}
                out.append({**base, "choices": [{**choice, "finish_reason": None}]})
        last = {"index": i, "delta": {}} if chat else {"index": i, "text": ""}
        out.append({**base, "choices": [{**last, "finish_reason": "tool_calls" if tool else "stop"}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({**base, "choices": [], "usage": _usage(body, words, n)})
    return out


async def _read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _send_json(send, status: int, payload: Any) -> None:
    data = msgspec.json.encode(payload)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


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
        for k, chunk in enumerate(chunks(body)):
            if gone.is_set():
                raise ConnectionResetError("the client closed the stream")
            if "die_after" in fake and k >= int(fake["die_after"]):
                raise ConnectionAbortedError("fake upstream drops the stream")
            await send({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(chunk) + b"\n\n",
                        "more_body": True})
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


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/fake/stats":
        return await _send_json(send, 200, _stats)
    if method == "GET" and path == "/v1/models":
        return await _send_json(send, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model",
                                                                        "created": 0, "owned_by": "fake"}]})
    if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
        return await _send_json(send, 404, {"error": {"message": "not found", "type": "invalid_request_error",
                                                      "param": None, "code": None}})
    body = msgspec.json.decode(await _read_body(receive))
    _stats["requests"] += 1
    _stats["last_body"] = body
    fake = body.get("fake") or {}
    if fake.get("delay_s") and not await _sleep_unless_gone(receive, float(fake["delay_s"])):
        _stats["requests_abandoned"] += 1  # the client (a gateway) gave up on this request
        return
    if fake.get("status"):
        return await _send_json(send, int(fake["status"]), {"error": {
            "message": "fake upstream error", "type": "invalid_request_error", "param": None, "code": "fake"}})
    if body.get("stream"):
        return await _stream(send, receive, body, fake)
    await _send_json(send, 200, completion(body))


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools")


if __name__ == "__main__":
    main()
