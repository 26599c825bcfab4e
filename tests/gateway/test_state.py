"""The state seam (gateway/state/): every store keeps the same contract, on a real redis-server for Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.config import StateConfig, load_config
from gateway.state import MemoryStore, StoreUnavailable, open_store
from gateway.state.sqlite import SQLiteStore


@pytest.fixture(params=["memory", "sqlite", pytest.param("redis", marks=pytest.mark.subprocess)])
async def store(request, tmp_path: Path):
    if request.param == "memory":
        made = MemoryStore()
    elif request.param == "sqlite":
        made = SQLiteStore(tmp_path / "state.sqlite3")
    else:
        from gateway.state.redis_store import RedisStore

        server = request.getfixturevalue("redis_server")
        made = RedisStore(server.url, prefix=f"test-{request.node.name}:")
    await made.start()
    try:
        yield made
    finally:
        await made.aclose()


async def test_records_keep_their_fields_and_expire(store):
    assert await store.read("r") == {}
    await store.write("r", {"a": b"1", "b": b"2"})
    await store.write("r", {"b": b"3"})
    assert await store.read("r") == {"a": b"1", "b": b"3"}
    assert await store.read_field("r", "b") == b"3" and await store.read_field("r", "z") is None
    assert await store.write_new("r", "a", b"9") == b"1"
    assert await store.write_new("r", "c", b"4") == b"4"
    await store.remove_fields("r", ["a"])
    assert await store.read("r") == {"b": b"3", "c": b"4"}
    await store.write("short", {"x": b"1"}, ttl_s=0.2)
    await store.expire("r", 0.2)
    await asyncio.sleep(0.35)
    assert await store.read("short") == {} and await store.read("r") == {}
    await store.write("gone", {"x": b"1"})
    await store.remove(["gone"])
    assert await store.read("gone") == {}


async def test_a_lease_is_held_by_one_holder_until_released_or_expired(store):
    assert await store.lease("lease", "a", 0.3)
    assert await store.lease("lease", "a", 0.3)  # renewed by its holder
    assert not await store.lease("lease", "b", 0.3)
    await store.apply([("remove_if", "lease", "holder", b"b")])  # not b's to release
    assert not await store.lease("lease", "b", 0.3)
    await store.apply([("remove_if", "lease", "holder", b"a")])
    assert await store.lease("lease", "b", 0.3)
    await asyncio.sleep(0.45)  # b died without releasing it: it expires
    assert await store.lease("lease", "a", 10)
    taken = await asyncio.gather(*(store.lease("race", f"h{i}", 10) for i in range(20)))
    assert sum(taken) == 1


async def test_a_bucket_admits_up_to_its_capacity_then_refills(store):
    taken = [await store.take("bucket", 3, 10.0, 1, 1) for _ in range(4)]
    assert [ok for ok, _ in taken] == [True, True, True, False]
    await asyncio.sleep(0.15)  # refills 1.5
    assert (await store.take("bucket", 3, 10.0, 1, 1))[0]
    ok, level = await store.take("debt", 5, 0.001, 20, float("-inf"))  # charged after the fact: into debt
    assert ok and level == pytest.approx(-15, abs=0.01)
    assert not (await store.take("debt", 5, 0.001, 0, 1))[0]


async def test_a_bounded_set_drops_its_oldest_members_beyond_its_count_or_bytes(store):
    keep = lambda member, size: store.keep("kept", member, size, 3, 100, 60)  # noqa: E731
    assert [await keep(m, 10) for m in "abc"] == [[], [], []]
    assert await keep("d", 10) == ["a"]  # four members: the oldest goes
    assert await keep("b", 10) == []  # counted again: now the newest (c, d, b)
    assert await keep("e", 75) == ["c"]  # four members and 105 bytes: then d, b, e: 95
    await store.forget("kept", ["b"])
    assert await keep("f", 90) == ["d", "e"]  # 175 bytes, then 165, then f alone
    assert await keep("g", 20) == ["f"]
    assert await keep("h", 200) == ["g"]  # over the bytes alone, but never dropped for itself
    await asyncio.sleep(0.2)
    assert await store.keep("kept", "i", 10, 3, 100, 0.1) == []  # h forgotten: not counted again within the TTL
    assert await store.keep("kept", "j", 10, 1, 100, 60) == ["i"]


async def test_seats_are_counted_up_to_their_limit(store):
    assert [await store.seat("seats", 2, 60) for _ in range(3)] == [True, True, False]
    await store.unseat("seats")
    assert await store.seat("seats", 2, 60)
    assert await store.seat("unlimited", None, 60)


async def test_a_published_message_reaches_the_subscriber(store):
    got = asyncio.Queue()
    store.subscribe("wake", got.put_nowait)
    if hasattr(store, "_subscribed"):
        await asyncio.sleep(0.2)  # the subscription is on the server
    await store.publish("wake", b"var_1")
    assert await asyncio.wait_for(got.get(), 5) == b"var_1"


async def test_a_bucket_holds_exactly_under_concurrent_takers(store):
    results = await asyncio.gather(*(store.take("race", 10, 0.001, 1, 1) for _ in range(50)))
    assert sum(ok for ok, _ in results) == 10


@pytest.mark.subprocess
async def test_a_redis_store_that_is_down_raises_unavailable(tmp_path):
    from gateway.state.redis_store import RedisStore
    from tests.support.servers import free_port

    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(StoreUnavailable) as raised:
        await store.ping()
    assert raised.value.code == "state_unavailable"
    await store.aclose()


def test_the_store_is_named_by_file_env_or_flag(tmp_path: Path):
    assert load_config(env={}).state == StateConfig()
    assert load_config(env={"PARROT_STATE": "redis://h:1/0"}).state.url == "redis://h:1/0"
    assert load_config(env={"PARROT_STATE": str(tmp_path / "s.db")}).state.path == str(tmp_path / "s.db")
    from gateway.server.cli import _serve_parser, config_from_args

    config = config_from_args(_serve_parser().parse_args(["--state", "valkey://h:2/1"]))
    assert config.state.url == "valkey://h:2/1"
    assert isinstance(open_store(StateConfig(path=str(tmp_path / "x.db"))), SQLiteStore)
    with pytest.raises(Exception):
        load_config(env={"PARROT_STATE": "mysql://h"})


async def test_a_batch_of_writes_is_applied_in_order(store):
    got = asyncio.Queue()
    store.subscribe("batch", got.put_nowait)
    if hasattr(store, "_subscribed"):
        await asyncio.sleep(0.2)
    await store.write("pointer", {"s": b"one"})
    await store.apply([("write", "a", {"x": b"1", "y": b"2"}, 60.0), ("remove_fields", "a", ["y"]),
                       ("write", "b", {"x": b"1"}, None), ("remove", ["b"]), ("expire", "a", 30.0),
                       ("remove_if", "pointer", "s", b"two"), ("publish", "batch", b"done")])
    assert await store.read("a") == {"x": b"1"} and await store.read("b") == {}
    assert await store.read("pointer") == {"s": b"one"}
    await store.apply([("remove_if", "pointer", "s", b"one")])
    assert await store.read("pointer") == {}
    assert await asyncio.wait_for(got.get(), 5) == b"done"
    many = {f"f{i}": str(i).encode() for i in range(2500)}  # more than one command's worth of arguments
    await store.apply([("write", "wide", many, 60.0), *(("write", f"k{i}", {"x": b"1"}, None) for i in range(1500)),
                       ("remove_fields", "wide", [f"f{i}" for i in range(2400)]),
                       ("remove", [f"k{i}" for i in range(1499)])])
    assert await store.read("wide") == {f"f{i}": str(i).encode() for i in range(2400, 2500)}
    assert await store.read("k1498") == {} and await store.read("k1499") == {"x": b"1"}


async def test_one_gateway_per_sqlite_file(tmp_path: Path):
    first = SQLiteStore(tmp_path / "state.sqlite3")
    await first.start()
    second = SQLiteStore(tmp_path / "state.sqlite3")
    with pytest.raises(RuntimeError, match="another gateway process uses the state file"):
        await second.start()
    await first.aclose()
    await second.start()  # once the first let go
    await second.aclose()
