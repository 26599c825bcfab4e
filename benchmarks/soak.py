"""Soak: mixed traffic against a real `parrot serve` for N minutes while its engine is SIGKILLed now and then.

It launches `parrot serve` (gateway + builtin SmolLM2 engine, as benchmarks/apps.py does) and runs
``--clients`` concurrent clients, each looping over a mix of: plain chat, streamed chat, streamed
chat dropped by the client after its first chunk, a two-call semantic DAG (the parrot extension with
``wait: false``, the second call reading the first's output variable, then a variable read) and a
``/v1/semantic_calls`` template, and one of the attacks an adversarial probe once got through (#57: an
inline chain 100 calls deep, a call pinning a long prefix on a variable nobody produces, a 100 KB header,
HEAD, a lone surrogate, a registration under another spelling of the engine's address), each of which
must get its expected answer. Every ``--kill-every-s`` the engine process (a child of the gateway)
is SIGKILLed; the gateway must survive and its supervisor must bring the engine back.

Halfway between kills the clients pause ("quiet period"): once nothing is in flight and the engine
reports nothing running, KV blocks still in use are leaked blocks (every session is deleted by then).

Recorded: each request's kind, latency and error; errors are *expected* when a kill could explain
them (an engine-failure status 502/503/504/424, a stream's error event or a failed variable, in a
request overlapping the time from the kill until the engine is back plus a grace) and *unexpected*
otherwise; the gateway's RSS and the engine's KV blocks, sampled every ``--sample-s``. Written to
OUT.json and OUT.png (latency per kind over time, gateway RSS, KV blocks in use) and summarised.
Targets: 0 unexpected errors, flat gateway memory, 0 leaked blocks.

    python -m benchmarks.soak                                # 30 minutes, a kill every 5 minutes
    python -m benchmarks.soak --minutes 2 --kill-every-s 60  # a quick check
    python -m benchmarks.soak --engine-args "--quantization int8"
    python -m benchmarks.soak --replicas 2 --minutes 4 --kill-every-s 45  # replicas on Redis: benchmarks/soak_replicas.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
import psutil

from benchmarks.apps import LaunchedGateway
from benchmarks.results_file import save_figure

# Statuses and failures an engine killed mid-request (or still restarting) can cause; anything else,
# and any of these outside an outage, is unexpected.
ENGINE_FAILURES = {"http_502", "http_503", "http_504", "http_424", "stream_error", "variable_error"}
OUTAGE_GRACE_S = 5.0  # after the engine is back: heartbeats and in-flight retries settle
QUIET_TIMEOUT_S = 60.0  # for in-flight requests to end and the engine to report itself idle
TOPICS = ["rivers", "owls", "bread", "glaciers", "jazz", "comets", "tea", "bridges", "maps", "moss"]


class Failure(Exception):
    """A request that did not do what it should; ``kind`` groups it in the report."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail[:300]


@dataclass
class Outcome:
    kind: str
    start: float  # seconds since the run started
    seconds: float
    error: str | None = None
    detail: str = ""
    expected: bool | None = None  # for errors: whether an outage explains it


@dataclass
class Sample:
    t: float
    gateway_rss_mb: float
    engine_pid: int | None
    engine_healthy: bool
    blocks_total: int | None
    blocks_free: int | None
    running: int | None
    waiting: int | None
    in_flight: int


@dataclass
class Kill:
    t: float
    pid: int | None
    engine_id: str | None  # its registration, which a restarted engine does not share
    recovered_after_s: float | None = None


@dataclass
class QuietCheck:
    t: float
    blocks_in_use: int | None  # None: no engine to ask
    blocks_total: int | None
    idle: bool  # whether the engine reported nothing running and waiting before the timeout


@dataclass
class Record:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    quiet: list[QuietCheck] = field(default_factory=list)


# ---------------------------------------------------------------- traffic


def _check(response: httpx.Response, expected_status: int = 200) -> Any:
    if response.status_code != expected_status:
        try:
            code = response.json()["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise Failure("not_an_openai_error", f"{response.status_code}: {response.text}") from None
        raise Failure(f"http_{response.status_code}", f"{code}: {response.text}")
    return response.json()


class Traffic:
    """The request kinds, each one complete exchange that raises Failure when it goes wrong."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_tokens: int, var_timeout_s: float,
                 rng: random.Random):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.var_timeout_s, self.rng = var_timeout_s, rng
        self.kinds: dict[str, Callable[[], Awaitable[None]]] = {
            "chat": self.chat, "stream": self.stream, "disconnect": self.disconnect, "dag": self.dag,
            "semantic_call": self.semantic_call, "background": self.background, "probe": self.probe}
        self.attacks: dict[str, Callable[[], Awaitable[None]]] = {
            "nested_chain": self._nested_chain, "pinning": self._pinning, "huge_header": self._huge_header,
            "head": self._head, "lone_surrogate": self._lone_surrogate, "alias_registration": self._alias_registration}

    def _chat_body(self, content: str, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": content}], **extra}

    def _question(self) -> str:
        return f"Name one fact about {self.rng.choice(TOPICS)} (#{self.rng.randrange(10**6)})."

    async def chat(self) -> None:
        reply = _check(await self.client.post("/v1/chat/completions", json=self._chat_body(self._question())))
        if not reply["choices"] or reply["choices"][0]["message"].get("content") is None:
            raise Failure("bad_response", json.dumps(reply))

    async def stream(self, drop_after_first: bool = False) -> None:
        body = self._chat_body(self._question(), stream=True)
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                _check(response)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    raise Failure("stream_error", json.dumps(event["error"]))
                if drop_after_first:
                    return  # leaving the block closes the connection mid-stream
        raise Failure("stream_truncated", "the stream ended without [DONE]")

    async def disconnect(self) -> None:
        await self.stream(drop_after_first=True)

    async def _session(self) -> str:
        return _check(await self.client.post("/v1/sessions"), 201)["id"]

    async def _read(self, var_id: str) -> str:
        params = {"wait": "true", "timeout": self.var_timeout_s, "criteria": "latency"}
        variable = _check(await self.client.get(f"/v1/vars/{var_id}", params=params))
        if variable.get("error"):
            raise Failure("variable_error", variable["error"])
        if not variable["ready"] or variable.get("value") is None:
            raise Failure("variable_not_ready", json.dumps(variable))
        return variable["value"]

    async def dag(self) -> None:
        """Two calls submitted without waiting, the second reading the first's output, then one read."""
        session = await self._session()
        try:
            first = await self.client.post("/v1/chat/completions", json=self._chat_body(
                self._question(), parrot={"session_id": session, "wait": False, "output": "fact"}))
            fact = _check(first, 202)["parrot"]["output"]["id"]
            second = await self.client.post("/v1/chat/completions", json=self._chat_body(
                "Say this in three words: {{fact}}",
                parrot={"session_id": session, "wait": False, "vars": {"fact": {"id": fact}}}))
            await self._read(_check(second, 202)["parrot"]["output"]["id"])
        finally:
            await self._close(session)

    async def semantic_call(self) -> None:
        session = await self._session()
        try:
            call = await self.client.post("/v1/semantic_calls", json={
                "model": self.model, "session_id": session, "template": "Q: {{input:q}}\nA: {{output:a}}",
                "inputs": {"q": {"value": self._question()}},
                "outputs": {"a": {"max_tokens": self.max_tokens, "temperature": 0}}})
            await self._read(_check(call, 202)["outputs"]["a"]["id"])
        finally:
            await self._close(session)

    async def _close(self, session: str) -> None:
        _check(await self.client.delete(f"/v1/sessions/{session}"))

    async def background(self) -> None:
        """A background response polled until it ends, then deleted: it must complete (with replicas, run again by
        another one if its replica died)."""
        response = _check(await self.client.post("/v1/responses", json={
            "model": self.model, "input": self._question(), "max_output_tokens": self.max_tokens, "temperature": 0,
            "background": True}))
        deadline = time.monotonic() + self.var_timeout_s
        while response["status"] in ("queued", "in_progress"):
            if time.monotonic() > deadline:
                raise Failure("background_not_done", json.dumps(response))
            await asyncio.sleep(0.2)
            response = _check(await self.client.get(f"/v1/responses/{response['id']}"))
        if response["status"] not in ("completed", "incomplete"):  # incomplete: cut at max_output_tokens
            raise Failure(f"background_{response['status']}", json.dumps(response))
        _check(await self.client.delete(f"/v1/responses/{response['id']}"))

    # ------------------------------------------------------------ the probe's attacks (#57)

    async def probe(self) -> None:
        """One of the attacks, chosen at random; it must get the answer the fix gives it."""
        name = self.rng.choice(sorted(self.attacks))
        await self.attacks[name]()

    @staticmethod
    def _expect(name: str, response: httpx.Response, status: int, needle: str = "") -> None:
        if response.status_code != status or needle not in response.text:
            raise Failure(f"probe_{name}", f"expected {status} {needle!r}, got {response.status_code}: {response.text[:200]}")

    async def _nested_chain(self) -> None:
        binding: dict[str, Any] = {"value": "bottom"}
        for _ in range(100):
            binding = {"call": self._chat_body("step {{c}}", parrot={"vars": {"c": binding}})}
        response = await self.client.post("/v1/chat/completions", json=self._chat_body("top {{c}}", parrot={
            "vars": {"c": binding}}))
        self._expect("nested_chain", response, 400, "max_inline_depth")

    async def _pinning(self) -> None:
        """A long prefix pinned for a call whose input never comes; deleting its session ends it."""
        session = await self._session()
        try:
            never = _check(await self.client.post("/v1/vars", json={"session_id": session}), 201)["id"]
            system = " ".join(self.rng.choice(TOPICS) for _ in range(1400))
            body = self._chat_body("{{m}}", parrot={"session_id": session, "wait": False, "vars": {"m": {"id": never}}})
            body["messages"].insert(0, {"role": "system", "content": system})
            self._expect("pinning", await self.client.post("/v1/chat/completions", json=body), 202)
        finally:
            await self._close(session)

    async def _huge_header(self) -> None:
        response = await self.client.get("/v1/models", headers={"x-probe": "a" * 100_000})
        self._expect("huge_header", response, 431, "request_header_fields_too_large")

    async def _head(self) -> None:
        response = await self.client.head("/v1/models")
        self._expect("head", response, 200)
        if response.content or response.headers.get("x-content-type-options") != "nosniff":
            raise Failure("probe_head", f"a body of {len(response.content)} bytes, headers {dict(response.headers)}")

    async def _lone_surrogate(self) -> None:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
        response = await self.client.post("/v1/chat/completions", content=body,
                                          headers={"content-type": "application/json"})
        self._expect("lone_surrogate", response, 400, "surrogate")

    async def _alias_registration(self) -> None:
        """The engine's address spelled otherwise, without the gateway's secret: refused, never taken."""
        engines = _check(await self.client.get("/v1/engines"))
        port = engines[0]["url"].rsplit(":", 1)[1] if engines and engines[0]["url"] else "1"
        response = await self.client.post("/v1/engines", json={"name": "alias", "url": f"http://localhost:{port}",
                                                               "models": [self.model]})
        self._expect("alias_registration", response, 403, "engine_registration_disabled")


# ---------------------------------------------------------------- the run


class Soak:
    kinds: tuple[str, ...] = ()  # the request kinds the clients cycle through (none: every one of Traffic's)

    def __init__(self, gateway: LaunchedGateway, args: argparse.Namespace):
        self.gateway, self.args = gateway, args
        self.root = gateway.url.removesuffix("/v1")
        self.record = Record()
        self.started = time.monotonic()
        self.deadline = self.started + args.minutes * 60
        self.flowing = asyncio.Event()  # cleared during quiet periods
        self.flowing.set()
        self.in_flight = 0
        self.requests = 0
        self.engine: dict[str, Any] | None = None  # the last /v1/engines record of the builtin engine
        self.gateway_process = psutil.Process(gateway.process.pid)

    def now(self) -> float:
        return time.monotonic() - self.started

    def _over(self) -> bool:
        limit = self.args.max_requests
        return time.monotonic() >= self.deadline or bool(limit and self.requests >= limit)

    async def run(self) -> Record:
        limits = httpx.Limits(max_connections=self.args.clients + 4)
        async with httpx.AsyncClient(base_url=self.root, timeout=self.args.timeout, limits=limits) as client:
            monitor = asyncio.create_task(self._monitor(client))
            workers = [asyncio.create_task(self._client(client, k)) for k in range(self.args.clients)]
            await self._control(client)
            await asyncio.gather(*workers)
            await self._quiet_check(client)  # the end: everything done, every session deleted
            monitor.cancel()
        self._classify()
        return self.record

    async def _client(self, client: httpx.AsyncClient, number: int) -> None:
        traffic = Traffic(client, self.args.model, self.args.max_tokens, self.args.timeout / 2,
                          random.Random(self.args.seed * 1000 + number))
        kinds = list(self.kinds or traffic.kinds)
        turn = number  # each client cycles through every kind, starting at a different one
        while not self._over():
            await self.flowing.wait()
            if self._over():
                return
            kind = kinds[turn % len(kinds)]
            turn += 1
            self.requests += 1
            outcome = await self._timed(kind, traffic.kinds[kind])
            self.record.outcomes.append(outcome)
            if outcome.error:
                await asyncio.sleep(0.5)  # pacing: no hot loop of instant failures while the engine is gone

    async def _timed(self, kind: str, request: Callable[[], Awaitable[None]]) -> Outcome:
        start = time.monotonic()
        self.in_flight += 1
        error, detail = None, ""
        try:
            await request()
        except Failure as exc:
            error, detail = exc.kind, exc.detail
        except httpx.TimeoutException as exc:
            error, detail = "client_timeout", repr(exc)
        except httpx.HTTPError as exc:  # the gateway itself unreachable or broken: never expected
            error, detail = f"transport_{type(exc).__name__}", repr(exc)
        finally:
            self.in_flight -= 1
        return Outcome(kind, start - self.started, time.monotonic() - start, error, detail)

    async def _control(self, client: httpx.AsyncClient) -> None:
        """Quiet checks halfway between kills, kills every kill_every_s, until the time is up."""
        period = self.args.kill_every_s
        next_quiet, next_kill = period / 2, period
        while not self._over():
            due = min(next_quiet, next_kill)
            await asyncio.sleep(max(0.0, min(due - self.now(), self.deadline - time.monotonic(), 1.0)))
            if self._over():
                break
            if self.now() >= next_quiet:
                await self._quiet_check(client)
                next_quiet += period
            if self.now() >= next_kill:
                self._kill()
                next_kill += period

    def _kill(self) -> None:
        pid = self._engine_pid()
        self.record.kills.append(Kill(self.now(), pid, (self.engine or {}).get("id")))
        if pid is None:
            print(f"[{self.now():7.1f}s] kill: no engine process to kill", flush=True)
            return
        os.kill(pid, signal.SIGKILL)
        print(f"[{self.now():7.1f}s] SIGKILL engine pid {pid}", flush=True)

    def _engine_pid(self) -> int | None:
        """From /v1/engines when the gateway reports it, else the gateway's child running `engine`."""
        if self.engine and self.engine.get("pid"):
            return int(self.engine["pid"])
        try:
            children = self.gateway_process.children(recursive=True)
            return next((c.pid for c in children if "engine" in c.cmdline() and c.status() != "zombie"), None)
        except psutil.Error:
            return None

    async def _quiet_check(self, client: httpx.AsyncClient) -> None:
        """Pauses the clients until nothing is in flight and the engine reports itself idle; then any
        KV block in use is leaked (sessions are deleted by the requests that made them)."""
        self.flowing.clear()
        try:
            deadline = time.monotonic() + self.args.timeout + QUIET_TIMEOUT_S
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            idle, stats = await self._engine_idle(client)
            in_use = stats["blocks_total"] - stats["blocks_free"] if stats else None
            check = QuietCheck(self.now(), in_use, stats["blocks_total"] if stats else None, idle)
            self.record.quiet.append(check)
            print(f"[{self.now():7.1f}s] quiet: {in_use} KV blocks in use"
                  f"{'' if idle else ' (engine not idle or not there)'}", flush=True)
        finally:
            self.flowing.set()

    async def _engine_idle(self, client: httpx.AsyncClient) -> tuple[bool, dict[str, Any] | None]:
        """(idle, stats): two heartbeats in a row report nothing running or waiting."""
        deadline, idle_reports, stats = time.monotonic() + QUIET_TIMEOUT_S, 0, None
        while time.monotonic() < deadline:
            record = await self._engine_record(client)
            stats = record["stats"] if record else None
            quiet = bool(stats) and stats["running"] == 0 and stats["waiting"] == 0
            idle_reports = idle_reports + 1 if quiet else 0
            if idle_reports >= 2:
                return True, stats
            await asyncio.sleep(self.args.sample_s)
        return False, stats

    async def _engine_record(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        try:
            engines = (await client.get("/v1/engines", timeout=5)).json()
        except (httpx.HTTPError, ValueError):
            return None
        return next((e for e in engines if "contexts" in e.get("capabilities", [])), None) if isinstance(engines, list) else None

    async def _monitor(self, client: httpx.AsyncClient) -> None:
        while True:
            record = await self._engine_record(client)
            self.engine = record
            self._note_recovery(record)
            stats = (record or {}).get("stats") or {}
            try:
                rss = self.gateway_process.memory_info().rss / 2**20
            except psutil.Error:
                rss = float("nan")  # the gateway is gone: every request now fails, as unexpected
            self.record.samples.append(Sample(
                self.now(), rss, self._engine_pid() if record else None, bool(record and record.get("healthy")),
                stats.get("blocks_total"), stats.get("blocks_free"), stats.get("running"), stats.get("waiting"),
                self.in_flight))
            await asyncio.sleep(self.args.sample_s)

    def _note_recovery(self, record: dict[str, Any] | None) -> None:
        """The engine is back once a healthy one other than the killed one is registered."""
        if not self.record.kills or not record or not record.get("healthy"):
            return
        kill = self.record.kills[-1]
        if kill.recovered_after_s is None and record.get("id") != kill.engine_id:
            kill.recovered_after_s = self.now() - kill.t
            print(f"[{self.now():7.1f}s] engine back {kill.recovered_after_s:.1f}s after the kill", flush=True)

    def _classify(self) -> None:
        windows = []
        for kill in self.record.kills:
            back = kill.recovered_after_s if kill.recovered_after_s is not None else self.args.recovery_timeout_s
            windows.append((kill.t, kill.t + min(back, self.args.recovery_timeout_s) + OUTAGE_GRACE_S))
        for outcome in self.record.outcomes:
            if outcome.error is None:
                continue
            end = outcome.start + outcome.seconds
            overlaps = any(outcome.start <= stop and end >= begin for begin, stop in windows)
            outcome.expected = overlaps and outcome.error in ENGINE_FAILURES


# ---------------------------------------------------------------- report


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(record: Record, args: argparse.Namespace) -> dict[str, Any]:
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in record.outcomes:
        by_kind[outcome.kind].append(outcome)
    kinds = {}
    for kind, outcomes in sorted(by_kind.items()):
        ok = [o.seconds for o in outcomes if o.error is None]
        kinds[kind] = {"requests": len(outcomes), "ok": len(ok),
                       "expected_errors": sum(1 for o in outcomes if o.error and o.expected),
                       "unexpected_errors": sum(1 for o in outcomes if o.error and not o.expected),
                       "p50_s": _percentile(ok, 0.5), "p99_s": _percentile(ok, 0.99)}
    errors: dict[str, dict[str, int]] = defaultdict(lambda: {"expected": 0, "unexpected": 0})
    for outcome in record.outcomes:
        if outcome.error:
            errors[outcome.error]["expected" if outcome.expected else "unexpected"] += 1
    unexpected = [asdict(o) for o in record.outcomes if o.error and not o.expected]
    return {"kinds": kinds, "errors": dict(errors), "unexpected_examples": unexpected[:20],
            "kills": [asdict(k) for k in record.kills], "memory": _memory(record, args),
            "quiet_checks": [asdict(q) for q in record.quiet],
            "leaked_blocks_at_end": record.quiet[-1].blocks_in_use if record.quiet else None,
            "unexpected_errors": len(unexpected)}


def _memory(record: Record, args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's RSS: first, last, peak, and its growth per hour after a warm-up (a least-squares slope)."""
    points = [(s.t, s.gateway_rss_mb) for s in record.samples if s.gateway_rss_mb == s.gateway_rss_mb]
    if not points:
        return {}
    warm = [p for p in points if p[0] >= min(120.0, args.minutes * 60 / 4)] or points
    slope = statistics.linear_regression(*zip(*warm)).slope * 3600 if len(warm) > 1 else 0.0
    return {"rss_first_mb": points[0][1], "rss_last_mb": points[-1][1], "rss_peak_mb": max(p[1] for p in points),
            "rss_growth_mb_per_hour": slope}


def print_table(summary: dict[str, Any]) -> None:
    fmt = lambda s: "-" if s is None else f"{s * 1000:.0f}"  # noqa: E731
    print(f"\n{'kind':<14} {'requests':>8} {'ok':>6} {'expected':>9} {'unexpected':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for kind, row in summary["kinds"].items():
        print(f"{kind:<14} {row['requests']:>8} {row['ok']:>6} {row['expected_errors']:>9} "
              f"{row['unexpected_errors']:>10} {fmt(row['p50_s']):>8} {fmt(row['p99_s']):>8}")
    print("\nerrors by kind:", json.dumps(summary["errors"]) if summary["errors"] else "none")
    for kill in summary["kills"]:
        back = kill["recovered_after_s"]
        print(f"kill at {kill['t']:.0f}s (pid {kill['pid']}): "
              + (f"engine back after {back:.1f}s" if back is not None else "ENGINE NOT BACK"))
    memory = summary["memory"]
    if memory:
        print(f"gateway RSS: {memory['rss_first_mb']:.0f} MB first, {memory['rss_last_mb']:.0f} MB last, "
              f"{memory['rss_peak_mb']:.0f} MB peak, {memory['rss_growth_mb_per_hour']:+.1f} MB/hour after warm-up")
    print("KV blocks in use at quiet points:", [q["blocks_in_use"] for q in summary["quiet_checks"]])
    print(f"unexpected errors: {summary['unexpected_errors']}, "
          f"leaked blocks at the end: {summary['leaked_blocks_at_end']}")


def plot(record: Record, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, memory, blocks) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    end = max([s.t for s in record.samples] + [1.0])
    bucket = max(10.0, end / 20)
    for kind in sorted({o.kind for o in record.outcomes}):
        buckets: dict[int, list[float]] = defaultdict(list)
        for o in record.outcomes:
            if o.kind == kind and o.error is None:
                buckets[int(o.start // bucket)].append(o.seconds)
        xs = [(b + 0.5) * bucket for b in sorted(buckets)]
        line, = latency.plot(xs, [_percentile(buckets[b], 0.5) for b in sorted(buckets)], label=f"{kind} p50")
        latency.plot(xs, [_percentile(buckets[b], 0.99) for b in sorted(buckets)], ls=":", color=line.get_color())
    errors = [o for o in record.outcomes if o.error]
    for expected, marker in ((True, "x"), (False, "o")):
        chosen = [o for o in errors if bool(o.expected) == expected]
        latency.scatter([o.start for o in chosen], [o.seconds for o in chosen], marker=marker, color="red",
                        label=f"{'expected' if expected else 'unexpected'} errors ({len(chosen)})", zorder=3)
    latency.set_ylabel("seconds (p50 solid, p99 dotted)")
    latency.set_yscale("log")
    latency.legend(fontsize=7, ncol=3)
    memory.plot([s.t for s in record.samples], [s.gateway_rss_mb for s in record.samples])
    memory.set_ylabel("gateway RSS (MB)")
    in_use = [s.blocks_total - s.blocks_free if s.blocks_total is not None else float("nan") for s in record.samples]
    blocks.plot([s.t for s in record.samples], in_use, label="in use (sampled; gaps: no engine)")
    quiet = [q for q in record.quiet if q.blocks_in_use is not None]
    blocks.scatter([q.t for q in quiet], [q.blocks_in_use for q in quiet], color="black", zorder=3,
                   label="in use at quiet points (leaked)")
    blocks.set_ylabel("engine KV blocks")
    blocks.set_xlabel("seconds")
    blocks.legend(fontsize=7)
    for axes in (latency, memory, blocks):
        for kill in record.kills:
            axes.axvline(kill.t, color="red", alpha=0.4)
    latency.set_title(title, fontsize=9)
    save_figure(figure, path, dpi=110)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every-s", type=float, default=300.0, help="SIGKILL the engine this often")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=8, help="every generation's max_tokens")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    parser.add_argument("--timeout", type=float, default=120.0, help="HTTP timeout per request")
    parser.add_argument("--recovery-timeout-s", type=float, default=120.0,
                        help="errors later than this after a kill are unexpected even if the engine is not back")
    parser.add_argument("--sample-s", type=float, default=1.0, help="RSS and engine stats sampling interval")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--engine-args", default="", help="flags for the engine, e.g. '--quantization int8'")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for the server to load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=0, choices=(0, 2),
                        help="2: two gateway replicas on one Redis, replica A killed every --kill-every-s instead of "
                             "the engine (benchmarks/soak_replicas.py)")
    parser.add_argument("--lease-s", type=float, default=3.0, help="with --replicas: the calls' lease ([state] lease_s)")
    parser.add_argument("--out", default="benchmarks/results/soak", help="writes OUT.json, OUT.png, OUT.serve.log")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the launched server is stopped too
    if args.replicas:
        from benchmarks.soak_replicas import run_replicas

        run_replicas(args)
        return
    out = Path(args.out)
    print("launching parrot serve (builtin engine) …", flush=True)
    gateway = LaunchedGateway(args.model, args.engine_args.split(), out.with_suffix(".serve.log"), args.start_timeout)
    try:
        print(f"soaking {gateway.url} for {args.minutes:g} min, {args.clients} clients, "
              f"a kill every {args.kill_every_s:g}s", flush=True)
        record = asyncio.run(Soak(gateway, args).run())
        survived = gateway.process.poll() is None
    finally:
        gateway.close()
    summary = summarize(record, args) | {"gateway_survived": survived}
    print_table(summary)
    print(f"gateway process alive at the end: {survived}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "args": vars(args), "summary": summary, "samples": [asdict(s) for s in record.samples],
        "outcomes": [asdict(o) for o in record.outcomes]}, indent=1))
    plot(record, out.with_suffix(".png"), f"soak: {args.model}, {args.clients} clients, "
                                         f"kill every {args.kill_every_s:g}s")
    print(f"\nsaved {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
