"""Parrot's gateway in front of the engines: an app's graph goes in with one request (after the round trips it
takes to make its variables), and the gateway runs it server-side, as gateway/semantic does on upstreams:

- a call is dispatched the moment its last input is bound (``gap_s`` of the gateway's own time, no round trip);
- placement by the gateway's real scheduler (gateway/scheduler.py: prefix held, load, criteria, task group), over
  the engines' views (fleet.py);
- criteria → priority: a call's placement level (latency-critical 0, an awaited task group's member 1,
  throughput 2) is its request's ``priority``, which an engine run with ``--scheduling-policy priority`` orders
  its waiting queue by (EngineShape.priority);
- admission: throughput work waits (up to ``[scheduler] throughput_hold_s``) while latency-critical requests of
  the gateway are on its engine and the engine has a queue;
- prefill ahead (gateway/semantic/prefill.py): a call waiting for inputs has its prompt up to its first pending
  input sent as a prefill-only request to the engine the scheduler picks for it, and then runs there unless the
  scheduler finds the wait there costs more than that prefix computed elsewhere (``Placement.warmed``); skipped
  when that engine has more than ``prefill_max_waiting`` requests waiting or a full KV cache, or the prefix is
  shorter than one KV block (a prefix cache keeps full blocks only) or ``min_prefix_chars`` (~4 characters a
  token). ``prefill_when``: ``submitted`` warms every waiting call at once, ``next_in_line`` a call once the
  producers of its inputs run, ``off`` none.

The client holds the final answers half a round trip after the last call ends. A plain app (a chat user's
turns) is no graph: its client makes each call, through the gateway, which places it like any (``PlainRoute``).
"""

from __future__ import annotations

from typing import Sequence as Seq

from benchmarks.sim.app import App, Call
from benchmarks.sim.app_run import AppRun
from benchmarks.sim.client import Client
from benchmarks.sim.clock import Clock
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.fleet import Fleet, Seat
from benchmarks.sim.prompt import Piece, chain, tokens
from benchmarks.sim.sequence import Sequence
from gateway.config import SchedulerConfig, SemanticConfig
from gateway.prompt_prefix import TOKENS_PER_CHUNK
from gateway.scheduler import LATENCY_LEVEL, THROUGHPUT_LEVEL, Placement, Scheduler, Warmed, Work

HOLD_POLL_S = 0.02  # gateway/service.py's _HOLD_POLL_S
CHARS_PER_TOKEN = 4


class ParrotGateway:
    def __init__(self, clock: Clock, fleet: Fleet, rtt_s: float, *, prefill_when: str = "next_in_line",
                 scheduler: SchedulerConfig | None = None, semantic: SemanticConfig | None = None,
                 gap_s: float = 0.0004, pin_warmed: bool = False):
        """``pin_warmed``: a what-if, not the gateway's policy: a warmed call runs where it was warmed whatever
        the wait there (the scheduler is not asked again), as an affinity key pins work."""
        self.clock, self.fleet, self.rtt_s, self.gap_s = clock, fleet, rtt_s, gap_s
        self.prefill_when = prefill_when
        self.pin_warmed = pin_warmed
        self.config = scheduler or SchedulerConfig()
        self.semantic = semantic or SemanticConfig()
        self.scheduler = Scheduler(self.config)
        self.warmed: dict[str, tuple[str, int]] = {}  # request name → (engine, prefix tokens) it was warmed on
        self.prefills = self.prefill_skips = 0
        self.warmed_placed = 0  # warmed calls the scheduler then placed on the engine they were warmed on
        self._latency_in_flight: dict[str, int] = {}
        self.plain = Client(clock, fleet, PlainRoute(self), rtt_s)

    # ------------------------------------------------------------ the app's request

    def start(self, app: App, run_id: str, on_end) -> AppRun:
        if app.plain:
            return self.plain.start(app, run_id, on_end)
        run = AppRun(app, run_id, self.clock.now, on_end)
        self.clock.after(app.setup_round_trips * self.rtt_s + self.rtt_s / 2, lambda: self._submitted(run))
        return run

    def _submitted(self, run: AppRun) -> None:
        for call in run.app.calls:
            if run.ready(call):
                self._dispatch(run, call)
            elif self.prefill_when == "submitted":
                self._warm(run, call)  # next_in_line: warmed as its producers are dispatched

    def _next(self, run: AppRun, call: Call) -> bool:
        """Whether the producer of each of the call's inputs runs (or has run)."""
        return all(name in run.sent for name in run.inputs(call))

    # ------------------------------------------------------------ calls

    def _placement(self, run: AppRun, call: Call) -> Placement:
        # Every call of these apps feeds an answer the client waits for: members of task groups are urgent.
        return Placement(latency=call.latency, group=f"{run.id}/{call.group}" if call.group else None, urgent=True)

    def _dispatch(self, run: AppRun, call: Call) -> None:
        run.sent[call.name] = self.clock.now
        pieces = run.pieces(call)
        placement = self._placement(run, call)
        name = run.seq_name(call.name)
        warmed = self.warmed.pop(name, None)
        if warmed is not None:
            placement = placement._replace(warmed=Warmed(*warmed))
        work = Work(chain(pieces, TOKENS_PER_CHUNK), tokens(pieces), placement)
        seats = self.fleet.seats()
        pinned = [s for s in seats if warmed is not None and s.id == warmed[0]] if self.pin_warmed else []
        seat = pinned[0] if pinned else self.scheduler.place(work, seats)
        if pinned:
            self.scheduler.placed(work, seat)
        self.warmed_placed += warmed is not None and seat.id == warmed[0]
        seq = Sequence(name, pieces, call.output_tokens, level=placement.level,
                       on_done=lambda seq: self._finished(run, call, seat.engine, seq))
        self.clock.after(self.gap_s, lambda: self._admitted(seat, seq, self.clock.now + self.config.throughput_hold_s))
        if self.prefill_when == "next_in_line":
            for consumer in run.consumers(call.name):
                if consumer.name not in run.sent and self._next(run, consumer):
                    self._warm(run, consumer)

    def _admitted(self, seat: Seat, seq: Sequence, deadline: float) -> None:
        engine: SimEngine = seat.engine
        if (seq.level == THROUGHPUT_LEVEL and self._latency_in_flight.get(engine.name, 0) > 0 and engine.waiting
                and self.clock.now < deadline):
            self.clock.after(HOLD_POLL_S, lambda: self._admitted(seat, seq, deadline))
            return
        if seq.level == LATENCY_LEVEL:
            self._latency_in_flight[engine.name] = self._latency_in_flight.get(engine.name, 0) + 1
        engine.submit(seq)

    def _finished(self, run: AppRun, call: Call, engine: SimEngine, seq: Sequence) -> None:
        if seq.level == LATENCY_LEVEL:
            self._latency_in_flight[engine.name] -= 1
        run.finished[call.name] = self.clock.now
        run.output_tokens += call.output_tokens
        if len(run.finished) == len(run.calls):
            self.clock.after(self.rtt_s / 2, lambda: self._ended(run))
            return
        for consumer in run.consumers(call.name):
            if run.ready(consumer) and consumer.name not in run.sent:
                self._dispatch(run, consumer)

    def _ended(self, run: AppRun) -> None:
        run.ended = self.clock.now
        run.on_end(run)

    # ------------------------------------------------------------ prefill ahead

    def _warm(self, run: AppRun, call: Call) -> None:
        name = run.seq_name(call.name)
        if name in self.warmed:
            return
        pieces = run.pieces(call, upto_input=True)
        count = tokens(pieces)
        if count * CHARS_PER_TOKEN < self.semantic.min_prefix_chars:
            return
        work = Work(chain(pieces, TOKENS_PER_CHUNK), count, self._placement(run, call))
        seat = self.scheduler.best(work, self.fleet.seats())
        engine: SimEngine = seat.engine
        if (len(engine.waiting) > self.semantic.prefill_max_waiting or seat.stats.kv_use() >= self.config.kv_full
                or count < engine.shape.block_size):
            self.prefill_skips += 1
            return
        self.scheduler.placed(work, seat)
        self.warmed[name] = (engine.name, count)
        self.prefills += 1
        prefill = Sequence(f"{name}/prefill", pieces, 1, level=work.placement.level)
        self.clock.after(self.gap_s, lambda: engine.submit(prefill))


class PlainRoute:
    """A plain request through the gateway: placed by its scheduler as latency-critical work (priority 0)."""

    def __init__(self, gateway: ParrotGateway):
        self.gateway = gateway

    def pick(self, pieces: Seq[Piece], engines: list[SimEngine]) -> tuple[SimEngine, int]:
        gateway = self.gateway
        seat = gateway.scheduler.place(Work(chain(pieces, TOKENS_PER_CHUNK), tokens(pieces)), gateway.fleet.seats())
        gateway._latency_in_flight[seat.engine.name] = gateway._latency_in_flight.get(seat.engine.name, 0) + 1
        return seat.engine, LATENCY_LEVEL

    def done(self, engine: SimEngine, level: int) -> None:
        self.gateway._latency_in_flight[engine.name] -= 1
