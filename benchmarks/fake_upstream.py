"""A fast fake OpenAI-compatible server: a raw ASGI app (no framework) for the gateway overhead benchmark, and the
answers it gives, which the tests' steerable fake (tests/support/fake_upstream.py) gives too.

It echoes the last user message (or prompt) as "echo: ...", or, with the extra body field ``"fake": {"words": N}``
(which a gateway forwards untouched like any unknown field), N words, or with ``{"text": T}`` T; with tools it
calls the first one.

Run alone: python -m benchmarks.fake_upstream --port 9000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

MODELS = {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake"}]}
ROUTES = ("/v1/chat/completions", "/v1/completions")
NOT_FOUND = {"error": {"message": "not found", "type": "invalid_request_error", "param": None, "code": None}}


def _words(body: dict[str, Any]) -> list[str]:
    fake = body.get("fake") or {}
    if "words" in fake:
        return [f"w{i}" for i in range(int(fake["words"]))]
    if "text" in fake:  # exactly this text (as words: streamed one by one)
        return str(fake["text"]).split(" ")
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


def event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


async def read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def send_json(send, status: int, payload: Any) -> None:
    data = msgspec.json.encode(payload)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def lifespan(receive, send) -> None:
    """Acknowledges an ASGI lifespan's startup and shutdown."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/v1/models":
        return await send_json(send, 200, MODELS)
    if method != "POST" or path not in ROUTES:
        return await send_json(send, 404, NOT_FOUND)
    body = msgspec.json.decode(await read_body(receive))
    if not body.get("stream"):
        return await send_json(send, 200, completion(body))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
    for chunk in chunks(body):
        await send({"type": "http.response.body", "body": event(chunk), "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


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
