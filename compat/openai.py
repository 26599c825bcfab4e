"""Semantic variables from the openai SDK: the ``parrot`` request extension, sessions and variables.

Native calls (``/v1/sessions``, ``/v1/vars``, ``/v1/semantic_calls``) go through the openai client the
application already has (``client.post`` / ``get`` / ``put`` / ``delete``), so its base URL, API key,
headers and HTTP client are reused and there is no second configuration. ``OpenAI`` and ``AsyncOpenAI``
both work: plain methods need a sync client, ``a``-prefixed ones take either (a sync client then runs in
a worker thread).

A ``Variable`` formats as its placeholder ``{{var_…}}``: put it in any prompt text and ``Session.submit``
(or ``compat.langchain``) binds it, so an f-string or a prompt template is enough to wire a DAG.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import re
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Union

import openai

from wire.sampling import Criteria


# The placeholder a Variable formats as. The gateway names it like any {{name}}; names that are variable
# ids are bound to those variables.
VARIABLE_PLACEHOLDER = re.compile(r"\{\{\s*(var_[\w\-]+)\s*\}\}")

_current_session: contextvars.ContextVar["Session | None"] = contextvars.ContextVar("parrot_session", default=None)


class VariableError(RuntimeError):
    """The variable's producer failed (or one of the producer's inputs did)."""


class VariableTimeout(TimeoutError):
    """The variable was not ready within the wait's timeout."""


# ---------------------------------------------------------------- transport


def is_async(client: Any) -> bool:
    return inspect.iscoroutinefunction(client.post)


@contextlib.contextmanager
def _translated_errors() -> Iterator[None]:
    try:
        yield
    except openai.APIStatusError as exc:
        if exc.status_code == 504:
            raise VariableTimeout(exc.message) from None
        raise


_CLIENT_TIMEOUT: Any = object()  # the client's own timeout


def _request(client: Any, method: str, path: str, *, body: Any = None, params: dict | None = None,
             timeout: float | None = _CLIENT_TIMEOUT) -> Any:
    """One native call on the openai client: parsed JSON from a sync client, a coroutine from an async one."""
    # No SDK retries: 409 (already bound) and 504 (not ready yet) are answers here, not transient faults,
    # and a retried POST would create a second session or call.
    options: dict[str, Any] = {"max_retries": 0}
    if params:
        options["params"] = params
    if timeout is not _CLIENT_TIMEOUT:
        options["timeout"] = timeout  # None: no limit
    call = getattr(client, method)
    if method == "get":
        return call(path, cast_to=object, options=options)
    return call(path, cast_to=object, body=body, options=options)


def _sync_request(client: Any, method: str, path: str, **kwargs: Any) -> Any:
    if is_async(client):
        raise TypeError("this client is async: use the a-prefixed method (await variable.aget(), ...)")
    with _translated_errors():
        return _request(client, method, path, **kwargs)


async def _async_request(client: Any, method: str, path: str, **kwargs: Any) -> Any:
    if not is_async(client):
        return await asyncio.to_thread(_sync_request, client, method, path, **kwargs)
    with _translated_errors():
        return await _request(client, method, path, **kwargs)


# ---------------------------------------------------------------- the request extension

Binding = Union["Variable", str, Mapping[str, Any]]


def binding(value: Binding) -> dict[str, Any]:
    """A placeholder's binding: a Variable by id, a str as a literal value, or a ready-made {"id"|"value"|"call"}
    (``inline_call`` makes the last)."""
    if isinstance(value, Variable):
        return {"id": value.id}
    if isinstance(value, str):
        return {"value": value}
    if isinstance(value, Mapping) and len(value) == 1 and set(value) <= {"id", "value", "call"}:
        return dict(value)
    raise TypeError(f"cannot bind {value!r}: expected a Variable, a str or {{'id'|'value'|'call': ...}}")


def inline_call(*, vars: Mapping[str, Binding] | None = None, criteria: Criteria | None = None,
                **request: Any) -> dict[str, Any]:
    """A binding to a call made inside its consumer's request, whose output feeds the placeholder: ``request``
    as the keyword arguments of the same create() (model, messages or prompt, sampling); ``vars`` its own
    bindings (inline calls nest). A whole tree of calls then goes in one request: one round trip."""
    extension: dict[str, Any] = {}
    if vars:
        extension["vars"] = {name: binding(value) for name, value in vars.items()}
    if criteria is not None:
        extension["criteria"] = criteria
    return {"call": {**request, **({"parrot": extension} if extension else {})}}


def parrot_extra(*, vars: Mapping[str, Binding] | None = None, output: "str | Variable | None" = None,
                 session: "str | Session | None" = None, criteria: Criteria | None = None,
                 wait: bool = True) -> dict[str, Any]:
    """The ``extra_body`` that adds the ``parrot`` extension to a chat/completions request."""
    extension: dict[str, Any] = {}
    if session is not None:
        extension["session_id"] = session if isinstance(session, str) else session.id
    if vars:
        extension["vars"] = {name: binding(value) for name, value in vars.items()}
    if output is not None:
        extension["output"] = {"id": output.id} if isinstance(output, Variable) else output
    if criteria is not None:
        extension["criteria"] = criteria
    if not wait:
        extension["wait"] = False
    return {"parrot": extension}


def _texts(request: Mapping[str, Any]) -> Iterator[str]:
    """The prompt texts of chat/completions keyword arguments (where placeholders may sit)."""
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, list):
        yield from (p for p in prompt if isinstance(p, str))
    for message in request.get("messages") or []:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part.get("text", "") for part in content if part.get("type") == "text")


def referenced_variables(request: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Bindings for every ``{{var_…}}`` placeholder (a formatted Variable) in a request's prompt texts."""
    return {name: {"id": name} for text in _texts(request) for name in VARIABLE_PLACEHOLDER.findall(text)}


def with_extension(request: Mapping[str, Any], *, vars: Mapping[str, Binding] | None = None,
                   output: "str | Variable | None" = None, session: "str | Session | None" = None,
                   criteria: Criteria | None = None, wait: bool = True) -> dict[str, Any]:
    """``request`` (create() keyword arguments) with its Variables bound and the extension in ``extra_body``."""
    bound = {**referenced_variables(request), **(vars or {})}
    extra = {**(request.get("extra_body") or {}),
             **parrot_extra(vars=bound, output=output, session=session, criteria=criteria, wait=wait)}
    return {**request, "extra_body": extra}


# ---------------------------------------------------------------- variables


class Variable:
    """A handle on a gateway variable: its value may not exist yet.

    ``str(variable)`` is its placeholder, so it can be formatted straight into a prompt.
    """

    def __init__(self, client: Any, id: str, *, name: str | None = None, session_id: str | None = None):
        self.client = client
        self.id = id
        self.name = name
        self.session_id = session_id
        # Set by client-side producers (compat.frontend.native): their failure lives here, because the
        # gateway can only be told a value.
        self.local_producer: concurrent.futures.Future | None = None

    def __str__(self) -> str:
        return "{{" + self.id + "}}"

    def __repr__(self) -> str:
        return f"Variable({self.id!r}, name={self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Variable) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @classmethod
    def from_view(cls, client: Any, view: Mapping[str, Any], session_id: str | None = None) -> "Variable":
        return cls(client, view["id"], name=view.get("name"), session_id=view.get("session_id", session_id))

    @property
    def session(self) -> "Session":
        return Session(self.client, self.session_id)

    # -- reading

    def _read_args(self, wait: bool, timeout: float | None, criteria: Criteria | None) -> dict[str, Any]:
        params: dict[str, Any] = {"wait": "true" if wait else "false"}
        if timeout is not None:
            params["timeout"] = timeout
        if criteria is not None:
            params["criteria"] = criteria
        if not wait:
            return {"params": params}
        # The HTTP read must outlast the server-side wait, which answers 504 on its own.
        return {"params": params, "timeout": None if timeout is None else timeout + 30}

    def read(self, *, wait: bool = False, timeout: float | None = None, criteria: Criteria | None = None
             ) -> dict[str, Any]:
        """The gateway's view: {id, name, session_id, ready, value, error, producer}."""
        return _sync_request(self.client, "get", f"/vars/{self.id}", **self._read_args(wait, timeout, criteria))

    async def aread(self, *, wait: bool = False, timeout: float | None = None, criteria: Criteria | None = None
                    ) -> dict[str, Any]:
        return await _async_request(self.client, "get", f"/vars/{self.id}",
                                    **self._read_args(wait, timeout, criteria))

    def _value(self, view: Mapping[str, Any]) -> str:
        if view.get("error") is not None:
            raise VariableError(f"variable {self.name or self.id}: {view['error']}")
        if not view.get("ready"):
            raise VariableTimeout(f"variable {self.name or self.id} is not ready")
        return view["value"]

    def get(self, criteria: Criteria | None = "latency", timeout: float | None = None) -> str:
        """Wait for the value. ``criteria="latency"`` makes everything it depends on latency-critical."""
        if self.local_producer is not None:
            self.local_producer.result(timeout)  # raises the client-side producer's error
        return self._value(self.read(wait=True, timeout=timeout, criteria=criteria))

    async def aget(self, criteria: Criteria | None = "latency", timeout: float | None = None) -> str:
        if self.local_producer is not None:
            await asyncio.wait_for(asyncio.wrap_future(self.local_producer), timeout)
        return self._value(await self.aread(wait=True, timeout=timeout, criteria=criteria))

    @property
    def ready(self) -> bool:
        return bool(self.read()["ready"])

    async def aready(self) -> bool:
        return bool((await self.aread())["ready"])

    def map(self, fn: Any) -> "Variable":
        """``fn`` applied to this value once it exists (client-side), as a new Variable."""
        return native(fn)(self)

    # -- writing (only variables nobody produces; the gateway answers 409 otherwise)

    def set(self, value: str) -> None:
        _sync_request(self.client, "put", f"/vars/{self.id}", body={"value": value})

    async def aset(self, value: str) -> None:
        await _async_request(self.client, "put", f"/vars/{self.id}", body={"value": value})

    def fail(self, error: str) -> None:
        """Mark the variable failed: calls that consume it fail at once (424) naming this error."""
        _sync_request(self.client, "put", f"/vars/{self.id}", body={"error": error})


def output_variable(client: Any, response: Any) -> Variable:
    """The output variable of a waited-for response (its ``parrot`` field), e.g. to feed a later call."""
    extension = getattr(response, "parrot", None) or (response.model_extra or {}).get("parrot")
    if not extension:
        raise ValueError("this response has no 'parrot' field: the request carried no parrot extension")
    return Variable.from_view(client, extension["output"], extension["session_id"])


# ---------------------------------------------------------------- sessions


def current_session() -> "Session | None":
    """The innermost session entered with ``with``/``async with`` in this context."""
    return _current_session.get()


def _raw_create(resource: Any) -> Any:
    """``with_raw_response.create`` of ``client.chat.completions`` / ``client.completions`` (or their create)."""
    if inspect.ismethod(resource) and resource.__name__ == "create":
        resource = resource.__self__
    return resource.with_raw_response.create


class Session:
    """A gateway session: a namespace of variables and calls, freed together by ``close``.

    ``Session(client)`` is created on the gateway by ``open()``/``with``/``async with`` (which also make it
    the current session, for ``compat.frontend``); ``Session(client, id)`` is a handle on an existing one.
    ``model`` is a default for helpers that need one (compat.frontend).
    """

    def __init__(self, client: Any, id: str | None = None, *, model: str | None = None):
        self.client = client
        self._id = id
        self.model = model
        self._tokens: list[contextvars.Token] = []

    def __repr__(self) -> str:
        return f"Session({self._id!r})"

    @property
    def id(self) -> str:
        if self._id is None:
            raise RuntimeError("session not created yet: use open(), aopen() or a with block")
        return self._id

    # -- life cycle

    def open(self) -> "Session":
        if self._id is None:
            self._id = _sync_request(self.client, "post", "/sessions", body={})["id"]
        return self

    async def aopen(self) -> "Session":
        if self._id is None:
            self._id = (await _async_request(self.client, "post", "/sessions", body={}))["id"]
        return self

    def close(self) -> dict[str, Any]:
        """Cancel the session's calls and free its variables and engine contexts."""
        return _sync_request(self.client, "delete", f"/sessions/{self.id}")

    async def aclose(self) -> dict[str, Any]:
        return await _async_request(self.client, "delete", f"/sessions/{self.id}")

    def __enter__(self) -> "Session":
        self.open()
        self._tokens.append(_current_session.set(self))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _current_session.reset(self._tokens.pop())
        self.close()

    async def __aenter__(self) -> "Session":
        await self.aopen()
        self._tokens.append(_current_session.set(self))
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        _current_session.reset(self._tokens.pop())
        await self.aclose()

    # -- variables

    def _new_variable_body(self, name: str | None, value: str | None) -> dict[str, Any]:
        return {k: v for k, v in {"session_id": self.id, "name": name, "value": value}.items() if v is not None}

    def variable(self, name: str | None = None, value: str | None = None) -> Variable:
        """A new variable: with ``value`` it is ready; without, someone must produce it or ``set`` it."""
        view = _sync_request(self.client, "post", "/vars", body=self._new_variable_body(name, value))
        return Variable.from_view(self.client, view)

    async def avariable(self, name: str | None = None, value: str | None = None) -> Variable:
        view = await _async_request(self.client, "post", "/vars", body=self._new_variable_body(name, value))
        return Variable.from_view(self.client, view)

    def variables(self) -> list[dict[str, Any]]:
        """Every variable of the session, as the gateway's views (id, name, ready, value, error, producer)."""
        return _sync_request(self.client, "get", f"/sessions/{self.id}/vars")["data"]

    async def avariables(self) -> list[dict[str, Any]]:
        return (await _async_request(self.client, "get", f"/sessions/{self.id}/vars"))["data"]

    # -- OpenAI requests

    def extra(self, *, vars: Mapping[str, Binding] | None = None, output: str | Variable | None = None,
              criteria: Criteria | None = None, wait: bool = True) -> dict[str, Any]:
        """``extra_body`` for a request in this session."""
        return parrot_extra(vars=vars, output=output, session=self, criteria=criteria, wait=wait)

    def _submission(self, request: dict[str, Any], vars: Mapping[str, Binding] | None,
                    output: str | Variable | None, criteria: Criteria | None) -> dict[str, Any]:
        if request.get("stream"):
            raise ValueError("a submitted request is not streamed: its text lands in the output variable")
        return with_extension(request, vars=vars, output=output, session=self, criteria=criteria, wait=False)

    def _accepted(self, raw: Any) -> Variable:
        extension = raw.http_response.json()["parrot"]
        return Variable.from_view(self.client, extension["output"], extension["session_id"])

    def submit(self, resource: Any, *, vars: Mapping[str, Binding] | None = None,
               output: str | Variable | None = None, criteria: Criteria | None = None, **request: Any) -> Variable:
        """Submit a request without waiting; returns its output variable at once.

        ``resource`` is ``client.chat.completions`` or ``client.completions`` (or their ``create``);
        ``request`` are the usual create() arguments. Variables formatted into the prompt are bound.
        """
        kwargs = self._submission(request, vars, output, criteria)
        with _translated_errors():
            return self._accepted(_raw_create(resource)(**kwargs))

    async def asubmit(self, resource: Any, *, vars: Mapping[str, Binding] | None = None,
                      output: str | Variable | None = None, criteria: Criteria | None = None,
                      **request: Any) -> Variable:
        kwargs = self._submission(request, vars, output, criteria)
        with _translated_errors():
            return self._accepted(await _raw_create(resource)(**kwargs))

    # -- semantic calls

    def _call_body(self, model: str, template: str, inputs: Mapping[str, Binding],
                   outputs: Mapping[str, Mapping[str, Any]], criteria: Criteria | None) -> dict[str, Any]:
        body = {"model": model, "template": template, "session_id": self.id,
                "inputs": {name: binding(value) for name, value in inputs.items()},
                "outputs": {name: dict(sampling) for name, sampling in outputs.items()}}
        if criteria is not None:
            body["criteria"] = criteria
        return body

    def _call_outputs(self, answer: Mapping[str, Any]) -> dict[str, Variable]:
        return {name: Variable.from_view(self.client, view, answer["session_id"])
                for name, view in answer["outputs"].items()}

    def semantic_call(self, model: str, template: str, *, inputs: Mapping[str, Binding] | None = None,
                      outputs: Mapping[str, Mapping[str, Any]] | None = None, criteria: Criteria | None = None
                      ) -> dict[str, Variable]:
        """``POST /v1/semantic_calls``: a template with ``{{input:NAME}}``/``{{output:NAME}}``; returns the
        output variables at once."""
        body = self._call_body(model, template, inputs or {}, outputs or {}, criteria)
        return self._call_outputs(_sync_request(self.client, "post", "/semantic_calls", body=body))

    async def asemantic_call(self, model: str, template: str, *, inputs: Mapping[str, Binding] | None = None,
                             outputs: Mapping[str, Mapping[str, Any]] | None = None,
                             criteria: Criteria | None = None) -> dict[str, Variable]:
        body = self._call_body(model, template, inputs or {}, outputs or {}, criteria)
        return self._call_outputs(await _async_request(self.client, "post", "/semantic_calls", body=body))


# ---------------------------------------------------------------- native functions


def session_of(explicit: Session | None, arguments: Iterable[Any]) -> Session:
    """The session a call runs in: the one given, the current one, or that of its first Variable argument."""
    session = explicit or current_session()
    if session is None:
        session = next((value.session for value in arguments if isinstance(value, Variable)), None)
    if session is None:
        raise RuntimeError("no session: pass session=..., call inside `with Session(client):` or pass a Variable")
    return session


def native(fn: Callable[..., Any]) -> Callable[..., Variable]:
    """Decorator: a plain Python function over resolved values, producing a Variable.

    Calling it returns a new Variable at once; a thread waits for the Variable arguments, runs ``fn`` and
    sets the variable, so gateway calls consuming it start as soon as it is set. If ``fn`` or an input
    fails, ``get()`` on the returned Variable raises that error (the gateway's consumers of it time out).
    """
    @functools.wraps(fn)
    def call(*args: Any, session: Session | None = None, **kwargs: Any) -> Variable:
        output = session_of(session, (*args, *kwargs.values())).variable(name=getattr(fn, "__name__", None))
        output.local_producer = concurrent.futures.Future()

        def resolved(value: Any) -> Any:
            return value.get(criteria=None) if isinstance(value, Variable) else value

        def run() -> None:
            try:
                result = fn(*map(resolved, args), **{k: resolved(v) for k, v in kwargs.items()})
                output.set(str(result))
            except BaseException as exc:  # handed to whoever reads the output, here and on the gateway
                output.local_producer.set_exception(exc)
                with contextlib.suppress(openai.APIError):  # the session may be closed by now: nobody to tell
                    output.fail(f"{getattr(fn, '__name__', 'native function')} raised {type(exc).__name__}: {exc}")
            else:
                output.local_producer.set_result(None)

        threading.Thread(target=run, name=f"native-{output.name}", daemon=True).start()
        return output

    return call

