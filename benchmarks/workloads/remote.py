"""One app's link to an OpenAI-compatible server, in the two styles the benchmark compares.

Every HTTP request pays a simulated network round trip (half before sending, half after the answer
arrives), as an app talking to a remote service would; Parrot requests pay it like baseline ones.
``client`` is an ``httpx.AsyncClient`` whose ``base_url`` ends in ``/v1``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

Messages = list[dict[str, str]]
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def fill(messages: Messages, values: dict[str, str]) -> Messages:
    """The messages with each ``{{name}}`` replaced in one pass (what the server does for Parrot calls)."""
    return [{**m, "content": _PLACEHOLDER.sub(lambda match: values[match.group(1)], m["content"])}
            for m in messages]


def sampling(max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """Greedy, fixed-length outputs (ignore_eos) so that both modes do the same amount of work."""
    return {"max_tokens": max_tokens, "temperature": 0.0, **({"ignore_eos": True} if ignore_eos else {})}


class RequestFailed(RuntimeError):
    pass


class Remote:
    def __init__(self, client: httpx.AsyncClient, rtt_ms: float = 0.0):
        self.client = client
        self.half_rtt_s = rtt_ms / 2000
        self.prompt_tokens: list[int] = []  # of each chat answer with usage, as they arrived (fidelity checks)

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        await asyncio.sleep(self.half_rtt_s)
        response = await self.client.request(method, path, **kwargs)
        await asyncio.sleep(self.half_rtt_s)
        if response.status_code >= 400:
            raise RequestFailed(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    async def chat(self, model: str, messages: Messages, options: dict[str, Any],
                   parrot: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"model": model, "messages": messages, **options}
        if parrot is not None:
            body["parrot"] = parrot
        answer = await self.request("POST", "chat/completions", json=body)
        if answer.get("usage"):
            self.prompt_tokens.append(answer["usage"]["prompt_tokens"])
        return answer

    async def text(self, model: str, messages: Messages, options: dict[str, Any]) -> str:
        """A plain chat completion's text: the baseline's only kind of call."""
        answer = await self.chat(model, messages, options)
        return answer["choices"][0]["message"]["content"] or ""

    def session(self) -> "ParrotSession":
        return ParrotSession(self)

    def default_session(self) -> "ParrotSession":
        """The API key's own session: nothing to open or delete (it forgets its oldest variables itself)."""
        return ParrotSession(self, default=True)


Output = str | dict[str, str]  # a new variable's name, or {"id": var_id} of one made beforehand


class ParrotSession:
    """A Parrot session: calls are submitted as graph nodes (HTTP 202) and only final values are read.
    ``async with`` opens it and deletes it at the end, freeing its variables and pinned prefixes (a
    default session is neither opened nor deleted)."""

    def __init__(self, remote: Remote, *, default: bool = False):
        self.remote = remote
        self.default = default
        self.id: str | None = None

    async def __aenter__(self) -> "ParrotSession":
        if not self.default:
            self.id = (await self.remote.request("POST", "sessions"))["id"]
        return self

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        if self.default:
            return
        try:
            await self.remote.request("DELETE", f"sessions/{self.id}")
        except (RequestFailed, httpx.HTTPError):
            if exc_type is None:
                raise  # otherwise the app's own failure is the one worth seeing

    async def new_variables(self, names: list[str]) -> list[str]:
        """Empty variables made at once (one round trip, all in flight together); their ids. With them a whole
        graph can be submitted at once too, each call naming its output's id and its inputs' ids."""
        made = await asyncio.gather(*(self.remote.request("POST", "vars", json={"session_id": self.id, "name": name})
                                      for name in names))
        return [view["id"] for view in made]

    def _extension(self, inputs: dict[str, dict[str, str]], output: Output, wait: bool) -> dict[str, Any]:
        return {"session_id": self.id, "vars": inputs, "output": output, "wait": wait}

    async def submit(self, model: str, messages: Messages, inputs: dict[str, dict[str, str]], output: Output,
                     options: dict[str, Any]) -> str:
        """Queue a call without waiting for it; returns its output variable's id. ``inputs`` binds each
        ``{{name}}`` to ``{"value": text}`` or to another call's output ``{"id": var_id}``."""
        answer = await self.remote.chat(model, messages, options, self._extension(inputs, output, wait=False))
        return answer["parrot"]["output"]["id"]

    async def ask(self, model: str, messages: Messages, inputs: dict[str, dict[str, Any]], output: Output,
                  options: dict[str, Any]) -> str:
        """Run a call and wait for its text (a latency-critical request)."""
        return (await self.ask_inline(model, messages, inputs, output, options))[0]

    async def ask_inline(self, model: str, messages: Messages, inputs: dict[str, dict[str, Any]], output: Output,
                         options: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """``ask``, whose inputs may be inline calls (``inline_call``): the whole tree in one round trip. Returns
        the text and the inline calls' output variable ids by placeholder."""
        answer = await self.remote.chat(model, messages, options, self._extension(inputs, output, wait=True))
        inline = {path: view["id"] for path, view in answer["parrot"].get("inline", {}).items()}
        return answer["choices"][0]["message"]["content"] or "", inline

    @staticmethod
    def inline_call(model: str, messages: Messages, inputs: dict[str, dict[str, Any]], options: dict[str, Any]
                    ) -> dict[str, Any]:
        """A placeholder's binding to a call made inside its consumer's request (its output feeds it)."""
        return {"call": {"model": model, "messages": messages, **options, "parrot": {"vars": inputs}}}

    async def read(self, var_id: str, timeout_s: float = 600.0) -> str:
        """A variable's value, waiting for it; the wait marks its producers latency-critical."""
        params = {"wait": "true", "timeout": str(timeout_s), "criteria": "latency"}
        view = await self.remote.request("GET", f"vars/{var_id}", params=params)
        if view.get("error"):
            raise RequestFailed(f"variable {var_id} failed: {view['error']}")
        return view["value"]
