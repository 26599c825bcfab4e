"""The batch runner without HTTP: lines sharing their leading messages run group by group (a group's first line
alone, then the others, which then find the prefix in the engine's cache), within the concurrency bound, as
throughput work."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.batches.service import BatchService
from gateway.batches.store import BatchStorage
from gateway.state import MemoryStore
from gateway.config import FilesConfig, QuotasConfig
from gateway.quotas import Quotas
from gateway.service import Answer
from wire.batches import Batch, BatchCreate


class Record:
    in_flight = 0


class Registry:
    def __init__(self):
        self.record = Record()

    def records(self):
        return [self.record]


class StubGateway:
    """Records when each request started and ended, and what it was sent with."""

    def __init__(self):
        self.events: list[tuple[str, str, str]] = []  # (start|end, system prompt, user text)
        self.running = 0
        self.most_running = 0
        self.hints: list = []
        self.placements: list = []
        self.registry = Registry()  # one engine; requests in flight on it as the test sets them
        self.seconds = 0.01  # each request's time

    def check(self, request) -> None:
        pass

    async def create(self, route, model, body, hints=None, placement=None):
        system, user = body["messages"][0]["content"], body["messages"][-1]["content"]
        self.hints.append(hints)
        self.placements.append(placement)
        self.events.append(("start", system, user))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(self.seconds)
        self.running -= 1
        self.events.append(("end", system, user))
        return Answer(msgspec.json.encode({"choices": [{"message": {"content": user}}]}), "e")


def test_groups_run_their_first_line_alone_then_the_rest(tmp_path):
    async def run():
        gateway = StubGateway()
        storage = BatchStorage(MemoryStore())
        service = BatchService(gateway, storage, FilesConfig(batch_concurrency=3))  # type: ignore[arg-type]
        lines = [{"custom_id": f"{g}-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "messages": [{"role": "system", "content": f"shared prompt {g}"},
                                                      {"role": "user", "content": f"{g}-{i}"}]}}
                 for i in range(6) for g in "abc"]  # interleaved in the file
        return gateway, await completed(service, storage, lines)

    gateway, batch = asyncio.run(run())
    assert batch.request_counts.completed == 18
    for group in "abc":
        events = [(kind, user) for kind, system, user in gateway.events if system == f"shared prompt {group}"]
        first_end = events.index(("end", f"{group}-0"))
        starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
        assert starts[0] == 0 and starts[1] > first_end  # the leader ran alone, the others after it ended
    assert gateway.most_running <= 3
    assert all(h == {"criteria": "throughput", "priority": 0} for h in gateway.hints)
    assert all(p.latency is False and p.group == batch.id for p in gateway.placements)


def test_fewer_lines_run_while_live_requests_do(tmp_path):
    """With a live request in flight on an engine, at most batch_concurrency_beside_live lines run."""

    async def run():
        gateway = StubGateway()
        original = gateway.create

        async def create(*args, **kwargs):  # the record counts batch lines as the Gateway does
            gateway.registry.record.in_flight += 1
            try:
                return await original(*args, **kwargs)
            finally:
                gateway.registry.record.in_flight -= 1

        gateway.create = create
        gateway.registry.record.in_flight = 1  # a live request, for the whole batch
        storage = BatchStorage(MemoryStore())
        service = BatchService(gateway, storage, FilesConfig(batch_concurrency=4))  # type: ignore[arg-type]
        return gateway, await completed(service, storage, numbered_lines(8))

    gateway, batch = asyncio.run(run())
    assert batch.request_counts.completed == 8
    assert gateway.most_running == 1


@pytest.mark.parametrize("quiet_s, most_running", [(60.0, 1), (0.0, 4)])
def test_lines_stay_fewer_a_while_after_live_requests_end(tmp_path, quiet_s, most_running):
    """A client's calls one after another leave gaps of milliseconds between live requests: for
    batch_live_quiet_s after one was seen in flight, batch lines stay at batch_concurrency_beside_live (so the
    next call does not find the engine full of them); with no quiet time they fill their seats at once."""

    async def run():
        gateway = StubGateway()
        gateway.seconds = 0.2  # long enough for every waiting line to look again while one runs
        original = gateway.create
        live = [1]  # a live request in flight when the batch starts, which ends with the batch's first line

        async def create(*args, **kwargs):
            gateway.registry.record.in_flight += 1
            try:
                return await original(*args, **kwargs)
            finally:
                gateway.registry.record.in_flight -= 1 + (live.pop() if live else 0)

        gateway.create = create
        gateway.registry.record.in_flight = 1
        storage = BatchStorage(MemoryStore())
        config = FilesConfig(batch_concurrency=4, batch_live_quiet_s=quiet_s)
        service = BatchService(gateway, storage, config)  # type: ignore[arg-type]
        return gateway, await completed(service, storage, numbered_lines(6))

    gateway, batch = asyncio.run(run())
    assert batch.request_counts.completed == 6
    assert gateway.most_running == most_running


def numbered_lines(count: int) -> list[dict]:
    """``count`` chat lines of model "m", each a user message of its own number, nothing shared."""
    return [{"custom_id": f"{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"{i}"}]}} for i in range(count)]


async def completed(service: BatchService, storage: BatchStorage, lines: list[dict]) -> Batch:
    """``lines`` uploaded and run as a chat batch of "owner"; the batch once completed (or as it is after 30 s)."""
    file = await storage.put_file("owner", "in.jsonl", "batch", b"".join(json.dumps(l).encode() + b"\n" for l in lines))
    batch = await service.create("owner", BatchCreate(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                completion_window="24h"))
    for _ in range(3000):
        if (await service.get("owner", batch.id)).status == "completed":
            break
        await asyncio.sleep(0.01)
    return await service.get("owner", batch.id)


def test_a_batch_runs_within_its_keys_quotas(tmp_path):
    """A key allowed one request at a time gets one line at a time, however many the batch may run: a batch is no
    way past its key's limits (the lines over them wait for their retry-after, and all of them are answered)."""

    async def run():
        gateway = StubGateway()
        storage = BatchStorage(MemoryStore())
        quotas = Quotas(QuotasConfig(concurrent_requests=1))
        service = BatchService(gateway, storage, FilesConfig(batch_concurrency=4),  # type: ignore[arg-type]
                               quotas)
        return gateway, await completed(service, storage, numbered_lines(3))

    gateway, batch = asyncio.run(run())
    assert batch.request_counts.completed == 3
    assert gateway.most_running == 1
