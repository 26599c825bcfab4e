"""Mixed traffic on one engine whose KV cache cannot hold everything: the maps of a map-reduce (a
throughput task group) give their KV up to chat requests (latency-critical), never the other way round.
Real gateway and engine (a tiny random Llama) on loopback; preemptions are read from the engine's stats."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engines.builtin.config import EngineConfig

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

MODEL = "tiny"
MAPS, CHATS = 6, 2
# A map ends with 5 blocks of KV (30 for all six), a chat with 13; the cache holds 36 (576 tokens, room
# for the reduce's prompt): chats arriving while the maps run need blocks the maps hold.
MAP_TOKENS, CHAT_TOKENS, NUM_BLOCKS = 64, 200, 36


@pytest.fixture(scope="module")
def urls(tiny_model_dir, engine_behind_gateway) -> dict[str, str]:
    config = EngineConfig(model=str(tiny_model_dir), num_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=8,
                          latency_max_num_seqs=2)
    return engine_behind_gateway(config, MODEL)


def completion(prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


@pytest.mark.timeout(180)
def test_chat_takes_kv_from_map_work_and_is_never_preempted_for_it(urls, wait_until):
    with httpx.Client(base_url=urls["gateway"], timeout=120) as gw, httpx.Client(base_url=urls["engine"]) as engine:
        before = engine.get("/v1/stats").json()
        session = gw.post("/v1/sessions").json()["id"]
        maps = []
        for i in range(MAPS):
            queued = gw.post("/v1/completions", json=completion("Summarize: {{part}}", MAP_TOKENS, parrot={
                "session_id": session, "wait": False, "output": f"s{i}",
                "vars": {"part": {"value": f"part {i} of the yearly report"}}}))
            assert queued.status_code == 202, queued.text
            maps.append(queued.json()["parrot"]["output"]["id"])
        reduce = gw.post("/v1/completions", json=completion(
            "Combine: " + " ".join(f"{{{{s{i}}}}}" for i in range(MAPS)), 8,
            parrot={"session_id": session, "wait": False, "output": "final", "criteria": "throughput",
                    "vars": {f"s{i}": {"id": var} for i, var in enumerate(maps)}}))
        assert reduce.status_code == 202, reduce.text
        # The maps hold most of the cache before the chats arrive.
        wait_until(lambda: (stats := engine.get("/v1/stats").json())["running"] >= 2 and stats["blocks_free"] <= 12,
                   timeout_s=60, interval_s=0.01)
        chats_start = engine.get("/v1/stats").json()
        with ThreadPoolExecutor(CHATS) as pool:
            chats = list(pool.map(lambda i: gw.post("/v1/completions", json=completion(f"Hello number {i}, how are you?",
                                                                                      CHAT_TOKENS)), range(CHATS)))
        chats_end = engine.get("/v1/stats").json()
        final = gw.get(f"/v1/vars/{reduce.json()['parrot']['output']['id']}",
                       params={"wait": "true", "timeout": 120}).json()
        gw.delete(f"/v1/sessions/{session}")
        after = engine.get("/v1/stats").json()
    assert [chat.status_code for chat in chats] == [200] * CHATS
    assert all(chat.json()["usage"]["completion_tokens"] == CHAT_TOKENS for chat in chats)
    assert final["ready"] and final["error"] is None, final
    assert chats_end["num_preemptions"] > chats_start["num_preemptions"], "the chats never lacked room: nothing was tested"
    assert after["latency_preemptions"] == before["latency_preemptions"], "a chat request was preempted"
