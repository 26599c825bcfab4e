"""Loopback servers for tests: free ports, ASGI apps served by a real uvicorn in a background thread, and small
hand-written ASGI apps."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

import uvicorn

from benchmarks.fake_upstream import read_body
from http_plumbing.http_protocol import HttpProtocol


def free_port() -> int:
    """A loopback port nothing listens on right now (also what a dead server looks like). For a process started
    on it; a server in this process takes a socket bound to its port instead (serve_in_thread), so no other test
    process can take the port between the two."""
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


def _listening_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart on the same port
    sock.bind(("127.0.0.1", port))
    return sock


@contextlib.contextmanager
def serve_in_thread(app: Any, *, port: int | None = None, startup_timeout_s: float = 20.0) -> Iterator[str]:
    """Runs ``app`` under uvicorn on 127.0.0.1 (on ``port``, else a free one) until the block ends; yields
    its base URL (no trailing /)."""
    sock = _listening_socket(port or 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=2, loop="uvloop", http=HttpProtocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"uvicorn for {app!r} exited during startup")
            if time.monotonic() > deadline:
                server.should_exit = True
                raise TimeoutError(f"uvicorn for {app!r} did not start in {startup_timeout_s}s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


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
    return await read_body(receive)
