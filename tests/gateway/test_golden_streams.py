"""Golden SSE traces of the Responses and Messages streams (text, and a tool call whose arguments stream), usage
included, as the gateway sends them in front of the fake upstream: ids and times normalised, byte for byte
otherwise. The ``*_tools_in_pieces`` cases replay an upstream that streams two tool calls with their arguments
cut mid-token (as vLLM's tool parsers do) and reports cached prompt tokens: where gateways lose arguments and
usage in translation. PARROT_UPDATE_GOLDEN=1 rewrites them (review the diff)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.support.fake_upstream import MODEL
from tests.support import plain_http

GOLDEN = Path(__file__).parent / "golden"
TOOL = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _chunk(delta: dict | None = None, finish_reason: str | None = None, **fields) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": choices,
            **fields}


def _arguments(index: int, piece: str, call_id: str | None = None) -> dict:
    """A chunk of tool call ``index``'s arguments; the call's first chunk (``call_id``) names it."""
    call: dict = {"index": index, "function": {"arguments": piece}}
    if call_id:
        call.update(id=call_id, type="function")
        call["function"]["name"] = "get_weather"
    return _chunk({"tool_calls": [call]})


PIECES = [
    _chunk({"role": "assistant", "content": ""}),
    _arguments(0, "", "call_a"),
    _arguments(0, '{"city": '), _arguments(0, '"Par'), _arguments(0, 'is"}'),
    _arguments(1, "", "call_b"),
    _arguments(1, '{"city": "Rome"}'),
    _chunk({}, "tool_calls"),
    _chunk(usage={"prompt_tokens": 40, "completion_tokens": 22, "total_tokens": 62,
                  "prompt_tokens_details": {"cached_tokens": 32}}),
]
CASES = {
    "responses_text": ("/v1/responses", {"input": "one two"}),
    "responses_tool": ("/v1/responses", {"input": "weather?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": TOOL}]}),
    "messages_text": ("/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": "one two"}]}),
    "messages_tool": ("/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": "weather?"}],
                                       "tools": [{"name": "get_weather", "input_schema": TOOL}]}),
    "chat_tools_in_pieces": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
        "stream_options": {"include_usage": True}, "fake": {"chunks": PIECES}}),
    "responses_tools_in_pieces": ("/v1/responses", {"input": "Weather in Paris and Rome?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": CITY}], "fake": {"chunks": PIECES}}),
    "messages_tools_in_pieces": ("/v1/messages", {
        "max_tokens": 32, "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
        "tools": [{"name": "get_weather", "input_schema": CITY}], "fake": {"chunks": PIECES}}),
}
_IDS = re.compile(r'\b(resp|msg|fc|call)_[0-9a-f]{32}\b')
_TIMES = re.compile(r'"created_at":\d+')


def normalised(trace: str) -> str:
    seen: dict[str, str] = {}

    def name(match: re.Match) -> str:
        return seen.setdefault(match.group(), f"{match.group(1)}_{len(seen)}")

    return _TIMES.sub('"created_at":0', _IDS.sub(name, trace))


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_matches_its_golden_trace(case, gateway_url):
    path, body = CASES[case]
    answer = plain_http.post(f"{gateway_url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=10)
    assert answer.status_code == 200
    trace = normalised(answer.text)
    golden = GOLDEN / f"{case}.sse"
    if os.environ.get("PARROT_UPDATE_GOLDEN"):
        golden.write_text(trace)
    assert trace == golden.read_text()
