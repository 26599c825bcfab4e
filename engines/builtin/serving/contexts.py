"""Parrot's context primitives on the builtin engine: fill (with fork), generate after a context (or
forked from it), free; and their request bodies."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Annotated, AsyncIterator

import msgspec
from msgspec import Meta

from engines.builtin.tokenizer import IncrementalDetokenizer, text_tokens
from engines.builtin.serving.named_outputs import Output
from engines.seam.contexts import FillResult, ForkPart
from wire.openai import (
    Usage,
    new_id,
)
from wire.sampling import SamplingWithHints, check_sampling
from engines.builtin.serving.errors import EngineBadRequest, translate, translated
from engines.builtin.serving.choices import ChoiceResult, Piece, decode_events, usage_of
from engines.builtin.serving.model_serving import ModelServing


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
    # With fork, instead of text/tokens: the text as pieces, some of them earlier generations' outputs
    # (named by their output_id), spliced in as their token ids once produced (named_outputs.py).
    parts: list[ForkPart] | None = None
    # A name for this generation's output, so that later requests can take it as input (parts).
    output_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
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


class ContextGeneration(msgspec.Struct):
    """A whole generation appended to a context, as ``/v1/contexts/{id}/generate`` answers."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage  # prompt_tokens: the tokens given with the request (a fork's text), not the context's
    context_tokens: int  # the context's tokens the generation followed


class ContextGenerationChunk(msgspec.Struct, omit_defaults=True):
    """One streamed step of a generation appended to a context. The last one (with its finish reason)
    also carries the whole generation's ``usage`` and ``context_tokens``, as ``ContextGeneration`` has them."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    context_tokens: int | None = None


class Ahead:
    """A fork's text before its first awaited output, being computed in a child context while it waits."""

    def __init__(self, context_id: str, filled: asyncio.Future, serving: ModelServing):
        self.context_id = context_id
        self.filled = filled
        self._serving = serving

    async def drop(self) -> None:
        """Stops its fill if it still runs, and frees it."""
        self.filled.cancel()
        await asyncio.wait([self.filled])  # its end, not its error; a cancellation of ours still propagates
        await self._serving.free_quietly(self.context_id)


class ContextPrimitives(ModelServing):

    async def fill(self, request: ContextFillRequest) -> FillResult:
        if (request.tokens is None) == (request.text is None):
            raise EngineBadRequest("give exactly one of 'tokens' and 'text'", "tokens")
        if request.if_absent and (request.context_id is None or request.parent_context_id is not None):
            raise EngineBadRequest("'if_absent' needs a 'context_id' and no 'parent_context_id'", "if_absent")
        tokens = request.tokens if request.tokens is not None else text_tokens(self.tokenizer, request.text or "")
        if not tokens:
            raise EngineBadRequest("nothing to fill: 'tokens'/'text' is empty", "tokens")
        self.check_token_ids(tokens, "tokens")
        try:
            if request.if_absent:
                created = self.llm.ensure_context(request.context_id, tokens)
                length = self.llm.context_length(request.context_id)
                length = len(tokens) if length is None else length  # None: freed meanwhile; it held these
                return FillResult(request.context_id, length, 0 if created else length)
            return await self.llm.fill(tokens, context_id=request.context_id, parent_context_id=request.parent_context_id)
        except Exception as exc:
            raise translate(exc) from exc

    async def free(self, context_id: str) -> int:
        try:
            return await self.llm.free_context(context_id)
        except Exception as exc:
            raise translate(exc) from exc

    async def generate(self, context_id: str, request: ContextGenerateRequest) -> ContextGeneration:
        context_tokens, suffix_tokens, pieces = await self._start(context_id, request)
        result = ChoiceResult()
        async with aclosing(translated(pieces)) as checked:
            async for piece in checked:
                result.add(piece)
        usage = usage_of(suffix_tokens, len(result.token_ids))
        return ContextGeneration(result.text, result.token_ids, result.finish_reason, usage, context_tokens)

    async def generate_stream(self, context_id: str, request: ContextGenerateRequest
                              ) -> AsyncIterator[ContextGenerationChunk]:
        """Generates after a context's tokens and appends the output to it; with ``fork``, after the
        context's tokens plus ``text``/``tokens`` in a temporary child, leaving the context as it was."""
        context_tokens, suffix_tokens, pieces = await self._start(context_id, request)
        generated = 0
        async with aclosing(translated(pieces)) as checked:
            async for piece in checked:
                generated += len(piece.token_ids)
                chunk = ContextGenerationChunk(piece.text, piece.token_ids, piece.finish_reason)
                if piece.finish_reason is not None:
                    chunk.usage, chunk.context_tokens = usage_of(suffix_tokens, generated), context_tokens
                yield chunk

    async def _start(self, context_id: str, request: ContextGenerateRequest
                     ) -> tuple[int, int, AsyncIterator[Piece]]:
        """Checks and starts a generation after a context: (the context's tokens, the request's own, pieces).
        A fork given as parts first waits for the outputs they name; its text before the first of them is
        computed meanwhile (``_ahead``), so that only the rest is left once they are produced."""
        self._check_suffix(request)
        if request.output_id is not None:
            self.named_outputs.begin(request.output_id)  # first: its consumers may already be waiting
        length = self.llm.context_length(context_id)
        # Tokenized only to create the context: requests that find it (most) skip that.
        context = (text_tokens(self.tokenizer, request.context_text)
                   if request.context_text and length is None else None)
        ahead = made = None
        try:
            parts = request.parts or []
            waits = next((i for i, part in enumerate(parts) if part.output_of is not None), None)
            lead = self._text_tokens(parts[:waits]) if waits else []  # the text before the first awaited output
            if lead:
                ahead = await self._ahead(context_id, context, lead, request.priority or 0)
                made, context, parts = context, None, parts[waits:]  # the context exists now
            suffix, inputs_step = await self._suffix_tokens(request, parts)
            if ahead is not None:
                await ahead.filled
            params = self.sampling_params(request, len(lead) + len(suffix), logprobs=request.logprobs,
                                          top_logprobs=request.top_logprobs)
            detok = IncrementalDetokenizer(self.tokenizer, request.stop_list())
            parent = ahead.context_id if ahead is not None else context_id
            events = (self.llm.generate_from_prompt(suffix, params, parent_context_id=parent, parent_tokens=context)
                      if request.fork else self.llm.generate(context_id, params))
        except BaseException as exc:
            if request.output_id is not None:
                self.named_outputs.fail(request.output_id, f"its request failed ({exc})")
            if ahead is not None:
                await ahead.drop()
            if isinstance(exc, Exception) and (translated_exc := translate(exc)) is not exc:
                raise translated_exc from exc
            raise
        context_tokens = length if length is not None else len(made or context or ())  # 0: not found, as events say
        hidden = self.hidden_ids(params)
        pieces = decode_events(events, detok, hidden)
        if request.output_id is not None or inputs_step is not None:
            pieces = self._handed_off(pieces, request.output_id, inputs_step, hidden, ahead)
        return context_tokens, len(lead) + len(suffix), pieces

    async def _ahead(self, context_id: str, context: list[int] | None, lead: list[int], priority: int) -> "Ahead":
        """Starts computing a fork's text before its first awaited output, in a child of the context (made
        first from ``context`` when it does not exist yet)."""
        if context is not None:
            self.llm.ensure_context(context_id, context)
        child = new_id("ahead")
        return Ahead(child, asyncio.ensure_future(self.llm.fill(lead, context_id=child, parent_context_id=context_id,
                                                                priority=priority)), self)

    @staticmethod
    def _check_suffix(request: ContextGenerateRequest) -> None:
        given = [name for name in ("text", "tokens", "parts") if getattr(request, name) is not None]
        if len(given) > 1:
            raise EngineBadRequest(f"give at most one of 'text', 'tokens' and 'parts' (got {given})", given[1])
        has_suffix = bool(request.text or request.tokens or request.parts)
        if has_suffix and not request.fork:
            raise EngineBadRequest(f"'{given[0]}' needs 'fork': true (fill a context to append to it)", "fork")
        if request.fork and not has_suffix:
            raise EngineBadRequest("'fork' needs 'text', 'tokens' or 'parts' to generate from", "text")
        if request.context_text is not None and not request.fork:
            raise EngineBadRequest("'context_text' needs 'fork': true", "context_text")
        for i, part in enumerate(request.parts or ()):
            if (part.text is None) == (part.output_of is None):
                raise EngineBadRequest("each part is one of 'text' and 'output_of'", f"parts.{i}")
            if part.output_of is not None and part.output_of == request.output_id:
                raise EngineBadRequest("a generation cannot take its own output as input", f"parts.{i}")

    async def _suffix_tokens(self, request: ContextGenerateRequest, parts: list[ForkPart]
                             ) -> tuple[list[int], int | None]:
        """The fork's tokens (of ``parts`` when it has parts), and with parts naming outputs, the step that
        produced the last of those."""
        if request.tokens is not None:
            self.check_token_ids(request.tokens, "tokens")
            return request.tokens, None
        if request.parts is None:
            return (text_tokens(self.tokenizer, request.text) if request.text else []), None
        # The text parts tokenized first, while the outputs are still being generated, not after them.
        texts = [None if part.output_of is not None else self._text_tokens([part]) for part in parts]
        tokens: list[int] = []
        inputs_step = None
        for part, text in zip(parts, texts):
            if text is not None:
                tokens += text
                continue
            output = await self.named_outputs.wait(part.output_of)
            tokens += output.token_ids
            inputs_step = max(inputs_step or 0, output.step)
        return tokens, inputs_step

    def _text_tokens(self, parts: list[ForkPart]) -> list[int]:
        """Text parts as tokens, each part tokenized on its own (the handoff's rule at the seams)."""
        return [token for part in parts for token in text_tokens(self.tokenizer, part.text or "")]

    async def _handed_off(self, pieces: AsyncIterator[Piece], output_id: str | None, inputs_step: int | None,
                          hidden: frozenset[int], ahead: "Ahead | None") -> AsyncIterator[Piece]:
        """``pieces``, with the output named ``output_id`` once the generation ends (failed if it does not),
        the steps this request waited after its last input was produced measured, and the context its text
        was computed ahead in freed."""
        result = ChoiceResult()
        try:
            async with aclosing(pieces):
                async for piece in pieces:
                    if inputs_step is not None and piece.events:
                        self.llm.metrics.handoff_wait.observe(piece.events[0].step - inputs_step)
                        inputs_step = None
                    result.add(piece)
                    if piece.finish_reason is not None and output_id is not None:
                        # Before the last piece is written out: its consumers need not wait for the write.
                        self._settle(output_id, result, hidden)
                        output_id = None
                    yield piece
        finally:
            if output_id is not None:
                self._settle(output_id, result, hidden)
            if ahead is not None:
                await ahead.drop()

    def _settle(self, output_id: str, result: ChoiceResult, hidden: frozenset[int]) -> None:
        """The named output produced from the generation's result, or failed when it did not finish."""
        if result.finish_reason in ("stop", "length") and result.events:
            self.named_outputs.produce(output_id, Output(self._output_ids(result, hidden), result.events[-1].step))
        else:
            self.named_outputs.fail(output_id, f"its generation ended without finishing "
                                               f"({result.finish_reason or 'cancelled or failed'})")

    def _output_ids(self, result: ChoiceResult, hidden: frozenset[int]) -> list[int]:
        """What a consumer takes of an output: the ids generated, an ending EOS or stop token left out, when
        they decode to its text; else (a stop string cut the text inside a token) its text tokenized."""
        ids = result.token_ids
        if result.finish_reason == "stop" and ids and ids[-1] in hidden:
            ids = ids[:-1]
        return ids if self.tokenizer.decode(ids) == result.text else text_tokens(self.tokenizer, result.text)
