"""Where a prompt is cut so that its constant prefix can be shared: the seam's ``split_prompt``, on the
engine, beside the tokenizer and chat template whose rules it follows.

The request is rendered with a private-use marker where each ``{{variable}}`` sits (no chat template
or tokenizer gives those characters meaning, and users don't type them); the prefix is the text
before the first marker, less the whitespace just before it, which BPE joins to what follows ("of " +
"France" tokenizes as "of" + " France": the context then keeps its tokens when a fork's text is spliced
to it, see splicing.py). A chat prompt without variables is cut where its last message starts. A prompt
with no place to cut, or whose template does not render values verbatim, has an empty prefix.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import msgspec

from engines.seam import PromptSplit, Route, Segment
from wire.openai import ChatMessage, Tool
from wire.placeholders import PLACEHOLDER, map_texts, texts

_OPEN, _CLOSE = "\ue000", "\ue001"
_LAST_MESSAGE = f"{_OPEN}{_CLOSE}"  # an empty name: where a prompt with no variables is cut
_MARKER = re.compile(f"{_OPEN}([^{_CLOSE}]*){_CLOSE}")

RenderChat = Callable[[list[ChatMessage], "list[Tool] | None"], str]


class PromptSplitRequest(msgspec.Struct):
    route: Route
    body: dict[str, Any]  # the request's messages (and tools) or prompt, placeholders in its texts


def split_prompt(request: PromptSplitRequest, render_chat: RenderChat) -> PromptSplit:
    prompt = _marked_prompt(request.route, request.body, render_chat)
    cut = prompt.find(_OPEN)
    if cut < 0 or not _values_render_verbatim(request, render_chat):
        return PromptSplit(prefix="", rest=[Segment(text=prompt)])
    while cut > 0 and prompt[cut - 1].isspace():
        cut -= 1
    return PromptSplit(prefix=prompt[:cut], rest=_segments(prompt[cut:]))


def _values_render_verbatim(request: PromptSplitRequest, render_chat: RenderChat) -> bool:
    """Whether the chat template puts each value into the prompt as it is: a value substituted into the
    split's rest must give the text that rendering the substituted messages gives. A template that trims
    a message's content (Llama 3's ``| trim``) would drop a value's edge whitespace there: such a prompt
    is not split, and runs as a plain request does."""
    if request.route == "completions":
        return True
    padded = _marked_prompt(request.route, request.body, render_chat, around=" \n")
    return all(f" \n{_OPEN}{name}{_CLOSE} \n" in padded for name in _MARKER.findall(padded) if name)


def _marked_prompt(route: Route, body: dict[str, Any], render_chat: RenderChat, around: str = "") -> str:
    """The prompt with each placeholder as a marker, ``around`` on each side of it."""
    has_variables = any(PLACEHOLDER.search(text) for text in texts(route, body))
    marked = map_texts(route, body, lambda text: PLACEHOLDER.sub(
        lambda m: f"{around}{_OPEN}{m.group(2)}{_CLOSE}{around}", text))
    if route == "completions":
        prompt = marked["prompt"]
        if not isinstance(prompt, str):
            raise msgspec.ValidationError("prompt must be one string to be split")
        return prompt
    last = marked["messages"][-1]
    if not has_variables and isinstance(last.get("content"), str):
        marked["messages"][-1] = {**last, "content": _LAST_MESSAGE + last["content"]}
    messages = msgspec.convert(marked["messages"], list[ChatMessage])
    tools = msgspec.convert(marked["tools"], list[Tool]) if marked.get("tools") else None
    return render_chat(messages, tools)


def _segments(rest: str) -> list[Segment]:
    segments: list[Segment] = []
    for i, piece in enumerate(_MARKER.split(rest)):  # text, name, text, name, ..., text
        if i % 2 and piece:
            segments.append(Segment(variable=piece))
        elif not i % 2 and piece:  # the last message's mark has no name: only its text is kept
            if segments and segments[-1].variable is None:
                segments[-1] = Segment(text=segments[-1].text + piece)
            else:
                segments.append(Segment(text=piece))
    return segments
