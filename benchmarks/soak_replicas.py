"""Soak with gateway replicas (``python -m benchmarks.soak --replicas 2``): two `parrot serve` processes sharing one
redis-server and one builtin engine (its own process, an upstream of both), steady traffic spread over them by a
round-robin load balancer in the client, and replica A SIGKILLed and started again every ``--kill-every-s``.

The balancer is what one in front of replicas does: it routes new requests to replicas that are up (A is marked
down from its kill until it answers /health/live again) and retries a request whose connection was refused on the
other. Traffic: plain chat, streamed chat, a two-call semantic DAG (``wait: false``, then the second output read,
maybe on the other replica), a ``/v1/semantic_calls`` template and a background response polled until it ends. A
call or background response A ran when it died is taken over by B when its lease expires (``--lease-s``), so reads
of its output succeed and the response completes.

Expected errors: a transport error of a request in flight when A was killed (its connection dies with A). Anything
else is unexpected: a failed or lost variable, a 5xx, a read that times out. Memory: B's RSS (never killed) over
the run. Written to OUT.json and OUT.png, as soak.py writes its own.

    flock /tmp/parrot-bench.lock python -m benchmarks.soak --replicas 2 --minutes 4 --kill-every-s 45
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.soak import Kill, Record, Sample, Soak, print_table, summarize
from benchmarks.results_file import write_results, save_figure

KINDS = ("chat", "stream", "dag", "semantic_call", "background")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_live(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{process.args} did not come up at {url} (exit {process.poll()})")
        time.sleep(0.2)


class Replica:
    def __init__(self, name: str, engine_url: str, state_url: str, model: str, lease_s: float, log: Path):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "gateway.server.cli", "serve", "--no-builtin", "--port", str(self.port),
                        "--upstream", f"{model}={engine_url}/v1", "--state", state_url, "--log-level", "warning"]
        self.env = {**os.environ, "PARROT_STATE_LEASE_S": str(lease_s)}
        self.log = log
        self.process: subprocess.Popen | None = None
        self.up = False

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=out)
        wait_live(f"{self.url}/health/live", self.process, 120)
        self.up = True

    def kill(self) -> None:
        self.up = False
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.up = False
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class Balancer(httpx.AsyncBaseTransport):
    """Round robin over the replicas that are up; a refused connection is retried on the next one."""

    def __init__(self, replicas: list[Replica], limits: httpx.Limits):
        self.replicas = replicas
        self.inner = httpx.AsyncHTTPTransport(limits=limits)
        self.turn = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for _ in range(2 * len(self.replicas)):
            up = [r for r in self.replicas if r.up] or self.replicas
            replica = up[self.turn % len(up)]
            self.turn += 1
            request.url = request.url.copy_with(port=replica.port)
            try:
                return await self.inner.handle_async_request(request)
            except httpx.ConnectError:
                await asyncio.sleep(0.1)  # nothing was sent: safe on another replica
        raise httpx.ConnectError("no replica accepted the connection", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ReplicaSoak(Soak):
    """soak.py's clients and their records, over the balancer; replica A killed instead of the engine."""

    kinds = KINDS

    def __init__(self, replicas: list[Replica], args: argparse.Namespace):  # noqa: super().__init__ launches none
        self.replicas, self.args = replicas, args
        self.record = Record()
        self.started = time.monotonic()
        self.deadline = self.started + args.minutes * 60
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.in_flight = 0
        self.requests = 0

    async def run(self) -> Record:
        limits = httpx.Limits(max_connections=self.args.clients * 4)
        balancer = Balancer(self.replicas, limits)
        async with httpx.AsyncClient(base_url=self.replicas[0].url, timeout=self.args.timeout,
                                     transport=balancer) as client:
            monitor = asyncio.create_task(self._monitor())
            workers = [asyncio.create_task(self._client(client, k)) for k in range(self.args.clients)]
            await self._kill_and_restart()
            await asyncio.gather(*workers)
            monitor.cancel()
        self._classify()
        return self.record

    async def _kill_and_restart(self) -> None:
        victim = self.replicas[0]
        while time.monotonic() + self.args.kill_every_s < self.deadline:
            await asyncio.sleep(self.args.kill_every_s)
            pid = victim.process.pid if victim.process else None
            victim.kill()
            kill = Kill(self.now(), pid, victim.name)
            self.record.kills.append(kill)
            print(f"[{self.now():7.1f}s] SIGKILL replica {victim.name} (pid {pid})", flush=True)
            await asyncio.to_thread(victim.start)
            kill.recovered_after_s = self.now() - kill.t
            print(f"[{self.now():7.1f}s] replica {victim.name} back after {kill.recovered_after_s:.1f}s", flush=True)
        await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))

    async def _monitor(self) -> None:
        survivor = psutil.Process(self.replicas[1].process.pid)
        while True:
            try:
                rss = survivor.memory_info().rss / 2**20
            except psutil.Error:
                rss = float("nan")
            self.record.samples.append(Sample(self.now(), rss, None, True, None, None, None, None, 0))
            await asyncio.sleep(self.args.sample_s)

    def _classify(self) -> None:
        """A transport error of a request in flight at a kill is expected: its connection died with the replica."""
        for outcome in self.record.outcomes:
            if outcome.error is None:
                continue
            end = outcome.start + outcome.seconds
            outcome.expected = outcome.error.startswith("transport_") and "Timeout" not in outcome.error and any(
                outcome.start <= kill.t <= end + 0.5 for kill in self.record.kills)


def run_replicas(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="parrot-soak-replicas-"))
    redis_port, engine_port = free_port(), free_port()
    binary = shutil.which("redis-server") or shutil.which("valkey-server") or "redis-server"
    log = out.with_suffix(".serve.log")
    processes = [subprocess.Popen([binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(scratch)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    with open(log, "ab") as engine_log:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "gateway.server.cli", "engine", "--port", str(engine_port),
             "--served-model-name", args.model, *args.engine_args.split()],
            env={k: v for k, v in os.environ.items() if k != "PARROT_ENGINE_SECRET"}, stdout=engine_log,
            stderr=engine_log))
    engine_url = f"http://127.0.0.1:{engine_port}"
    replicas = [Replica(name, engine_url, f"redis://127.0.0.1:{redis_port}/0", args.model, args.lease_s, log)
                for name in ("A", "B")]
    try:
        wait_live(f"{engine_url}/health", processes[1], args.start_timeout)
        for replica in replicas:
            replica.start()
        print(f"soaking replicas {[r.url for r in replicas]} for {args.minutes:g} min, {args.clients} clients, "
              f"replica A killed every {args.kill_every_s:g}s (lease {args.lease_s:g}s)", flush=True)
        record = asyncio.run(ReplicaSoak(replicas, args).run())
        survived = all(r.process is not None and r.process.poll() is None for r in replicas)
    finally:
        for replica in replicas:
            replica.stop()
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    summary = summarize(record, args) | {"replicas_alive_at_end": survived,
                                         "memory_of": "replica B (never killed)"}
    print_table(summary)
    write_results(out.with_suffix(".json"), {
        "args": vars(args), "load_average": os.getloadavg(), "summary": summary,
        "samples": [{"t": s.t, "survivor_rss_mb": s.gateway_rss_mb} for s in record.samples]})
    _plot(record, out.with_suffix(".png"), f"soak: 2 replicas on Redis, A killed every {args.kill_every_s:g}s, "
                                           f"{args.clients} clients, {args.model}")
    print(f"\nsaved {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _plot(record: Record, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, memory) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for kind in KINDS:
        ok = [o for o in record.outcomes if o.kind == kind and o.error is None]
        latency.scatter([o.start for o in ok], [o.seconds for o in ok], s=4, label=kind)
    errors = [o for o in record.outcomes if o.error]
    for expected, marker in ((True, "x"), (False, "o")):
        chosen = [o for o in errors if bool(o.expected) == expected]
        latency.scatter([o.start for o in chosen], [max(o.seconds, 1e-3) for o in chosen], marker=marker,
                        color="red", label=f"{'expected' if expected else 'unexpected'} errors ({len(chosen)})")
    latency.set_yscale("log")
    latency.set_ylabel("request seconds")
    latency.legend(fontsize=7, ncol=3)
    memory.plot([s.t for s in record.samples], [s.gateway_rss_mb for s in record.samples])
    memory.set_ylabel("replica B RSS (MB)")
    memory.set_xlabel("seconds")
    for axes in (latency, memory):
        for kill in record.kills:
            axes.axvline(kill.t, color="red", alpha=0.4)
    latency.set_title(title, fontsize=9)
    save_figure(figure, path, dpi=110)
