"""Golden SSE traces of the Responses and Messages streams (text, and a tool call whose arguments stream), usage
included, as the gateway sends them in front of the fake upstream: ids and times normalised, byte for byte
otherwise. PARROT_UPDATE_GOLDEN=1 rewrites them (review the diff)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.support.fake_upstream import MODEL

GOLDEN = Path(__file__).parent / "golden"
TOOL = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
CASES = {
    "responses_text": ("/v1/responses", {"input": "one two"}),
    "responses_tool": ("/v1/responses", {"input": "weather?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": TOOL}]}),
    "messages_text": ("/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": "one two"}]}),
    "messages_tool": ("/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": "weather?"}],
                                       "tools": [{"name": "get_weather", "input_schema": TOOL}]}),
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
    answer = httpx.post(f"{gateway_url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=10)
    assert answer.status_code == 200
    trace = normalised(answer.text)
    golden = GOLDEN / f"{case}.sse"
    if os.environ.get("PARROT_UPDATE_GOLDEN"):
        golden.write_text(trace)
    assert trace == golden.read_text()
