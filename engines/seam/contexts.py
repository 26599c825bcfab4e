"""What the context capability answers (interface.ContextEngine), as the builtin engine's HTTP API sends it."""

from __future__ import annotations

from typing import Any

import msgspec


class FillResult(msgspec.Struct):
    context_id: str
    num_tokens: int  # tokens the context holds after the fill, its parent's included
    cached_tokens: int  # of those, how many were reused (parent or prefix cache) rather than computed


class Generation(msgspec.Struct):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any]  # prompt_tokens: the request's own (a fork's text), not the context's
    context_tokens: int  # the context's tokens the generation followed

    def prompt_usage(self) -> tuple[int, int]:
        """The whole prompt's tokens, the context's included, and of those the ones not computed for it."""
        details = self.usage.get("prompt_tokens_details") or {}
        return (self.context_tokens + self.usage.get("prompt_tokens", 0),
                self.context_tokens + details.get("cached_tokens", 0))


class GenerationChunk(msgspec.Struct):
    """One streamed step of a generation after a context; the last (with its finish reason) also carries
    the whole generation's ``usage`` and ``context_tokens``, as ``Generation`` has them."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    context_tokens: int | None = None


class ForkPart(msgspec.Struct, omit_defaults=True):
    """A piece of a fork's text: constant ``text``, or the output of an earlier generation on the same
    engine, named by its ``output_id`` (``output_of``), taken as the text it answered. A fork given
    as parts waits on the engine until every output it names is produced."""

    text: str | None = None
    output_of: str | None = None


class Segment(msgspec.Struct, omit_defaults=True):
    """A piece of a split prompt's rest: constant text, or where a variable's value goes."""

    text: str = ""
    variable: str | None = None


class PromptSplit(msgspec.Struct):
    """A rendered prompt cut where its first variable starts: the constant ``prefix`` (empty when there is
    no place to cut), and the ``rest`` with each variable as its own segment."""

    prefix: str
    rest: list[Segment]

    def rest_with(self, values: dict[str, str]) -> str:
        """The rest as text, variables replaced by ``values`` (a variable not in them keeps its placeholder)."""
        return "".join(s.text if s.variable is None else values.get(s.variable, "{{" + s.variable + "}}")
                       for s in self.rest)
