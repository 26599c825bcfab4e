"""A batch through the openai SDK on a real gateway in front of a real builtin engine process on SmolLM2-135M: lines
sharing a system prompt make the engine compute that prompt once, counted by the engine's own prompt and
prefix-hit counters (its /v1/stats), not by what the gateway reports. The gateway runs the group's first line
alone and the rest after it (tests/gateway/test_batch_runner.py checks that order); the builtin engine would also
share the prompt's blocks between lines admitted in one step, so this checks the issue's target end to end (its
prefix cache kept and hit across the batch), not the order."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests.support.models import SMOLLM
from tests.support import plain_http

# Loads a model in an engine process (through its fixtures): marked here as well, so that `make test-fast` leaves
# the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.model, pytest.mark.subprocess]

# Its own words first, so no earlier test of the session left it in the engine's prefix cache.
SYSTEM = ("Batch prefix test. You are a careful assistant for a travel agency. Answer every question in one short "
          "sentence, name the country when you name a city, never invent prices, and say so when you do not know. ") * 3
LINES = 24


def engine_counters(engine: dict[str, str]) -> tuple[int, int]:
    """(prompt tokens, of which found in the prefix cache), as the engine counts them."""
    stats = plain_http.get(f"{engine['engine']}/v1/stats", headers={"authorization": f"Bearer {engine['secret']}"},
                      timeout=30).json()
    return stats["prompt_tokens"], stats["prefix_hit_tokens"]


def test_lines_sharing_a_system_prompt_compute_it_once(smollm_gateway):
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": SMOLLM, "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Name a city worth visiting, number {i}."}]}}
             for i in range(LINES)]
    with openai.OpenAI(base_url=f"{smollm_gateway['gateway']}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        prompt_before, hits_before = engine_counters(smollm_gateway)
        upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 600
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
        assert (batch.status, batch.request_counts.completed) == ("completed", LINES), batch
        usages = [json.loads(line)["response"]["body"]["usage"]
                  for line in client.files.content(batch.output_file_id).text.splitlines()]
    prompt_after, hits_after = engine_counters(smollm_gateway)
    computed = (prompt_after - prompt_before) - (hits_after - hits_before)
    # The shared prompt's tokens the cache can serve (whole blocks): the most any line found cached.
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages]
    shared = max(cached)
    assert shared >= 128, usages  # most of the ~200-token system prompt came from the cache
    own = sum(u["prompt_tokens"] - shared for u in usages)  # each line's tokens past the shared prompt
    assert computed - own < 2 * shared, (computed, own, shared)  # the shared prompt computed once, not per line
