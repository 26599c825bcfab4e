"""Noticing that an HTTP client went away (ASGI servers only say so through ``receive``), so that work
done for nobody stops: generation in an engine, a proxied request, a long wait on a variable."""

from __future__ import annotations

import asyncio

from litestar.types import Receive


async def disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected (its request body, if still unread, is consumed)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_done_or_disconnected(work: asyncio.Future, receive: Receive) -> None:
    """Waits for ``work``; if the client disconnects first, cancels it (nobody is left to answer)."""
    left = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
