"""The Batch API's runner: a batch's lines run as throughput-criteria work beside live traffic.

Each line goes through the same checks and engines as a live request of its endpoint, with ``criteria:
"throughput"`` (the builtin engine serves latency-critical work first; an upstream with priority scheduling gets
the low priority) and a placement that says so. At most ``[files] batch_concurrency`` lines of all batches are in
flight at once. Lines whose requests share their leading messages (chat: all but the last message; completions:
the prompt's first 256 characters) are grouped: a group's first line runs alone, then the rest, so the engine
computes the shared prefix once and the others find it in its prefix cache. A bad line goes to the error file, the
rest run. Files, batches and each line's result live in the state store (store.py) as they finish: a batch
interrupted by a restart resumes its remaining lines when the gateway starts again, and one whose replica died is
taken over by another (``resume``). The replica running a batch holds its lease (gateway/state/leases.py), so one
runs it at a time."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from engines.seam import EngineError
from gateway.batches.store import BatchStorage, StoredBatch, batch_lease, new_batch_id
from gateway.config import FilesConfig, QuotasConfig
from gateway.domain_errors import DomainError, Invalid, RateLimited
from gateway.errors import APIError, body_error, domain_error_body, domain_status
from gateway.scheduler import Placement
from gateway.quotas import Admission, Quotas
from gateway.service import REQUEST_SCHEMAS, Gateway
from gateway.state import every
from gateway.state.leases import Leases
from http_plumbing.http_errors import engine_error_body
from wire.batches import (Batch, BatchCreate, BatchErrorItem, BatchErrors, LineError, LineResponse, OutputLine,
                          RequestCounts)
from wire.errors import InvalidRequest
from wire.openai import EmbeddingRequest, ErrorBody, new_id

log = logging.getLogger("parrot.batches")

THROUGHPUT = {"criteria": "throughput", "priority": 0}  # the scheduling hints of every batch line
PREFIX_CHARS = 256
_RUNNING = ("validating", "in_progress", "finalizing")
_DONE = ("failed", "completed", "expired", "cancelled")


def _now() -> int:
    return int(time.time())


def line_id(batch_id: str, index: int) -> str:
    """A line's result id, the same across a restart (so the lines already answered are known)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def _group_key(endpoint: str, body: Any) -> str | None:
    """What a line shares with others of its group: the model and its leading messages (chat) or prompt start."""
    if not isinstance(body, dict):
        return None
    if endpoint == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        return msgspec.json.encode([body.get("model"), body["messages"][:-1]]).decode()
    if endpoint == "/v1/completions" and isinstance(body.get("prompt"), str):
        return msgspec.json.encode([body.get("model"), body["prompt"][:PREFIX_CHARS]]).decode()
    return None


class BatchService:
    def __init__(self, gateway: Gateway, storage: BatchStorage, config: FilesConfig, quotas: Quotas | None = None,
                 lease_s: float = 10.0):
        self.gateway = gateway
        self.storage = storage
        self.leases = Leases(storage.store, lease_s)  # of the batches this process runs
        self._resumer: asyncio.Task[None] | None = None
        self.config = config
        self.quotas = quotas or Quotas(QuotasConfig())  # unlimited
        self._slots = asyncio.Semaphore(config.batch_concurrency)  # lines of all batches in flight
        self._tasks: dict[str, asyncio.Task] = {}
        self._in_flight = 0  # batch lines on the engines now
        self._live_seen_at = float("-inf")  # when live requests were last seen in flight (time.monotonic)
        self._save_lock = asyncio.Lock()

    # ------------------------------------------------------------ the API

    async def create(self, owner: str, request: BatchCreate) -> Batch:
        file = await self.storage.file(owner, request.input_file_id)
        if file.purpose != "batch":
            raise Invalid(f"file {file.id} was uploaded for purpose {file.purpose!r}, not 'batch'",
                          param="input_file_id")
        lines = await self._lines(owner, request.input_file_id)
        if not lines:
            raise Invalid("the input file holds no request lines", param="input_file_id")
        if len(lines) > self.config.max_batch_lines:
            raise Invalid(f"the input file holds {len(lines)} lines, above this server's limit of "
                          f"{self.config.max_batch_lines}", param="input_file_id")
        now = _now()
        batch = Batch(id=new_batch_id(), endpoint=request.endpoint, input_file_id=file.id,
                      completion_window=request.completion_window, status="in_progress", created_at=now,
                      in_progress_at=now, expires_at=now + 24 * 3600, metadata=request.metadata,
                      request_counts=RequestCounts(total=len(lines)))
        stored = StoredBatch(owner=owner, batch=batch)
        await self.storage.save_batch(stored, self.leases.write_op(batch_lease(batch.id)))
        self._start(stored)
        return batch

    async def get(self, owner: str, batch_id: str) -> Batch:
        return (await self.storage.batch(owner, batch_id)).batch

    async def list(self, owner: str) -> list[Batch]:
        return [s.batch for s in await self.storage.all_batches(owner)]

    async def cancel(self, owner: str, batch_id: str) -> Batch:
        stored = await self.storage.batch(owner, batch_id)
        if stored.batch.status in _DONE:
            if stored.batch.status == "cancelled":
                return stored.batch
            raise Invalid(f"batch {batch_id} is {stored.batch.status}: it cannot be cancelled", param="batch_id")
        stored.batch.status = "cancelling"
        stored.batch.cancelling_at = _now()
        await self.storage.save_batch(stored)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif await self.leases.take(batch_lease(batch_id)):  # nobody runs it; else its replica ends it
            await self._finish(stored, "cancelled")
        return (await self.storage.batch(owner, batch_id)).batch

    async def in_progress(self) -> list[Batch]:
        """Every key's running batches (the dashboard's progress)."""
        return [s.batch for s in await self.storage.all_batches() if s.batch.status in (*_RUNNING, "cancelling")]

    def start(self) -> None:
        """Resumes the batches a previous process left (then, on a shared store, those of replicas that die)."""
        self.leases.start()
        if self.storage.store.shared:  # and then those of replicas that die
            work = every(min(2.0, self.leases.lease_s / 2), self.resume, "resuming batches")
        else:  # this process alone runs batches: once, at start
            work = self.resume()
        self._resumer = asyncio.get_running_loop().create_task(work, name="batch-takeovers")

    async def resume(self) -> int:
        """Starts again the running batches nobody runs (a previous process, or a replica that died, left
        them; their lines not yet answered); finishes those left cancelling. Returns how many were resumed."""
        resumed = 0
        for stored in await self.storage.all_batches():
            status, batch_id = stored.batch.status, stored.batch.id
            if (status not in (*_RUNNING, "cancelling") or batch_id in self._tasks
                    or not await self.leases.take(batch_lease(batch_id))):
                continue
            if status == "cancelling":
                await self._finish(stored, "cancelled")
            else:
                log.info("resuming batch %s", batch_id)
                self._start(stored)
                resumed += 1
        return resumed

    async def aclose(self) -> None:
        """Stops the running batches where they are (on shutdown): they resume on the next start, or on another
        replica now (their leases released)."""
        if self._resumer is not None:
            self._resumer.cancel()
        tasks = [*self._tasks.values(), *([self._resumer] if self._resumer else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.leases.aclose()

    # ------------------------------------------------------------ running

    async def _lines(self, owner: str, file_id: str) -> list[bytes]:
        return [line for line in (await self.storage.content(owner, file_id)).splitlines() if line.strip()]

    def _start(self, stored: StoredBatch) -> None:
        task = asyncio.create_task(self._run(stored), name=f"batch {stored.batch.id}")
        self._tasks[stored.batch.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(stored.batch.id, None))

    async def _run(self, stored: StoredBatch) -> None:
        batch = stored.batch
        closing = False
        try:
            results = await self.storage.results(batch.id)
            answered = results["out"].keys() | results["err"].keys()
            lines = await self._lines(stored.owner, batch.input_file_id)
            batch.request_counts = RequestCounts(total=len(lines), completed=len(results["out"]),
                                                 failed=len(results["err"]))
            groups: dict[str | None, list[tuple[int, Any]]] = {}
            seen: set[str] = set()
            for index, raw in enumerate(lines):
                if index in answered:
                    continue
                try:
                    item = msgspec.json.decode(raw)
                except msgspec.DecodeError as exc:
                    await self._record(stored, index, None, error=LineError(code="invalid_json",
                                                                            message=f"line {index + 1}: {exc}"))
                    continue
                custom_id = item.get("custom_id") if isinstance(item, dict) else None
                if isinstance(custom_id, str) and custom_id in seen:
                    await self._record(stored, index, custom_id, error=LineError(
                        code="duplicate_custom_id", message=f"line {index + 1}: custom_id {custom_id!r} is not unique"))
                    continue
                if isinstance(custom_id, str):
                    seen.add(custom_id)
                key = _group_key(batch.endpoint, item.get("body") if isinstance(item, dict) else None)
                groups.setdefault(key if key is not None else f"#{index}", []).append((index, item))
            await asyncio.gather(*(self._group(stored, members) for members in groups.values()))
            closing = True
            await self._finish(stored, "completed")
        except asyncio.CancelledError:
            current = (await self.storage.batch(stored.owner, batch.id)).batch
            if current.status == "cancelling":  # cancelled by its owner; else the gateway stops: resumed later
                await self._finish(stored, "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - a batch that cannot run fails, with the reason
            if closing:
                raise
            log.exception("batch %s failed", batch.id)
            batch.errors = BatchErrors(data=[BatchErrorItem(code="batch_failed", message=str(exc))])
            await self._finish(stored, "failed")

    async def _group(self, stored: StoredBatch, members: list[tuple[int, Any]]) -> None:
        """The group's first line alone (it leaves the shared prefix in the engine's cache), then the others."""
        first, *rest = members
        await self._line(stored, *first)
        await asyncio.gather(*(self._line(stored, index, item) for index, item in rest))

    async def _line(self, stored: StoredBatch, index: int, item: Any) -> None:
        batch = stored.batch
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        problem = _line_problem(item, batch.endpoint, index)
        if problem is not None:
            await self._record(stored, index, custom_id if isinstance(custom_id, str) else None,
                               error=LineError(code="invalid_request", message=problem))
            return
        async with self._slots:
            await self._beside_live()
            admission = await self._admission(stored.owner)
            self._in_flight += 1
            try:
                async with self.quotas.holding(admission):
                    status, body = await self._send(batch.endpoint, dict(item["body"]), batch.id)
            finally:
                self._in_flight -= 1
                self._live_lately()  # notes the live requests this line ran beside
        await self._record(stored, index, custom_id,
                           response=LineResponse(status_code=status, request_id=new_id("req"), body=body))

    async def _admission(self, owner: str) -> Admission | None:
        """The line admitted as a request of its key, under the key's rate and concurrency quotas: over them it
        waits for the retry-after, so a batch is no way past its key's limits."""
        while True:
            try:
                return await self.quotas.admitted_later(owner)
            except RateLimited as exc:
                await asyncio.sleep(exc.retry_after_s or 1)

    def live_in_flight(self) -> int:
        """Requests on the engines now that are not batch lines."""
        return max(0, sum(r.in_flight for r in self.gateway.registry.records()) - self._in_flight)

    async def _beside_live(self) -> None:
        """Waits while live requests run (or ran within ``batch_live_quiet_s``) and already
        ``batch_concurrency_beside_live`` batch lines do: live traffic shares the engines with fewer batch lines
        than an idle gateway gives them."""
        while self._live_lately() and self._in_flight >= self.config.batch_concurrency_beside_live:
            await asyncio.sleep(0.02)

    def _live_lately(self) -> bool:
        """Whether live requests are in flight now or were seen within ``batch_live_quiet_s`` (they are looked
        for as lines start and end, and while lines wait)."""
        now = time.monotonic()
        if self.live_in_flight() > 0:
            self._live_seen_at = now
            return True
        return now - self._live_seen_at < self.config.batch_live_quiet_s

    async def _send(self, endpoint: str, body: dict[str, Any], batch_id: str) -> tuple[int, Any]:
        """A line's request as a live one of ``endpoint`` would run, as throughput work: its status and body."""
        placement = Placement(latency=False, group=batch_id)
        try:
            if endpoint == "/v1/embeddings":
                request = msgspec.convert(body, EmbeddingRequest)
                request.validate()
                answer = await self.gateway.embed(request.model, body, placement)
            else:
                route = endpoint.removeprefix("/v1/")
                data = msgspec.convert(body, REQUEST_SCHEMAS[route])  # type: ignore[index]
                if data.parrot is not None:
                    raise Invalid("a batch line takes no `parrot` extension", param="body.parrot")
                self.gateway.check(data)
                answer = await self.gateway.create(route, data.model, body, hints=THROUGHPUT,  # type: ignore[arg-type]
                                                   placement=placement)
            return 200, msgspec.json.decode(answer.body)
        except msgspec.ValidationError as exc:
            error = body_error(exc)
            return error.status_code, _error(error.body)
        except InvalidRequest as exc:
            return 400, _error(ErrorBody(message=str(exc), type="invalid_request_error", param=exc.param))
        except APIError as exc:
            return exc.status_code, _error(exc.body)
        except DomainError as exc:
            return domain_status(exc), _error(domain_error_body(exc))
        except EngineError as exc:
            return exc.status_code, _error(engine_error_body(exc))
        except msgspec.DecodeError:
            return 502, _error(ErrorBody(message="the engine's answer was not JSON", type="api_error",
                                         code="upstream_error"))

    async def _record(self, stored: StoredBatch, index: int, custom_id: str | None, *,
                      response: LineResponse | None = None, error: LineError | None = None) -> None:
        batch = stored.batch
        ok = response is not None and response.status_code < 400
        line = OutputLine(id=line_id(batch.id, index), custom_id=custom_id, response=response, error=error)
        await self.storage.put_result(batch.id, "out" if ok else "err", index, msgspec.json.encode(line))
        if ok:
            batch.request_counts.completed += 1
        else:
            batch.request_counts.failed += 1
        async with self._save_lock:
            current = (await self.storage.batch(stored.owner, batch.id)).batch
            if current.status == "cancelling" and batch.status != "cancelling":
                batch.status, batch.cancelling_at = current.status, current.cancelling_at
                task = self._tasks.get(batch.id)
                if task is not None:  # cancelled on another replica: it ends here, as cancelled
                    task.cancel()
            await self.storage.save_batch(stored)

    async def _finish(self, stored: StoredBatch, status: str) -> None:
        """The batch's end: its result lines become its output and error files."""
        batch = stored.batch
        now = _now()
        batch.finalizing_at = batch.finalizing_at or now
        results = await self.storage.results(batch.id)
        out, err = (list(dict(sorted(results[kind].items())).values()) for kind in ("out", "err"))
        batch.request_counts.completed, batch.request_counts.failed = len(out), len(err)
        if out:
            batch.output_file_id = (await self.storage.put_file(stored.owner, f"{batch.id}_output.jsonl",
                                                                "batch_output", b"".join(line + b"\n" for line in out))).id
        if err:
            batch.error_file_id = (await self.storage.put_file(stored.owner, f"{batch.id}_error.jsonl", "batch_output",
                                                               b"".join(line + b"\n" for line in err))).id
        batch.status = status  # type: ignore[assignment]
        setattr(batch, f"{status}_at", now)
        await self.storage.save_batch(stored, self.leases.release_op(batch_lease(batch.id)))


def _error(body: ErrorBody) -> dict[str, Any]:
    return {"error": msgspec.to_builtins(body)}


def _line_problem(item: Any, endpoint: str, index: int) -> str | None:
    """Why a line cannot be sent at all (it then has an ``error`` and no response), or None."""
    at = f"line {index + 1}"
    if not isinstance(item, dict):
        return f"{at}: a request line is a JSON object"
    if not isinstance(item.get("custom_id"), str) or not item["custom_id"]:
        return f"{at}: custom_id must be a non-empty string"
    if item.get("method", "POST") != "POST":
        return f"{at}: method must be POST"
    if item.get("url") != endpoint:
        return f"{at}: url {item.get('url')!r} is not the batch's endpoint {endpoint}"
    if not isinstance(item.get("body"), dict):
        return f"{at}: body must be a JSON object"
    if item["body"].get("stream"):
        return f"{at}: a batch line is not streamed (stream: true)"
    return None
