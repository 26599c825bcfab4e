"""An app as a graph of calls, built from the benchmark workloads' own messages (benchmarks/workloads/): each call's
prompt in pieces (constant text, values, and the outputs of the calls it waits for), its output length and its
criteria, as Parrot's gateway knows them from the ``parrot`` extension.

The same graph is run either way (benchmarks/sim/gateway.py, benchmarks/sim/client.py): a client calls a call
once it holds every input; Parrot's gateway, once they are bound on its side.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

from benchmarks.sim.prompt import Piece
from benchmarks.sim.token_counter import count

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


class Input(NamedTuple):
    """A piece of a prompt that is another call's output."""

    producer: str


class Call(NamedTuple):
    name: str  # unique in its app
    pieces: tuple[Piece | Input, ...]
    output_tokens: int
    latency: bool = True  # someone waits on it alone (else throughput work: a task group's member)
    group: str | None = None


class App(NamedTuple):
    name: str
    calls: tuple[Call, ...]  # producers before consumers
    final: str  # the call whose answer ends the app
    setup_round_trips: int = 0  # Parrot: round trips before the graph goes out (multi-agent makes its variables)
    think_s: float = 0.0  # a client's pause before each call that follows another (a chat user's think time)
    plain: bool = False  # plain requests even through Parrot (a chat user's turns): the client makes each call

    def inputs(self, call: Call) -> list[str]:
        return [piece.producer for piece in call.pieces if isinstance(piece, Input)]


def _text_piece(text: str, kind: str = "t") -> Piece:
    """A piece named by its text: the template's own text (``t``) or a value the app fills in (``v``, named
    apart per run: every run of an app has its own document, user, question)."""
    return (f"{kind}:" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), count(text))


def rendered(messages: list[dict[str, str]], values: dict[str, str], inputs: dict[str, str]
             ) -> tuple[Piece | Input, ...]:
    """``messages`` as SmolLM2's chat template renders them (ChatML, the assistant's turn opened), in pieces:
    each ``{{name}}`` a value's text (``values``) or the output of the call ``inputs`` names."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    pieces: list[Piece | Input] = []
    start = 0
    for match in _PLACEHOLDER.finditer(text):
        if match.start() > start:
            pieces.append(_text_piece(text[start:match.start()]))
        name = match.group(1)
        pieces.append(Input(inputs[name]) if name in inputs else _text_piece(values[name], "v"))
        start = match.end()
    if start < len(text):
        pieces.append(_text_piece(text[start:]))
    return tuple(pieces)
