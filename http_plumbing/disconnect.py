"""Noticing that an HTTP client went away (ASGI servers only say so through ``receive``), so that work
done for nobody stops: generation in an engine, a proxied request, a long wait on a variable."""

from __future__ import annotations

import asyncio

from litestar.types import Receive


async def disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected (its request body, if still unread, is consumed)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class CancelledOnDisconnect:
    """``async with CancelledOnDisconnect(receive) as watch:`` runs the block in the request's own task
    and cancels it if the client disconnects; afterwards ``watch.disconnected`` tells which happened
    (the cancellation itself does not propagate).

    The watch, a task waiting on ``receive``, starts only once the block has run for ``after_s``: a
    disconnect matters for work that goes on (generation), and the many short requests of a busy
    gateway then never pay for the task (a sizeable share of its CPU for a proxied request)."""

    def __init__(self, receive: Receive, after_s: float = 0.05):
        self._receive = receive
        self._after_s = after_s
        self._left: asyncio.Future | None = None

    @property
    def disconnected(self) -> bool:
        return self._left is not None and self._left.done() and not self._left.cancelled()

    async def __aenter__(self) -> "CancelledOnDisconnect":
        self._task = asyncio.current_task()
        self._timer = asyncio.get_running_loop().call_later(self._after_s, self._watch)
        return self

    def _watch(self) -> None:
        self._left = asyncio.ensure_future(disconnected(self._receive))
        self._left.add_done_callback(self._cancel)

    def _cancel(self, left: asyncio.Future) -> None:
        if not left.cancelled():
            self._task.cancel()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self._timer.cancel()
        if self._left is not None:
            self._left.remove_done_callback(self._cancel)
            self._left.cancel()
        if exc_type is asyncio.CancelledError and self.disconnected and self._task.cancelling() <= 1:
            self._task.uncancel()
            return True  # the client left: nothing to answer
        return False
