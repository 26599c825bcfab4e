"""One run of an app (app.App) in a simulation: its calls' requests named uniquely, their prompts resolved (an
input becomes the producer's output, as the engine's cache names it), and what has finished when."""

from __future__ import annotations

from typing import Callable

from benchmarks.sim.app import App, Call, Input
from benchmarks.sim.prompt import Piece


class AppRun:
    def __init__(self, app: App, run_id: str, started: float, on_end: Callable[["AppRun"], None],
                 salt: str | None = None):
        """``salt`` names this run's values apart from other runs' of the same app (by default the run's id):
        runs built from one document still stand for different users' documents."""
        self.app = app
        self.salt = salt if salt is not None else run_id
        self.id = run_id
        self.started = started
        self.ended: float | None = None
        self.on_end = on_end
        self.calls = {call.name: call for call in app.calls}
        self._inputs = {call.name: app.inputs(call) for call in app.calls}
        self._consumers = {call.name: [c for c in app.calls if call.name in self._inputs[c.name]] for call in app.calls}
        self.finished: dict[str, float] = {}  # call → when its answer was ready (where the orchestrator is)
        self.sent: dict[str, float] = {}  # call → when its request reached an engine
        self.output_tokens = 0
        self.call_seconds: dict[str, float] = {}  # a plain call: from the client's sending it to its answer there

    def seq_name(self, call: str) -> str:
        return f"{self.id}/{call}"

    def pieces(self, call: Call, upto_input: bool = False) -> tuple[Piece, ...]:
        """The call's prompt; with ``upto_input``, only what comes before its first input."""
        out: list[Piece] = []
        for piece in call.pieces:
            if isinstance(piece, Input):
                if upto_input:
                    break
                out.append((f"out:{self.seq_name(piece.producer)}", self.calls[piece.producer].output_tokens))
            elif piece[0].startswith("v:"):
                out.append((f"{piece[0]}@{self.salt}", piece[1]))
            else:
                out.append(piece)
        return tuple(out)

    def inputs(self, call: Call) -> list[str]:
        return self._inputs[call.name]

    def ready(self, call: Call) -> bool:
        return all(name in self.finished for name in self._inputs[call.name])

    def consumers(self, name: str) -> list[Call]:
        return self._consumers[name]

    @property
    def seconds(self) -> float:
        return (self.ended or float("nan")) - self.started
