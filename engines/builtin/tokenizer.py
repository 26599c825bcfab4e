"""Text <-> tokens for the serving layer: chat prompts in, streamed text deltas out.

Prompts are rendered by the model's own chat template (``apply_chat_template``) so the
engine never hand-formats a conversation. Output is decoded incrementally, vLLM/TGI style:
a token can end in the middle of a UTF-8 character, and byte-level or SentencePiece
tokenizers can change how earlier text is rendered once the next token arrives, so each step
decodes a short window of tokens and only releases text once it is stable.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Sequence

from tokenizers.decoders import DecodeStream

from wire.openai import ChatMessage, Tool

# How many earlier tokens each incremental decode re-reads, so that merges and leading-space
# rules see their left context (vLLM uses the same figure).
DECODE_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what a decode renders for an incomplete UTF-8 sequence


# ---------------------------------------------------------------- prompts


def message_to_template_dict(message: ChatMessage) -> dict[str, Any]:
    """One OpenAI message as the dict HF chat templates read (content always a string)."""
    role = "system" if message.role == "developer" else message.role  # templates predate "developer"
    rendered: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    return rendered


def _arguments(arguments: str) -> Any:
    """Tool-call arguments as a dict when they are JSON: templates apply ``tojson`` to them."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _render(tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, tokenize: bool) -> Any:
    tool_dicts = [{"type": "function", "function": _function_dict(tool)} for tool in tools] if tools else None
    return tokenizer.apply_chat_template(
        [message_to_template_dict(m) for m in messages],
        tools=tool_dicts,
        add_generation_prompt=True,
        tokenize=tokenize,
        return_dict=tokenize,
    )


def chat_prompt_tokens(tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None = None) -> list[int]:
    """The token ids of a conversation rendered by the model's chat template, ready for the reply."""
    return list(_render(tokenizer, messages, tools, tokenize=True)["input_ids"])


def chat_prompt_text(tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[Tool] | None = None) -> str:
    """The same conversation as text: what a gateway splits into a shared prefix and the rest."""
    return _render(tokenizer, messages, tools, tokenize=False)


def _function_dict(tool: Tool) -> dict[str, Any]:
    fn = tool.function
    rendered: dict[str, Any] = {"name": fn.name, "parameters": fn.parameters or {"type": "object", "properties": {}}}
    if fn.description is not None:
        rendered["description"] = fn.description
    return rendered


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """Raw text as token ids, no BOS or other special tokens added (for completions and contexts)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


class TokenTexts:
    """Per-token strings and bytes for logprobs, cached because the same ids recur constantly."""

    def __init__(self, tokenizer: Any):
        self._decode_one = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def text(self, token_id: int) -> str:
        return self._decode_one(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode())


# ---------------------------------------------------------------- output


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, cutting at the first stop string.

    ``push`` returns the text that is safe to show now: text that can no longer change as more
    tokens arrive and that cannot be the start of a stop string. Once a stop string appears,
    ``stop_reason`` names it and the output ends right before it, even when it spans tokens.
    ``finish`` releases whatever was held back when the sequence ends for another reason.

    Fast tokenizers decode through tokenizers' ``DecodeStream`` (a fraction of the time a token of re-decoding a
    window of tokens); slow ones, and an incomplete last character at ``finish``, through the window.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), prompt_tokens: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._stops = [s for s in stop if s]
        # Seed the window with the prompt's tail so the first token decodes in context.
        self._tokens: list[int] = list(prompt_tokens[-DECODE_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the window re-decoded for context
        self._read_offset = len(self._tokens)  # tokens before this are already in ``text``
        self.text = ""  # all stable output text so far (cut at the stop string once found)
        self._released = 0  # how much of ``text`` has been returned to the caller
        self.stop_reason: str | None = None
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(self._tokens, skip_special_tokens=True) if self._backend is not None else None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, token_id: int) -> str:
        """Adds one generated token; returns the newly releasable text (often empty)."""
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        if self._stream is None:
            self.text += self._stable_new_text(allow_partial=False)
        else:
            piece = self._stream.step(self._backend, token_id)
            if piece is not None:  # None: the token ends mid-character; the stream holds it
                self.text += piece
                self._prefix_offset = max(0, len(self._tokens) - DECODE_CONTEXT_TOKENS)
                self._read_offset = len(self._tokens)
        return self._release()

    def finish(self) -> str:
        """The sequence ended without a stop string: flush incomplete characters and held text."""
        if self.stopped:
            return ""
        self.text += self._stable_new_text(allow_partial=True)
        released = self._release()
        if self.stopped:
            return released
        tail = self.text[self._released :]
        self._released = len(self.text)
        return released + tail

    def _stable_new_text(self, allow_partial: bool) -> str:
        window = self._tokens[self._prefix_offset :]
        if len(self._tokens) == self._read_offset:
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not allow_partial):
            return ""  # the last token ends mid-character (or merges back): wait for more
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    def _release(self) -> str:
        """Text from the last release up to the first stop match, or up to a possible stop prefix."""
        start = self._released
        match_at, match = self._first_stop_match(start)
        if match is not None:
            self.stop_reason = match
            self.text = self.text[:match_at]
            end = match_at
        else:
            end = len(self.text) - self._held_back(start)
        self._released = max(end, start)
        return self.text[start : self._released]

    def _first_stop_match(self, start: int) -> tuple[int, str | None]:
        # Text before ``start`` was released only because no stop string could begin there.
        best_at, best = len(self.text) + 1, None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if 0 <= at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _held_back(self, start: int) -> int:
        """Length of the longest tail of the unreleased text that some stop string starts with."""
        pending = self.text[start:]
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest
