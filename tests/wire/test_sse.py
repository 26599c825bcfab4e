"""Re-framing an upstream's SSE bytes: already-framed reads pass through, anything else is normalised."""

from __future__ import annotations

import pytest

from wire.sse import SSEFramer

A, B = b'{"choices":[{"delta":{"content":"a"}}]}', b'{"choices":[{"delta":{"content":"[DONE]"}}]}'


def reframed(*reads: bytes) -> list[bytes]:
    framer = SSEFramer()
    return [events for events in map(framer.feed, reads) if events]


def test_framed_reads_pass_through_whole_up_to_done():
    assert reframed(b"data: " + A + b"\n\ndata: " + B + b"\n\n", b"data: [DONE]\n\ndata: late\n\n") == [
        b"data: " + A + b"\n\ndata: " + B + b"\n\n"]


def test_an_event_split_across_reads_is_sent_once_complete():
    event = b"data: " + A + b"\n\n"
    assert reframed(event[:7], event[7:-1], event[-1:] + event[:3], event[3:]) == [event, event]


@pytest.mark.parametrize("stream", [
    b"data:" + A + b"\r\n\r\n: keep-alive\r\n\r\ndata:[DONE]\r\n\r\n",
    b"event: chunk\nid: 1\ndata: " + A + b"\n\ndata:  [DONE]\n\n",
    b"data: " + A + b"\n\n\n\ndata: [DONE]\n\n",
])
def test_other_framings_are_normalised(stream):
    assert b"".join(reframed(stream)) == b"data: " + A + b"\n\n"


def test_done_inside_a_payload_does_not_end_the_stream():
    assert b"".join(reframed(b"data: " + B + b"\n\n", b"data: " + A + b"\n\ndata: [DONE]\n\n")) == (
        b"data: " + B + b"\n\ndata: " + A + b"\n\n")


def test_a_line_that_only_starts_with_done_is_an_event():
    assert reframed(b"data: [DONE]x\n\ndata: " + A + b"\n\ndata: [DONE]\n\n") == [
        b"data: [DONE]x\n\ndata: " + A + b"\n\n"]
