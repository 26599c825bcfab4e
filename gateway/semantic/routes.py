"""Native API: sessions, variables and semantic calls. Every lookup is scoped to the caller's API key."""

from __future__ import annotations

from typing import Annotated, AsyncContextManager

from litestar import Request, delete, get, post, put
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from http_plumbing.disconnect import CancelledOnDisconnect
from gateway.semantic.schema import (
    Criteria,
    OutputView,
    SemanticCall,
    SemanticCallView,
    SessionDeleted,
    SessionGraph,
    SessionList,
    SessionView,
    VarCreate,
    VarList,
    VarSet,
    VarView,
)
from gateway.auth import is_admin, owner
from gateway.errors import APIError
from gateway.semantic.graph_view import session_graph, session_summary
from gateway.semantic.service import SemanticService, view


def semantic(state: State) -> SemanticService:
    return state.semantic


def admitted(request: Request) -> AsyncContextManager[object]:
    """A request that makes work, admitted under its key's rate and concurrency quotas (else a 429)."""
    return request.app.state.quotas.admitted(owner(request))


@post("/v1/sessions", status_code=201)
async def create_session(request: Request, state: State) -> SessionView:
    sessions = semantic(state).sessions
    async with admitted(request):
        session = sessions.create(owner(request))
        await sessions.flushed()  # in the state store before it is acknowledged
    return SessionView(id=session.id, created=session.created)


@get("/v1/sessions")
async def list_sessions(request: Request, state: State) -> SessionList:
    """The presented key's sessions (an admin key's: everyone's), most recently used first. Listing them is
    no use of them: it does not keep them from going idle."""
    sessions = semantic(state).sessions.listed(owner(request), any_owner=is_admin(request))
    return SessionList(data=[session_summary(s) for s in sessions])


@get("/v1/sessions/{session_id:str}/graph")
async def get_session_graph(session_id: FromPath[str], request: Request, state: State) -> SessionGraph:
    """The session's calls (waiting, running, done, failed, with engine and timings) and variables (edges
    with a preview of their values): what the dashboard draws. 404 for another key's session, unless
    the presented key is an admin key."""
    sessions = semantic(state).sessions
    await sessions.fetch(session_id)
    session = sessions.peek(session_id, owner(request), any_owner=is_admin(request))
    return session_graph(session)


@delete("/v1/sessions/{session_id:str}", status_code=200)
async def delete_session(session_id: FromPath[str], request: Request, state: State) -> SessionDeleted:
    await semantic(state).sessions.fetch(session_id)
    variables, contexts = await semantic(state).close_session(session_id, owner(request))
    await semantic(state).sessions.flushed()
    return SessionDeleted(id=session_id, freed_variables=variables, freed_contexts=contexts)


@get("/v1/sessions/{session_id:str}/vars")
async def list_session_vars(session_id: FromPath[str], request: Request, state: State) -> VarList:
    sessions = semantic(state).sessions
    await sessions.fetch(session_id)
    session = sessions.get(session_id, owner(request))
    return VarList(data=[view(v) for v in session.variables.values()])


@post("/v1/vars", status_code=201)
async def create_var(data: JSONBody[VarCreate], request: Request, state: State) -> VarView:
    sessions = semantic(state).sessions
    async with admitted(request):
        await sessions.prepare(data.session_id, owner(request))
        session = sessions.resolve(data.session_id, owner(request))
        variable = session.new_variable(data.name, data.value)
        await sessions.flushed()
        return view(variable)


@get("/v1/vars/{var_id:str}")
async def read_var(var_id: FromPath[str], request: Request, state: State,
    wait: FromQuery[bool] = False,
    timeout: Annotated[float | None, QueryParameter(ge=0, description="seconds to wait when wait=true")] = None,
    criteria: FromQuery[Criteria | None] = None,
) -> VarView:
    service = semantic(state)
    await service.sessions.fetch_variable(var_id)
    variable = service.sessions.find_variable(var_id, owner(request))
    async with CancelledOnDisconnect(request.receive):  # a long wait ends when its client leaves
        return await service.read(variable, wait=wait, timeout_s=timeout, criteria=criteria)
    return view(variable)  # for nobody


@put("/v1/vars/{var_id:str}", status_code=200)
async def set_var(var_id: FromPath[str], data: JSONBody[VarSet], request: Request, state: State) -> VarView:
    sessions = semantic(state).sessions
    await sessions.fetch_variable(var_id)
    variable = sessions.find_variable(var_id, owner(request))
    if variable.producer_id is not None or variable.ready:
        raise APIError(409, f"variable {variable.label} already has a value or a producer",
                       code="variable_already_bound")
    if (data.value is None) == (data.error is None):
        raise APIError(400, "give exactly one of 'value' and 'error'", param="value")
    async with admitted(request):
        if data.value is not None:
            variable.set(data.value)
        else:
            variable.fail(data.error)
        await sessions.flushed()
    return view(variable)


@post("/v1/semantic_calls", status_code=202)
async def submit_semantic_call(data: JSONBody[SemanticCall], request: Request, state: State) -> SemanticCallView:
    sessions = semantic(state).sessions
    async with admitted(request):
        await sessions.prepare(data.session_id, owner(request), [r.id for r in data.inputs.values() if r.id])
        session, call = semantic(state).submit_call(data, owner(request))
        await sessions.flushed()
    return SemanticCallView(id=call.id, session_id=session.id,
                            outputs={n: OutputView(id=v.id, name=v.name) for n, v in call.outputs.items()})


SEMANTIC_ROUTES = [create_session, list_sessions, get_session_graph, delete_session, list_session_vars, create_var, read_var, set_var,
                   submit_semantic_call]
