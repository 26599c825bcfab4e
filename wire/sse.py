"""Server-sent events as OpenAI streams use them: one ``data: PAYLOAD`` line per event, ``[DONE]`` last."""

from __future__ import annotations

_DONE = b"[DONE]"


def sse_event(payload: bytes) -> bytes:
    """One server-sent event. Payloads are compact single-line JSON (or ``[DONE]``), so an event is just
    ``data: PAYLOAD`` and a blank line; framing it here avoids a general encoder's per-event line splitting."""
    return b"data: " + payload + b"\n\n"


SSE_DONE = sse_event(_DONE)


def _canonical(block: bytes) -> bool:
    """Whether complete events are already framed as we send them: each one ``data: PAYLOAD`` line.
    (Every newline is then in a ``\\n\\ndata: `` between events or in the final ``\\n\\n``: two scans.)"""
    return (block.startswith(b"data: ") and b"\r" not in block
            and 2 * block.count(b"\n\ndata: ") + 2 == block.count(b"\n"))


def _reframed(block: bytes) -> bytes:
    """Complete events re-framed as ``data: PAYLOAD\\n\\n``; comments, ids and event names dropped."""
    out = []
    for event in block.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(sse_event(line[5:].strip()))
    return b"".join(out)


class SSEFramer:
    """An SSE byte stream re-framed as ``data: PAYLOAD\\n\\n`` events, up to ``[DONE]``: ``feed`` takes
    each read and returns all the complete events it ends (passed through as read when already so
    framed, as engines send them). Comments, ids and event names are dropped; CRLF is accepted.
    After ``[DONE]``, ``done`` is set and reads are ignored unparsed (the caller drains them, so that
    the connection goes back to the pool). A plain object rather than a generator: one async layer
    less per token on the gateway's hottest path."""

    __slots__ = ("_buffer", "done")

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        if self.done:
            return b""
        buffer = self._buffer + chunk if self._buffer else chunk
        end = max(buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n"))
        if end < 0:
            self._buffer = buffer
            return b""
        end += 4 if buffer.startswith(b"\r\n\r\n", end) else 2
        block, self._buffer = buffer[:end], buffer[end:]
        at = block.find(_DONE)
        if at >= 6 and block.startswith(b"data: ", at - 6) and block.startswith(b"\n", at + 6) and (
                at == 6 or block[at - 7] == 10):  # a whole "data: [DONE]" line
            self.done, block = True, block[:at - 6]
        elif at >= 0:  # written some other way ("data:[DONE]", CRLF), or inside a payload
            block, self.done = _until_done(block)
        return block if _canonical(block) else _reframed(block)


def _until_done(block: bytes) -> tuple[bytes, bool]:
    """The events before a ``[DONE]`` event, and whether there was one."""
    lines = block.replace(b"\r\n", b"\n").split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:") and line[5:].strip() == _DONE:
            return b"\n".join(lines[:i]), True
    return block, False
