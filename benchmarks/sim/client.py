"""Client orchestration: an app that calls the engines itself, one plain request per call, each sent once the
client holds every input of it, through a router (router.py). Every request pays the network round trip, half on
the way out and half on the way back, so each dependent hop costs a full RTT; calls without inputs between them
go out together (an async client's gather). Parrot's gateway sends a plain app's calls (a chat user's turns)
this way too, its scheduler as the router (gateway.py)."""

from __future__ import annotations

from benchmarks.sim.app import App, Call
from benchmarks.sim.app_run import AppRun
from benchmarks.sim.clock import Clock
from benchmarks.sim.fleet import Fleet
from benchmarks.sim.router import Router
from benchmarks.sim.sequence import Sequence


class Client:
    def __init__(self, clock: Clock, fleet: Fleet, router: Router, rtt_s: float):
        self.clock, self.fleet, self.router, self.half_rtt = clock, fleet, router, rtt_s / 2

    def start(self, app: App, run_id: str, on_end) -> AppRun:
        run = AppRun(app, run_id, self.clock.now, on_end)
        for call in app.calls:
            if not run.inputs(call):
                self.clock.after(self.half_rtt, lambda call=call: self._send(run, call))
        return run

    def _send(self, run: AppRun, call: Call) -> None:
        pieces = run.pieces(call)
        engine, level = self.router.pick(pieces, self.fleet.engines)
        run.sent[call.name] = self.clock.now
        left_client = self.clock.now - self.half_rtt

        def done(seq: Sequence) -> None:
            self.router.done(engine, level)
            self.clock.after(self.half_rtt, lambda: self._answered(run, call, left_client))
        engine.submit(Sequence(run.seq_name(call.name), pieces, call.output_tokens, level=level, on_done=done))

    def _answered(self, run: AppRun, call: Call, left_client: float) -> None:
        run.finished[call.name] = self.clock.now
        run.call_seconds[call.name] = self.clock.now - left_client
        run.output_tokens += call.output_tokens
        if len(run.finished) == len(run.calls):
            run.ended = self.clock.now
            run.on_end(run)
            return
        for consumer in run.consumers(call.name):
            if run.ready(consumer) and consumer.name not in run.sent:
                run.sent[consumer.name] = float("nan")  # on its way
                delay = run.app.think_s + self.half_rtt
                self.clock.after(delay, lambda consumer=consumer: self._send(run, consumer))
