"""LangChain with semantic variables: a chain of LLM steps submitted to the gateway as one DAG.

Plain ``ChatOpenAI(base_url=GATEWAY/v1)`` already works unchanged. ``ParrotChatOpenAI`` is a ChatOpenAI
whose ``invoke`` does not wait: it submits the request (``wait: false``) and returns at once an
AIMessage whose content is the output variable's placeholder ``{{var_…}}``. Later steps format that text
into their prompts like any other string; the model binds every ``{{var_…}}`` it finds to its variable,
so ordinary LCEL chains (prompt | llm | StrOutputParser) become a server-side DAG:

    llm = ParrotChatOpenAI(base_url=..., api_key=..., model=..., temperature=0)
    outline = ChatPromptTemplate.from_template("Outline an essay on {topic}.") | llm | StrOutputParser()
    essay = {"outline": outline} | ChatPromptTemplate.from_template("Write it: {outline}") | llm | StrOutputParser()
    handle = essay.invoke({"topic": "tea"})   # both steps submitted, neither finished
    print(llm.resolve(handle))                 # waits (latency-critical) for the final text

Options, as fields or per call (``invoke(..., parrot_output="x")`` / ``.bind(...)``): ``parrot_session_id``,
``parrot_vars`` (bindings for named ``{{name}}`` placeholders: a Variable or a literal str),
``parrot_output`` (a name, or a Variable to produce into), ``parrot_criteria``, and ``parrot_wait``
(True: an ordinary ChatOpenAI call that still binds variables and returns the real text).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableLambda
from langchain_openai import ChatOpenAI
from pydantic import Field

from compat.openai import VARIABLE_PLACEHOLDER, Session, Variable, with_extension

_OPTIONS = ("parrot_session_id", "parrot_vars", "parrot_output", "parrot_criteria", "parrot_wait")


def _text(result: Any) -> str:
    return result.content if isinstance(result, BaseMessage) else str(result)


class ParrotChatOpenAI(ChatOpenAI):
    """ChatOpenAI whose calls join the gateway's variable DAG; see the module docstring."""

    parrot_session_id: str | None = None
    parrot_vars: dict[str, Any] = Field(default_factory=dict)
    parrot_criteria: str | None = None
    parrot_wait: bool = False

    # -- options and payload

    def _option(self, kwargs: dict[str, Any], name: str) -> Any:
        return kwargs[name] if name in kwargs else getattr(self, name, None)

    def _get_request_payload(self, input_: Any, *, stop: list[str] | None = None, **kwargs: Any) -> dict:
        options = {name: self._option(kwargs, name) for name in _OPTIONS}
        for name in _OPTIONS:
            kwargs.pop(name, None)
        payload = super()._get_request_payload(input_, stop=stop, **kwargs)
        if not options["parrot_wait"]:
            payload.pop("stream", None)
            payload.pop("stream_options", None)
        return with_extension(payload, vars={**self.parrot_vars, **(options["parrot_vars"] or {})},
                              output=options["parrot_output"], session=options["parrot_session_id"],
                              criteria=options["parrot_criteria"], wait=options["parrot_wait"])

    def _create_chat_result(self, response: Any, generation_info: dict | None = None) -> ChatResult:
        """ChatOpenAI's result, keeping the response's ``parrot`` field (output variable, session)."""
        result = super()._create_chat_result(response, generation_info)
        extras = response if isinstance(response, dict) else (getattr(response, "model_extra", None) or {})
        if extras.get("parrot"):
            for generation in result.generations:
                generation.message.response_metadata["parrot"] = extras["parrot"]
        return result

    def _submitted(self, answer: dict[str, Any]) -> AIMessage:
        extension = answer["parrot"]
        return AIMessage(content="{{" + extension["output"]["id"] + "}}",
                         response_metadata={"parrot": extension, "model_name": self.model_name})

    # -- submitting without waiting (wait=True falls through to ChatOpenAI)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        if self._option(kwargs, "parrot_wait"):
            return super()._generate(messages, stop, run_manager, **kwargs)
        payload = self._get_request_payload(messages, stop=stop, **kwargs)
        raw = self.root_client.chat.completions.with_raw_response.create(**payload)
        return ChatResult(generations=[ChatGeneration(message=self._submitted(raw.http_response.json()))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: Any = None, **kwargs: Any) -> ChatResult:
        if self._option(kwargs, "parrot_wait"):
            return await super()._agenerate(messages, stop, run_manager, **kwargs)
        payload = self._get_request_payload(messages, stop=stop, **kwargs)
        raw = await self.root_async_client.chat.completions.with_raw_response.create(**payload)
        return ChatResult(generations=[ChatGeneration(message=self._submitted(raw.http_response.json()))])

    def _as_chunk(self, result: ChatResult) -> ChatGenerationChunk:
        message = result.generations[0].message
        return ChatGenerationChunk(message=AIMessageChunk(content=message.content,
                                                          response_metadata=message.response_metadata))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        if self._option(kwargs, "parrot_wait"):
            yield from super()._stream(messages, stop, run_manager, **kwargs)
            return
        kwargs.pop("stream_usage", None)
        yield self._as_chunk(self._generate(messages, stop, run_manager, **kwargs))  # the handle is one chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: Any = None, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        if self._option(kwargs, "parrot_wait"):
            async for chunk in super()._astream(messages, stop, run_manager, **kwargs):
                yield chunk
            return
        kwargs.pop("stream_usage", None)
        yield self._as_chunk(await self._agenerate(messages, stop, run_manager, **kwargs))

    # -- sessions and results

    def session(self) -> Session:
        """A Session on the same client (use it as a context manager), e.g. for ``in_session``."""
        return Session(self.root_client, model=self.model_name)

    def in_session(self, session: Session | str) -> "ParrotChatOpenAI":
        """A copy of this model whose calls run in ``session``."""
        return self.model_copy(update={"parrot_session_id": session if isinstance(session, str) else session.id})

    def variables(self, result: Any) -> list[Variable]:
        """The Variables referenced by a step's result (an AIMessage or the text a parser made of it)."""
        return [Variable(self.root_client, name) for name in VARIABLE_PLACEHOLDER.findall(_text(result))]

    def variable(self, result: Any) -> Variable:
        found = self.variables(result)
        if len(found) != 1:
            raise ValueError(f"expected exactly one variable placeholder, found {len(found)}")
        return found[0]

    def resolve(self, result: Any, *, criteria: str | None = "latency", timeout: float | None = None) -> str:
        """The text with each ``{{var_…}}`` replaced by the variable's value (waiting for it)."""
        text = _text(result)
        values = {v.id: v.get(criteria=criteria, timeout=timeout) for v in self.variables(text)}
        return VARIABLE_PLACEHOLDER.sub(lambda m: values[m.group(1)], text)

    async def aresolve(self, result: Any, *, criteria: str | None = "latency", timeout: float | None = None
                       ) -> str:
        text = _text(result)
        values = {}
        for name in VARIABLE_PLACEHOLDER.findall(text):
            values[name] = await Variable(self.root_async_client, name).aget(criteria=criteria, timeout=timeout)
        return VARIABLE_PLACEHOLDER.sub(lambda m: values[m.group(1)], text)

    def resolver(self) -> RunnableLambda:
        """``resolve`` as a Runnable, to end a chain with the final text: ``chain | llm.resolver()``."""
        return RunnableLambda(self.resolve, afunc=self.aresolve, name="parrot_resolve")
