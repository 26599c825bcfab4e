"""A session's graph as GET /v1/sessions/{id}/graph (and the dashboard) shows it: its calls, running,
waiting and the latest finished, as nodes; its variables as edges from producer to consumers, each with
the start of its value. Built on request from what the calls recorded: nothing on their hot path."""

from __future__ import annotations

import time

from gateway.semantic.graph import Session, Variable
from gateway.semantic.schema import CallNode, SessionGraph, SessionSummary, VariableEdge

PREVIEW_CHARS = 120  # of each value: enough to recognise it, little enough to poll every second


def session_graph(session: Session) -> SessionGraph:
    calls: list[CallNode] = [*session.finished_calls.values(), *(c.node() for c in session.calls.values())]
    consumers: dict[str, list[str]] = {}
    for call in calls:
        for var_id in call.inputs.values():
            consumers.setdefault(var_id, []).append(call.id)
    return SessionGraph(session_id=session.id, created=session.created, default=session.default, now=time.time(),
                        calls=calls, variables=[_edge(v, consumers.get(v.id, [])) for v in session.variables.values()])


def _edge(variable: Variable, consumers: list[str]) -> VariableEdge:
    producer = variable.producer
    return VariableEdge(id=variable.id, name=variable.name, producer=producer.id if producer else None,
                        consumers=consumers, ready=variable.ready and variable.error is None, preview=_clipped(variable.value),
                        size=variable.size, error=_clipped(variable.error))


def _clipped(text: str | None, limit: int = PREVIEW_CHARS) -> str | None:
    return text if text is None or len(text) <= limit else text[:limit] + "…"


def session_summary(session: Session) -> SessionSummary:
    return SessionSummary(id=session.id, created=session.created, default=session.default, owner=session.owner[:12],
                          variables=len(session.variables), pending_calls=len(session.calls),
                          finished_calls=len(session.finished_calls))
