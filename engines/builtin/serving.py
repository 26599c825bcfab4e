"""The builtin engine behind the ``Engine`` seam: OpenAI requests in, OpenAI responses out.

``BuiltinEngine`` runs in the caller's process over an ``LLMEngine`` (which computes on its
own thread), so the gateway can host it directly and ``server.py`` can expose it over HTTP.
It owns everything between the wire format and token ids: chat templates, sampling
parameters, ``n`` choices as forks of one filled prompt, incremental detokenisation with stop
strings, logprobs, usage and the streaming chunk sequence.
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Iterable, Protocol, Sequence, TypeVar

import msgspec
from msgspec import Meta

from engines.seam import EngineError, EngineStats, Route
from wire.sampling import SamplingWithHints, check_sampling
from engines.builtin.grammar import ToolCallReader, output_grammar, read_tool_calls, tool_messages
from engines.builtin.tokenizer import IncrementalDetokenizer, TokenTexts, chat_prompt_text, chat_prompt_tokens, text_tokens
from engines.builtin.types import FillResult, SamplingParams, TokenEvent, TokenScore
from wire.sse import sse_event
from wire.openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ResponseMessage,
    TokenLogprob,
    Tool,
    TopLogprob,
    Usage,
    encoder,
    new_id,
    now,
)
from wire.errors import InvalidRequest

T = TypeVar("T")


# ---------------------------------------------------------------- errors


class EngineBadRequest(EngineError):
    """The request cannot be served as asked (bad field, prompt longer than the context window)."""

    status_code = 400
    error_type = "invalid_request_error"
    code = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineNotFound(EngineError):
    """A context id the engine does not hold."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "context_not_found"
    param = "context_id"


class EngineConflict(EngineError):
    """The context is busy with another fill or generation."""

    status_code = 409
    error_type = "invalid_request_error"
    code = "context_busy"
    param = "context_id"


async def _translated(pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """``pieces`` with the core's errors as this layer's, closed however the caller stops."""
    try:
        async with aclosing(pieces):
            async for piece in pieces:
                yield piece
    except Exception as exc:
        raise _translate(exc) from exc


def _translate(exc: Exception) -> Exception:
    """Core exceptions as the seam's ``EngineError``s; anything else unchanged.

    Matched by class name so this module need not import the core (and its torch) to be used,
    and so that a KeyError raised by a bug is not turned into a polite 404.
    """
    kind = type(exc).__name__
    if kind == "ContextNotFound":
        return EngineNotFound(f"context {exc.args[0] if exc.args else ''!s} not found")
    if kind == "ContextBusy":
        return EngineConflict(str(exc))
    if isinstance(exc, InvalidRequest):
        return EngineBadRequest(str(exc), exc.param)
    if isinstance(exc, ValueError) and not isinstance(exc, EngineError):
        return EngineBadRequest(str(exc))  # the core's "prompt longer than max_model_len"
    return exc


# ---------------------------------------------------------------- the core's interface


class LLMCore(Protocol):
    """What this layer needs of ``engines.builtin.engine.LLMEngine``."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]

    async def fill(self, tokens: list[int], *, context_id: str | None = None, parent_context_id: str | None = None) -> FillResult: ...
    def ensure_context(self, context_id: str, tokens: list[int]) -> bool: ...
    def context_length(self, context_id: str) -> int | None: ...
    def generate(self, context_id: str, params: SamplingParams) -> AsyncIterator[TokenEvent]: ...
    def generate_from_prompt(self, prompt_tokens: list[int], params: SamplingParams, *, parent_context_id: str | None = None,
                             parent_tokens: list[int] | None = None) -> AsyncIterator[TokenEvent]: ...
    async def free_context(self, context_id: str) -> int: ...
    async def score(self, tokens: list[int], top_logprobs: int = 0, *, priority: int = 0, counted: bool = True) -> list[TokenScore]: ...
    def stats(self) -> EngineStats: ...
    def shutdown(self) -> None: ...


# ---------------------------------------------------------------- primitives' bodies


class ContextFillRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    context_id: str | None = None
    parent_context_id: str | None = None
    tokens: list[int] | None = None
    text: str | None = None
    # With context_id: create it only if it does not exist and answer at once, its fill queued (how a
    # gateway pins a shared prefix without waiting for it); an existing context is left as it is.
    if_absent: bool = False


class ContextGenerateRequest(SamplingWithHints, kw_only=True, omit_defaults=True):
    # With fork: generate after the context's tokens plus these, in a temporary child freed at the end
    # (one call instead of fill + generate + free: how a gateway runs a request on a shared prefix).
    text: str | None = None
    tokens: list[int] | None = None
    fork: bool = False
    # With fork: the context's own text, to create it from if it does not exist yet. Requests naming
    # one new prefix can then all be sent at once: the first creates it, and the step that computes
    # it (or the prefix cache after) shares its KV with every fork.
    context_text: str | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0
    stream: bool = False

    def __post_init__(self) -> None:  # a ValueError here is a msgspec.ValidationError: a 400
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1")
        check_sampling(self)

    def token_limit(self) -> int | None:
        return self.max_tokens


class ContextGenerationChunk(msgspec.Struct):
    """One streamed step of a generation appended to a context."""

    text: str
    token_ids: list[int]
    finish_reason: str | None


class ContextGeneration(ContextGenerationChunk):
    """A whole generation appended to a context, as ``/v1/contexts/{id}/generate`` answers."""

    usage: Usage  # prompt_tokens: the tokens given with the request (a fork's text), not the context's
    context_tokens: int  # the context's tokens the generation followed


# ---------------------------------------------------------------- one choice's output


@dataclass
class Piece:
    """What one choice adds in one step: released text, the tokens since the last piece."""

    text: str
    token_ids: list[int]
    events: list[TokenEvent]  # the same tokens with their logprobs
    finish_reason: str | None = None


async def decode_events(
    events: AsyncIterator[TokenEvent], detok: IncrementalDetokenizer, hidden_stop_ids: frozenset[int]
) -> AsyncIterator[Piece]:
    """Turns a token stream into text pieces; leaving early (a stop string) aborts the sequence."""
    pending: list[TokenEvent] = []
    async with aclosing(events):
        async for event in events:
            pending.append(event)
            finish = event.finish_reason
            # EOS / stop_token_ids end the text without being part of it, as OpenAI does.
            hidden = finish == "stop" and event.token_id in hidden_stop_ids
            text = "" if hidden else detok.push(event.token_id)
            if detok.stopped:
                finish = "stop"
            elif finish is not None:
                text += detok.finish()
            if text or finish is not None:
                yield Piece(text, [e.token_id for e in pending], pending, finish)
                pending = []
            if finish is not None:
                return
    yield Piece(detok.finish(), [e.token_id for e in pending], pending, "abort")  # core stopped without a reason


@dataclass
class ChoiceResult:
    """One choice accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.events += piece.events
        self.finish_reason = piece.finish_reason or self.finish_reason


@dataclass
class PromptJob:
    """One prompt of a request and the choices sampled from it."""

    tokens: list[int]
    params: list[SamplingParams]  # one per choice
    first_index: int  # choice index of params[0] in the response
    stop: list[str]
    tool_calls: bool = False  # the output follows the tools grammar and is read as tool calls

    @property
    def indices(self) -> range:
        return range(self.first_index, self.first_index + len(self.params))


# ---------------------------------------------------------------- the engine


class BuiltinEngine:
    """The builtin engine as an ``engines.seam.Engine``, serving in-process over an ``LLMEngine``."""

    def __init__(self, llm: LLMCore, *, name: str = "builtin-0", model_name: str | None = None):
        self.llm = llm
        self.name = name
        self.model_name = model_name or llm.model_name
        self.tokenizer = llm.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)
        self.eos_token_ids = frozenset(llm.eos_token_ids)

    # ------------------------------------------------------------ the Engine seam

    async def create(self, route: Route, body: dict[str, Any]) -> bytes:
        if route == "chat/completions":
            return encoder.encode(await self.chat(_parse(body, ChatCompletionRequest)))
        if route == "completions":
            return encoder.encode(await self.complete(_parse(body, CompletionRequest)))
        raise EngineBadRequest(f"unknown route {route!r}")

    async def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if route == "chat/completions":
            chunks = self.chat_stream(_parse(body, ChatCompletionRequest))
        elif route == "completions":
            chunks = self.complete_stream(_parse(body, CompletionRequest))
        else:
            raise EngineBadRequest(f"unknown route {route!r}")
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse_event(chunk)

    async def health(self) -> bool:
        return True

    async def stats(self) -> EngineStats:
        return self.llm.stats()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)

    # ------------------------------------------------------------ chat completions

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion:
        job = self._chat_job(request)
        results = await self._collect([job])
        choices = []
        for i, r in enumerate(results):
            message, finish_reason = ResponseMessage(content=r.text), r.finish_reason
            if job.tool_calls:
                content, calls = read_tool_calls(r.text)
                message = ResponseMessage(content=content, tool_calls=calls or None)
                finish_reason = _tool_finish_reason(finish_reason, calls)
            logprobs = self._chat_logprobs(r.events) if request.logprobs else None
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish_reason, logprobs=logprobs))
        return ChatCompletion(model=self.model_name, choices=choices, usage=_usage([job], results))

    async def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[bytes]:
        job = self._chat_job(request)
        chunk_id, created = new_id("chatcmpl"), now()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
            return encoder.encode(
                ChatCompletionChunk(model=self.model_name, choices=choices, id=chunk_id, created=created, usage=usage)
            )

        for index in job.indices:
            yield chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))])
        completion_tokens = 0
        readers = {index: ToolCallReader() for index in job.indices} if job.tool_calls else None
        async for index, piece in self._run_all([job]):
            completion_tokens += len(piece.token_ids)
            logprobs = self._chat_logprobs(piece.events) if request.logprobs else None
            delta, finish_reason = ChatDelta(content=piece.text), piece.finish_reason
            if readers is not None:
                delta, finish_reason = _tool_delta(readers[index], piece)
                if delta.content is None and delta.tool_calls is None and finish_reason is None and logprobs is None:
                    continue  # text held back until it is known to be (part of) a call
            yield chunk([ChatChunkChoice(index, delta, finish_reason, logprobs)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], _usage_of(len(job.tokens), completion_tokens))

    def _with_tools(self, messages: list[ChatMessage], tools: list[Tool] | None) -> list[ChatMessage]:
        return tool_messages(messages, tools, getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
        """The prompt text a chat request becomes here, tool descriptions included (gateways split it
        at variable boundaries to share prefixes)."""
        return chat_prompt_text(self.tokenizer, self._with_tools(messages, tools), tools)

    def _chat_job(self, request: ChatCompletionRequest) -> PromptJob:
        _validate(request)
        _check_text_only(request.messages, self.model_name)
        try:
            output = output_grammar(request.response_format, request.tools, request.tool_choice, request.parallel_tool_calls)
        except InvalidRequest as exc:
            raise EngineBadRequest(str(exc), exc.param) from exc
        # Offered even with tool_choice "none" (the grammar keeps calls out), as OpenAI and vLLM do.
        tokens = chat_prompt_tokens(self.tokenizer, self._with_tools(request.messages, request.tools), request.tools)
        params = self.sampling_params(
            request, len(tokens), logprobs=request.logprobs, top_logprobs=request.top_logprobs or 0, prompt_param="messages"
        )
        params = msgspec.structs.replace(params, grammar=output.grammar)
        return PromptJob(tokens, _per_choice(params, request.n), 0, request.stop_list(), output.tool_calls)

    def _chat_logprobs(self, events: Iterable[TokenEvent]) -> ChoiceLogprobs:
        texts = self.token_texts
        content = [
            TokenLogprob(
                token=texts.text(e.token_id),
                logprob=e.logprob if e.logprob is not None else 0.0,
                bytes=texts.bytes(e.token_id),
                top_logprobs=[
                    TopLogprob(token=texts.text(t), logprob=lp, bytes=texts.bytes(t)) for t, lp in e.top_logprobs or ()
                ],
            )
            for e in events
        ]
        return ChoiceLogprobs(content=content)

    # ------------------------------------------------------------ text completions

    async def complete(self, request: CompletionRequest) -> Completion:
        jobs, echoes = self._completion_jobs(request)
        echo_logprobs = await self._echo_logprobs(request, jobs, echoes)
        results = await self._collect(jobs, self._completion_pieces(request, jobs))
        choices = []
        for i, r in enumerate(results):
            echo = echoes[i // request.n] if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = self._completion_logprobs(r.events, len(echo))
                if echo_logprobs:
                    logprobs = _joined(echo_logprobs[i // request.n], logprobs)
            choices.append(CompletionChoice(index=i, text=echo + r.text, finish_reason=r.finish_reason, logprobs=logprobs))
        return Completion(model=self.model_name, choices=choices, usage=_usage(jobs, results))

    async def complete_stream(self, request: CompletionRequest) -> AsyncIterator[bytes]:
        jobs, echoes = self._completion_jobs(request)
        chunk_id, created = new_id("cmpl"), now()

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
            return encoder.encode(Completion(model=self.model_name, choices=choices, id=chunk_id, created=created, usage=usage))

        echo_logprobs = await self._echo_logprobs(request, jobs, echoes)
        if request.echo:
            yield chunk([CompletionChoice(index=i, text=echoes[i // request.n],
                                          logprobs=echo_logprobs[i // request.n] if echo_logprobs else None)
                         for job in jobs for i in job.indices])
        text_offsets = [len(echoes[i // request.n]) if request.echo else 0 for job in jobs for i in job.indices]
        completion_tokens = 0
        async for index, piece in self._completion_pieces(request, jobs):
            completion_tokens += len(piece.token_ids)
            logprobs = None
            if request.logprobs is not None:
                logprobs = self._completion_logprobs(piece.events, text_offsets[index])
                text_offsets[index] += sum(len(t) for t in logprobs.tokens)
            yield chunk([CompletionChoice(index, piece.text, piece.finish_reason, logprobs)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], _usage_of(sum(len(job.tokens) for job in jobs), completion_tokens))

    def _completion_jobs(self, request: CompletionRequest) -> tuple[list[PromptJob], list[str]]:
        _validate(request)
        if request.suffix:
            raise EngineBadRequest("suffix (insertion) is not supported by this engine", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise EngineBadRequest("best_of is not supported by this engine: leave it out or equal to n", "best_of")
        jobs, echoes = [], []
        for prompt in request.prompts():
            tokens = text_tokens(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
            if not tokens:
                raise EngineBadRequest("prompt must not be empty", "prompt")
            self._check_token_ids(tokens, "prompt")
            params = self.sampling_params(
                request, len(tokens), logprobs=request.logprobs is not None, top_logprobs=request.logprobs or 0
            )
            jobs.append(PromptJob(tokens, _per_choice(params, request.n), len(jobs) * request.n, request.stop_list()))
            if request.echo:
                echoes.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(tokens))
        return jobs, echoes

    def _completion_pieces(self, request: CompletionRequest, jobs: list[PromptJob]) -> AsyncIterator[tuple[int, Piece]]:
        """The choices' pieces; with max_tokens 0 (an echoed prompt only scored) each just ends."""
        return _nothing_generated(jobs) if request.max_tokens == 0 else self._run_all(jobs)

    async def _echo_logprobs(self, request: CompletionRequest, jobs: list[PromptJob],
                             echoes: list[str]) -> list[CompletionLogprobs]:
        """With echo and logprobs: each prompt's own tokens scored, as OpenAI's legacy completions
        (and evaluation harnesses reading loglikelihoods through them) expect. Empty otherwise."""
        if not request.echo or request.logprobs is None:
            return []
        counted = request.max_tokens == 0  # else the generation from the same prompt counts it
        tasks = [asyncio.ensure_future(self.llm.score(job.tokens, request.logprobs, priority=request.priority,
                                                      counted=counted)) for job in jobs]
        try:
            scored = await asyncio.gather(*tasks)  # all prompts in one batch
        except Exception as exc:
            for task in tasks:  # one failed: the others are of no use
                task.cancel()
            raise _translate(exc) from exc
        texts = self.token_texts
        out = []
        for job, scores, echo in zip(jobs, scored, echoes):
            out.append(CompletionLogprobs(
                tokens=[texts.text(t) for t in job.tokens],
                token_logprobs=[None, *(s.logprob for s in scores)],
                top_logprobs=[None, *(self._top_dict(t, s.logprob, s.top_logprobs)
                                      for t, s in zip(job.tokens[1:], scores))],
                text_offset=self._offsets(echo, job.tokens)))
        return out

    def _offsets(self, text: str, tokens: list[int]) -> list[int]:
        """Where each token starts in ``text``: the tokenizer's own offsets when ``text`` tokenizes to
        ``tokens`` (pieces of one character share its offset), else the running length of token texts."""
        try:
            encoded = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        except NotImplementedError:  # a slow tokenizer has no offsets
            encoded = None
        if encoded is not None and list(encoded["input_ids"]) == tokens:
            return [start for start, _ in encoded["offset_mapping"]]
        return list(itertools.accumulate((len(self.token_texts.text(t)) for t in tokens[:-1]), initial=0))

    def _top_dict(self, token_id: int, logprob: float, top: Iterable[tuple[int, float]]) -> dict[str, float]:
        """A position's legacy ``top_logprobs``: the most likely tokens and always the chosen one, as
        OpenAI documents (up to ``logprobs + 1`` entries)."""
        texts = self.token_texts
        ranked = {texts.text(t): lp for t, lp in top}
        ranked[texts.text(token_id)] = logprob  # last, unless among them; and its own, should texts collide
        return ranked

    def _completion_logprobs(self, events: Sequence[TokenEvent], text_offset: int) -> CompletionLogprobs:
        texts = self.token_texts
        out = CompletionLogprobs()
        for e in events:
            token = texts.text(e.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob if e.logprob is not None else 0.0)
            out.top_logprobs.append(self._top_dict(e.token_id, out.token_logprobs[-1], e.top_logprobs or ()))
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    # ------------------------------------------------------------ Parrot primitives

    async def fill_context(self, request: ContextFillRequest) -> FillResult:
        if (request.tokens is None) == (request.text is None):
            raise EngineBadRequest("give exactly one of 'tokens' and 'text'", "tokens")
        if request.if_absent and (request.context_id is None or request.parent_context_id is not None):
            raise EngineBadRequest("'if_absent' needs a 'context_id' and no 'parent_context_id'", "if_absent")
        tokens = request.tokens if request.tokens is not None else text_tokens(self.tokenizer, request.text or "")
        if not tokens:
            raise EngineBadRequest("nothing to fill: 'tokens'/'text' is empty", "tokens")
        self._check_token_ids(tokens, "tokens")
        try:
            if request.if_absent:
                created = self.llm.ensure_context(request.context_id, tokens)
                length = self.llm.context_length(request.context_id)
                length = len(tokens) if length is None else length  # None: freed meanwhile; it held these
                return FillResult(request.context_id, length, 0 if created else length)
            return await self.llm.fill(tokens, context_id=request.context_id, parent_context_id=request.parent_context_id)
        except Exception as exc:
            raise _translate(exc) from exc

    async def free_context(self, context_id: str) -> int:
        try:
            return await self.llm.free_context(context_id)
        except Exception as exc:
            raise _translate(exc) from exc

    async def generate_in_context(self, context_id: str, request: ContextGenerateRequest) -> ContextGeneration:
        context_tokens, suffix_tokens, pieces = self._start_in_context(context_id, request)
        result = ChoiceResult()
        async with aclosing(_translated(pieces)) as translated:
            async for piece in translated:
                result.add(piece)
        usage = _usage_of(suffix_tokens, len(result.token_ids))
        return ContextGeneration(result.text, result.token_ids, result.finish_reason, usage, context_tokens)

    async def generate_in_context_stream(self, context_id: str, request: ContextGenerateRequest) -> AsyncIterator[Piece]:
        """Generates after a context's tokens and appends the output to it; with ``fork``, after the
        context's tokens plus ``text``/``tokens`` in a temporary child, leaving the context as it was."""
        _, _, pieces = self._start_in_context(context_id, request)
        async with aclosing(_translated(pieces)) as translated:
            async for piece in translated:
                yield piece

    def _start_in_context(self, context_id: str, request: ContextGenerateRequest) -> tuple[int, int, AsyncIterator[Piece]]:
        """Checks and starts a generation after a context: (the context's tokens, the request's own, pieces)."""
        suffix = self._suffix_tokens(request)
        if suffix and not request.fork:
            raise EngineBadRequest("'text'/'tokens' need 'fork': true (fill a context to append to it)", "fork")
        if request.fork and not suffix:
            raise EngineBadRequest("'fork' needs 'text' or 'tokens' to generate from", "text")
        if request.context_text is not None and not request.fork:
            raise EngineBadRequest("'context_text' needs 'fork': true", "context_text")
        params = self.sampling_params(request, len(suffix), logprobs=request.logprobs,
                                      top_logprobs=request.top_logprobs)
        detok = IncrementalDetokenizer(self.tokenizer, request.stop_list())
        length = self.llm.context_length(context_id)
        # Tokenized only to create the context: requests that find it (most) skip that.
        context = text_tokens(self.tokenizer, request.context_text) if request.context_text and length is None else None
        events = (self.llm.generate_from_prompt(suffix, params, parent_context_id=context_id, parent_tokens=context)
                  if request.fork else self.llm.generate(context_id, params))
        context_tokens = length if length is not None else len(context or ())  # 0: not found, as the events say
        return context_tokens, len(suffix), decode_events(events, detok, self._hidden_ids(params))

    def _suffix_tokens(self, request: ContextGenerateRequest) -> list[int]:
        if request.text is not None and request.tokens is not None:
            raise EngineBadRequest("give at most one of 'tokens' and 'text'", "tokens")
        if request.tokens is not None:
            self._check_token_ids(request.tokens, "tokens")
            return request.tokens
        return text_tokens(self.tokenizer, request.text) if request.text else []

    # ------------------------------------------------------------ shared machinery

    def sampling_params(
        self, request: Any, prompt_len: int, *, logprobs: bool, top_logprobs: int, prompt_param: str = "prompt"
    ) -> SamplingParams:
        """OpenAI fields (unset = None) as normalised ``SamplingParams`` for a prompt of ``prompt_len``."""
        remaining = self.llm.max_model_len - prompt_len
        if remaining < (0 if request.token_limit() == 0 else 1):  # 0: an echoed prompt only scored
            raise EngineBadRequest(
                f"the prompt is {prompt_len} tokens; this model's context window is {self.llm.max_model_len}", prompt_param
            )
        limit = request.token_limit()
        if limit is not None and limit > remaining:  # as vLLM and OpenAI: an error, not a silently shorter answer
            raise EngineBadRequest(
                f"this model's context window is {self.llm.max_model_len} tokens; the prompt is {prompt_len} and "
                f"{limit} more were asked for: reduce the prompt or max_tokens",
                "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens")
        if limit is None:
            limit = _default_max_tokens(request, remaining)
        logit_bias = {int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None
        if logit_bias:
            self._check_token_ids(logit_bias, "logit_bias")
        stop_token_ids = list(request.stop_token_ids or ())
        self._check_token_ids(stop_token_ids, "stop_token_ids")
        return SamplingParams(
            max_tokens=limit,
            temperature=_or(request.temperature, 1.0),
            top_p=_or(request.top_p, 1.0),
            top_k=request.top_k if request.top_k else -1,  # 0 and None both mean "disabled"
            min_p=_or(request.min_p, 0.0),
            seed=request.seed,
            presence_penalty=_or(request.presence_penalty, 0.0),
            frequency_penalty=_or(request.frequency_penalty, 0.0),
            repetition_penalty=_or(request.repetition_penalty, 1.0),
            logit_bias=logit_bias,
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(request.ignore_eos),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            priority=request.priority or 0,
            throughput=request.criteria == "throughput",
        )

    def _check_token_ids(self, token_ids: Iterable[int], param: str) -> None:
        # An out-of-range id would fail inside the model's embedding, on the engine's thread.
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineBadRequest(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", param)

    def _hidden_ids(self, params: SamplingParams) -> frozenset[int]:
        return self.eos_token_ids | frozenset(params.stop_token_ids)

    async def _collect(self, jobs: list[PromptJob], pieces: AsyncIterator[tuple[int, Piece]] | None = None
                       ) -> list[ChoiceResult]:
        results = [ChoiceResult() for job in jobs for _ in job.params]
        async for index, piece in pieces or self._run_all(jobs):
            results[index].add(piece)
        return results

    def _run_all(self, jobs: list[PromptJob]) -> AsyncIterator[tuple[int, Piece]]:
        streams = [self._run_job(job) for job in jobs]
        return streams[0] if len(streams) == 1 else _merge_tagged(streams)

    async def _run_job(self, job: PromptJob) -> AsyncIterator[tuple[int, Piece]]:
        """All choices of one prompt, interleaved as they are produced, tagged with choice index."""
        try:
            if len(job.params) == 1:
                events = self.llm.generate_from_prompt(job.tokens, job.params[0])
                async for piece in self._pieces(events, job, job.params[0]):
                    yield job.first_index, piece
                return
            # n > 1: compute the prompt once and fork it, so every choice shares its KV blocks.
            # The parent holds all but the last token: each choice computes that one itself
            # (it needs its logits anyway) in a temporary child the core frees when it ends.
            *shared, last = job.tokens
            parent = new_id("prompt") if shared else None  # named up front so a cancelled fill is freed too
            try:
                if parent is not None:
                    await self.llm.fill(shared, context_id=parent)
                streams = [
                    self._pieces(self.llm.generate_from_prompt([last], p, parent_context_id=parent), job, p)
                    for p in job.params
                ]
                async for offset, piece in _merge(streams):
                    yield job.first_index + offset, piece
            finally:
                if parent is not None:
                    await self._free_quietly(parent)
        except Exception as exc:
            raise _translate(exc) from exc

    def _pieces(self, events: AsyncIterator[TokenEvent], job: PromptJob, params: SamplingParams) -> AsyncIterator[Piece]:
        detok = IncrementalDetokenizer(self.tokenizer, job.stop, job.tokens)
        return decode_events(events, detok, self._hidden_ids(params))

    async def _free_quietly(self, context_id: str) -> None:
        try:
            await asyncio.shield(self.llm.free_context(context_id))
        except (KeyError, asyncio.CancelledError):
            pass  # already evicted, or we are being torn down (the shielded free still completes)


# ---------------------------------------------------------------- helpers


def _parse(body: dict[str, Any], request_type: type[T]) -> T:
    try:
        return msgspec.convert(body, request_type)
    except msgspec.ValidationError as exc:
        raise EngineBadRequest(str(exc)) from exc


def _validate(request: ChatCompletionRequest | CompletionRequest) -> None:
    try:
        request.validate()
    except InvalidRequest as exc:
        raise EngineBadRequest(str(exc), exc.param) from exc
    unimplemented = request.unimplemented_extras()
    if unimplemented:
        raise EngineBadRequest(f"{unimplemented[0]} is not supported by the builtin engine", unimplemented[0])


def _check_text_only(messages: list[ChatMessage], model: str) -> None:
    """Images, audio and files would be dropped unseen: refused instead, as OpenAI refuses them for a
    model without that modality."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type in ("image_url", "input_audio", "file"):
                raise EngineBadRequest(f"model {model!r} takes text only; messages[{i}].content[{j}] is a part "
                                       f"of type {part.type}", f"messages[{i}].content[{j}]")


def _default_max_tokens(request: Any, remaining: int) -> int:
    """A choice's length when the request names no max_tokens: legacy completions 16 (as OpenAI's and
    vLLM's), anything else the room left in the context window; never above its max_tokens_limit (a
    gateway's cap)."""
    default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, remaining) if isinstance(request, CompletionRequest) else remaining
    return min(default, request.max_tokens_limit or default)


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` copies of ``params``; seeded requests give choice i the seed ``seed + i``."""
    if n == 1:
        return [params]
    seeds = [None] * n if params.seed is None else [params.seed + i for i in range(n)]
    return [msgspec.structs.replace(params, seed=seed) for seed in seeds]


def _tool_finish_reason(finish_reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _tool_delta(reader: ToolCallReader, piece: Piece) -> tuple[ChatDelta, str | None]:
    """One streamed piece of a tools-grammar output as content and/or tool-call deltas."""
    content, calls = reader.feed(piece.text)
    if piece.finish_reason is not None:
        content += reader.finish()
    return ChatDelta(content=content or None, tool_calls=calls or None), _tool_finish_reason(piece.finish_reason, reader.calls)


async def _nothing_generated(jobs: list[PromptJob]) -> AsyncIterator[tuple[int, Piece]]:
    for job in jobs:
        for index in job.indices:
            yield index, Piece("", [], [], "length")


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(first.tokens + then.tokens, first.token_logprobs + then.token_logprobs,
                              first.top_logprobs + then.top_logprobs, first.text_offset + then.text_offset)


def _usage_of(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def _usage(jobs: list[PromptJob], results: list[ChoiceResult]) -> Usage:
    return _usage_of(sum(len(job.tokens) for job in jobs), sum(len(r.token_ids) for r in results))


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_DONE = object()


async def _merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's position.

    Leaving early (or one stream failing) cancels and closes every stream, which aborts their
    sequences in the core.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((position, item))
        except Exception as exc:
            queue.put_nowait((position, _Failed(exc)))
        finally:
            queue.put_nowait((position, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, _Failed):
                raise item.exc
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge_tagged(streams: list[AsyncIterator[tuple[int, T]]]) -> AsyncIterator[tuple[int, T]]:
    """Merges streams whose items already carry their choice index."""
    async for _, tagged in _merge(streams):
        yield tagged
