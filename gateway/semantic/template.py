"""``{{name}}`` placeholders: finding them, splitting prompts at them, substituting values."""

from __future__ import annotations

from typing import Iterator

import msgspec

from wire.placeholders import PLACEHOLDER


class Piece(msgspec.Struct, frozen=True):
    """A template chunk: constant text, or a placeholder (kind "input" or "output")."""

    text: str = ""
    name: str | None = None
    kind: str = "text"


def split(template: str) -> list[Piece]:
    pieces: list[Piece] = []
    position = 0
    for match in PLACEHOLDER.finditer(template):
        if match.start() > position:
            pieces.append(Piece(text=template[position:match.start()]))
        pieces.append(Piece(name=match.group(2), kind=match.group(1) or "input"))
        position = match.end()
    if position < len(template):
        pieces.append(Piece(text=template[position:]))
    return pieces


def names(text: str) -> Iterator[str]:
    for match in PLACEHOLDER.finditer(text):
        if match.group(1) != "output":
            yield match.group(2)


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace each input placeholder by its value; the caller has checked that all are bound."""
    return PLACEHOLDER.sub(lambda m: values[m.group(2)] if m.group(1) != "output" else m.group(0), text)
