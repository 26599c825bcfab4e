"""Parrot's context primitives on the builtin engine: fill (with fork), generate after a context (or
forked from it), free; and their request bodies."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Annotated, AsyncIterator, NamedTuple

import msgspec
from msgspec import Meta

from engines.builtin.splicing import SEAM_TOKENS
from engines.builtin.tokenizer import IncrementalDetokenizer, text_tokens
from engines.builtin.serving.named_outputs import Output
from engines.seam.contexts import FillResult, ForkPart
from wire.openai import (
    Usage,
    new_id,
)
from wire.sampling import SamplingWithHints, check_sampling
from engines.builtin.serving.errors import EngineBadRequest, translate, translated
from engines.builtin.serving.choices import ChoiceResult, Piece, cached_tokens, decode_events, usage_of
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
    # (named by their output_id), taken as the text they answered once produced (named_outputs.py).
    parts: list[ForkPart] | None = None
    # A name for this generation's output, so that later requests can take it as input (parts).
    output_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    fork: bool = False
    # With fork: the context's own text, to create it from if it does not exist yet. Requests naming
    # one new prefix can then all be sent at once: the first creates it, and the step that computes
    # it (or the prefix cache after) shares its KV with every fork. With it, the prompt is exactly the
    # tokenization of this text and the fork's as one text (splicing.py); without it, the fork's text is
    # tokenized on its own.
    context_text: str | None = None
    # With fork: the fork's context is kept under this id once its generation finishes (stop or length), holding
    # its prompt and output, instead of freed: how a gateway continues a conversation from where its turn ended
    # (then trimmed to the next prompt's start, ``trim``). An aborted or failed one is freed.
    keep_as: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # With fork and context_text: a context that holds other tokens than its text's first ones (a kept generation,
    # whose end the next prompt renders otherwise) is first trimmed to their common prefix, as ``trim`` does, and
    # the fork follows it: one call where trim then fork took two round trips on the next turn's way.
    trim: bool = False
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0
    stream: bool = False

    def __post_init__(self) -> None:  # a ValueError here is a msgspec.ValidationError: a 400
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1")
        check_sampling(self)

    def token_limit(self) -> int | None:
        return self.max_tokens


class ContextTrimRequest(msgspec.Struct, kw_only=True):
    text: str  # the text the context should hold: it keeps the longest common prefix of its tokens and this text's


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


class Prompt(NamedTuple):
    """A generation's prompt: the tokens after its ``parent`` context (None: it runs on its own)."""

    parent: str | None
    tokens: list[int]
    parent_tokens: list[int] | None = None  # to create the parent from when it does not exist
    context_tokens: int = 0  # of the whole prompt, those counted as the context's (usage: the rest are its own)
    own_ahead: int = 0  # of its own tokens, those the parent holds (its text computed ahead)

    @property
    def own_tokens(self) -> int:
        return self.own_ahead + len(self.tokens)


class Seam(NamedTuple):
    """Where a fork's text meets its context."""

    tokens: list[int]  # the context's text's tokens, which the splice may change at its end
    length: int  # the context's tokens the fork follows (0: none; it runs on its own)
    create: list[int] | None  # the context's tokens when the fork creates it
    healed: bool  # whether the seam is healed (the context's text given)

    def holds(self, keep: int) -> bool:
        """Whether the fork can follow the context: the splice keeps its every token (those of the context's text
        after the ones the context holds, a trimmed context's, are then the fork's to compute)."""
        return not self.healed or (0 < self.length <= keep)

    @property
    def whole(self) -> bool:
        """Whether the context holds all its text's tokens."""
        return not self.healed or self.length == len(self.tokens)


class Started(NamedTuple):
    context_tokens: int
    own_tokens: int
    pieces: AsyncIterator[Piece]


class Ahead:
    """A fork's text before its first awaited output, being computed in a child context while it waits."""

    def __init__(self, context_id: str, lead: list[int], filled: asyncio.Future, serving: ModelServing):
        self.context_id = context_id
        self.lead = lead
        self.filled = filled
        self._serving = serving

    async def tokens(self) -> list[int] | None:
        """The tokens it holds once computed; None when its fill failed (the fork then follows the context)."""
        try:
            await asyncio.shield(self.filled)
        except asyncio.CancelledError:
            if not self.filled.cancelled():
                raise  # we are cancelled, not the fill
            return None
        except Exception:
            return None
        return self.lead

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

    async def trim(self, context_id: str, request: ContextTrimRequest) -> FillResult:
        """Keeps the longest common prefix of the context's tokens and ``request.text``'s (as a fork with that text as
        its ``context_text`` tokenizes it), and their KV: a kept generation's context made the start of the next
        prompt, whose fork computes the rest (where the template renders the output otherwise than it was generated)."""
        tokens = self.splicer.left_tokens(request.text)
        try:
            kept = self.llm.trim_context(context_id, tokens)
        except Exception as exc:
            raise translate(exc) from exc
        return FillResult(context_id, kept, kept)

    async def free(self, context_id: str) -> int:
        try:
            return await self.llm.free_context(context_id)
        except Exception as exc:
            raise translate(exc) from exc

    async def generate(self, context_id: str, request: ContextGenerateRequest) -> ContextGeneration:
        started = await self._start(context_id, request)
        result = ChoiceResult()
        async with aclosing(translated(started.pieces)) as checked:
            async for piece in checked:
                result.add(piece)
        return ContextGeneration(result.text, result.token_ids, result.finish_reason,
                                 _usage(started, len(result.token_ids), cached_tokens(result.events)),
                                 started.context_tokens)

    async def generate_stream(self, context_id: str, request: ContextGenerateRequest
                              ) -> AsyncIterator[ContextGenerationChunk]:
        """Generates after a context's tokens and appends the output to it; with ``fork``, after the
        context's tokens plus ``text``/``tokens``/``parts`` in a temporary child, leaving the context as it was."""
        started = await self._start(context_id, request)
        generated, cached = 0, None
        async with aclosing(translated(started.pieces)) as checked:
            async for piece in checked:
                generated += len(piece.token_ids)
                cached = cached if cached is not None else cached_tokens(piece.events)
                chunk = ContextGenerationChunk(piece.text, piece.token_ids, piece.finish_reason)
                if piece.finish_reason is not None:
                    chunk.usage, chunk.context_tokens = _usage(started, generated, cached), started.context_tokens
                yield chunk

    async def _start(self, context_id: str, request: ContextGenerateRequest) -> Started:
        """Checks and starts a generation after a context. A fork given as parts first waits for the outputs
        they name; its text before the first of them is computed meanwhile (``_ahead``), so that only the
        rest is left once they are produced."""
        self._check_suffix(request)
        if request.output_id is not None:
            self.named_outputs.begin(request.output_id)  # first: its consumers may already be waiting
        ahead = None
        try:
            if request.fork and request.tokens is None:
                ahead = self._ahead(context_id, request)
                prompt, inputs_step = await self._spliced_prompt(context_id, request, ahead)
            else:
                prompt, inputs_step = self._unspliced_prompt(context_id, request)
            params = self.sampling_params(request, prompt.own_tokens, logprobs=request.logprobs,
                                          top_logprobs=request.top_logprobs)
            events = (self.llm.generate_from_prompt(prompt.tokens, params, parent_context_id=prompt.parent,
                                                    parent_tokens=prompt.parent_tokens, keep_as=request.keep_as)
                      if request.fork else self.llm.generate(context_id, params))
        except BaseException as exc:
            if request.output_id is not None:
                self.named_outputs.fail(request.output_id, f"its request failed ({exc})")
            if ahead is not None:
                await ahead.drop()
            if isinstance(exc, Exception) and (translated_exc := translate(exc)) is not exc:
                raise translated_exc from exc
            raise
        hidden = self.hidden_ids(params)
        pieces = decode_events(events, IncrementalDetokenizer(self.tokenizer, request.stop_list()), hidden)
        if request.output_id is not None or inputs_step is not None:
            pieces = self._handed_off(pieces, request.output_id, inputs_step, ahead)
        elif ahead is not None:
            await ahead.drop()
        return Started(prompt.context_tokens, prompt.own_tokens, pieces)

    async def _spliced_prompt(self, context_id: str, request: ContextGenerateRequest, ahead: "Ahead | None"
                              ) -> tuple[Prompt, int | None]:
        """A fork's prompt: its context's text and its own text tokenized as one text (splicing.py), the prompt a
        plain request would send (without the context's text, its own text as one text). It follows the
        context while those tokens keep the context's, and its text computed ahead while they keep those
        too; else (a merge across the seam) it runs on its own, the prefix cache sharing the context's
        full blocks."""
        seam = self._seam(context_id, request)
        rest, inputs_step = await self._fork_text(request)
        keep, tail = self.splicer.splice(request.context_text or "", rest)
        if not seam.holds(keep):
            if seam.create is not None:
                self.llm.ensure_context(context_id, seam.create)  # the requests after this one fork it
            return Prompt(None, seam.tokens[:keep] + tail), inputs_step
        tail = seam.tokens[seam.length:keep] + tail if seam.healed else tail
        if ahead is not None:
            computed = await ahead.tokens()
            if computed is not None and tail[:len(computed)] == computed:
                return Prompt(ahead.context_id, tail[len(computed):], context_tokens=seam.length,
                              own_ahead=len(computed)), inputs_step
        return Prompt(context_id, tail, parent_tokens=seam.create, context_tokens=seam.length), inputs_step

    def _ahead(self, context_id: str, request: ContextGenerateRequest) -> "Ahead | None":
        """Starts computing a fork's text before its first awaited output, in a child of the context (made
        first when it does not exist yet), its last few tokens held back: they may merge with the output."""
        parts = request.parts or []
        waits = next((i for i, part in enumerate(parts) if part.output_of is not None), None)
        if not waits:
            return None
        seam = self._seam(context_id, request)
        keep, tail = self.splicer.splice(request.context_text or "", "".join(part.text or "" for part in parts[:waits]))
        lead = tail[:-SEAM_TOKENS]
        if not seam.holds(keep) or not seam.whole or not lead:
            return None
        if seam.create is not None:
            self.llm.ensure_context(context_id, seam.create)
        child = new_id("ahead")
        return Ahead(child, lead, asyncio.ensure_future(
            self.llm.fill(lead, context_id=child, parent_context_id=context_id, priority=request.priority or 0)), self)

    def _seam(self, context_id: str, request: ContextGenerateRequest) -> "Seam":
        if not request.context_text:
            return Seam([], self.llm.context_length(context_id) or 0, None, healed=False)
        tokens = self.splicer.left_tokens(request.context_text)
        length = self.llm.holds_prefix(context_id, tokens)
        if length == -1 and request.trim:
            length = self.llm.trim_context(context_id, tokens)
        if length is None:
            return Seam(tokens, len(tokens), tokens, healed=True)
        # -1: the context holds other tokens than its text's first ones
        return Seam(tokens, max(length, 0), None, healed=True)

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
        for name in ("context_text", "keep_as"):
            if getattr(request, name) is not None and not request.fork:
                raise EngineBadRequest(f"'{name}' needs 'fork': true", name)
        if request.trim and not (request.fork and request.context_text):
            raise EngineBadRequest("'trim' needs 'fork': true and a 'context_text' to trim the context to", "trim")
        for i, part in enumerate(request.parts or ()):
            if (part.text is None) == (part.output_of is None):
                raise EngineBadRequest("each part is one of 'text' and 'output_of'", f"parts.{i}")
            if part.output_of is not None and part.output_of == request.output_id:
                raise EngineBadRequest("a generation cannot take its own output as input", f"parts.{i}")

    def _unspliced_prompt(self, context_id: str, request: ContextGenerateRequest) -> tuple[Prompt, None]:
        """A generation appended to a context, or a fork given as token ids."""
        length = self.llm.context_length(context_id) or 0  # 0: not found, as its events will say
        if request.tokens is not None:
            self.check_token_ids(request.tokens, "tokens")
        return Prompt(context_id, request.tokens or [], context_tokens=length), None

    async def _fork_text(self, request: ContextGenerateRequest) -> tuple[str, int | None]:
        """A fork's text, each output its parts name taken as the text it answered once produced; with such
        outputs, the step that produced the last of them."""
        if request.parts is None:
            return request.text or "", None
        texts: list[str] = []
        inputs_step = None
        for part in request.parts:
            if part.output_of is None:
                texts.append(part.text or "")
                continue
            output = await self.named_outputs.wait(part.output_of)
            texts.append(output.text)
            inputs_step = max(inputs_step or 0, output.step)
        return "".join(texts), inputs_step

    async def _handed_off(self, pieces: AsyncIterator[Piece], output_id: str | None, inputs_step: int | None,
                          ahead: "Ahead | None") -> AsyncIterator[Piece]:
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
                        self._settle(output_id, result)
                        output_id = None
                    yield piece
        finally:
            if output_id is not None:
                self._settle(output_id, result)
            if ahead is not None:
                await ahead.drop()

    def _settle(self, output_id: str, result: ChoiceResult) -> None:
        """The named output produced from the generation's result, or failed when it did not finish."""
        if result.finish_reason in ("stop", "length") and result.events:
            self.named_outputs.produce(output_id, Output(result.text, result.events[-1].step))
        else:
            self.named_outputs.fail(output_id, f"its generation ended without finishing "
                                               f"({result.finish_reason or 'cancelled or failed'})")


def _usage(started: Started, generated: int, cached: int | None) -> Usage:
    """A context generation's usage: its own prompt tokens, of those the ones it did not compute (the first
    token's count covers the whole prompt, the context's tokens included)."""
    own_cached = min(started.own_tokens, max(0, (cached or 0) - started.context_tokens))
    return usage_of(started.own_tokens, generated, own_cached)
