"""Structured output: ``response_format`` and ``tools`` as llguidance grammars, the per-sequence
matcher that masks logits, and the tool-call text format that the tools grammar enforces.

A constrained sequence carries a ``GrammarMatcher``; each step the sampler masks its logits row to
the tokens the grammar allows, then advances the matcher by the sampled token. Once the grammar
can take nothing more the sequence ends with "stop". Unconstrained sequences carry nothing and
the sampler never looks at them.

Tool calls are emitted as Hermes-style text, one call per ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (what SmolLM2 and most open chat models are tuned on) and read back into
OpenAI ``tool_calls`` by ``ToolCallReader``, incrementally, so streaming and non-streaming
responses come from the same code.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from wire.openai import ChatMessage, FunctionCall, ResponseFormat, Tool, ToolCall, ToolCallDelta
from wire.errors import InvalidRequest

log = logging.getLogger(__name__)

# Compact JSON: a small model given free whitespace can pad with newlines until max_tokens.
# The separators match json.dumps, so arguments read back look like what an app would write.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# Any text that is not a tool call: llguidance lexemes take intersection (&) and negation (~).
NOT_A_CALL = r"/[\s\S]*/ & ~(/\s*" + TOOL_CALL_OPEN + r"[\s\S]*/)"


# ---------------------------------------------------------------- requests -> grammars


@dataclass(frozen=True)
class OutputGrammar:
    """What a chat request asks of its output: a grammar (None: free text) and whether the
    output is to be read as tool calls."""

    grammar: str | None = None
    tool_calls: bool = False


def output_grammar(
    response_format: ResponseFormat | None,
    tools: Sequence[Tool] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> OutputGrammar:
    """The grammar for a chat request; raises ``InvalidRequest`` for schemas llguidance rejects."""
    choice = tool_choice if tool_choice is not None else "auto"
    if tools and choice != "none":
        answer = format_schema(response_format) if choice == "auto" else None
        if answer is not None:  # checked alone, so that a bad schema is named as such
            _check(response_format_grammar(response_format), "response_format")
        # Several calls only when asked for outright: small models otherwise repeat a call until max_tokens.
        grammar = tools_grammar(tools, choice, parallel_tool_calls is True, answer)
        _check_tools(grammar, tools)
        return OutputGrammar(grammar, tool_calls=True)
    grammar = response_format_grammar(response_format)
    if grammar is None and tools:  # "none": a model that has seen calls in the conversation may write one anyway
        from llguidance import LLMatcher

        return OutputGrammar(LLMatcher.grammar_from_lark(f"start: TEXT\nTEXT: {NOT_A_CALL}"))
    if grammar is not None:
        _check(grammar, "response_format")
    return OutputGrammar(grammar)


def response_format_grammar(response_format: ResponseFormat | None) -> str | None:
    from llguidance import LLMatcher

    schema = format_schema(response_format)
    return None if schema is None else LLMatcher.grammar_from_json_schema(schema)


def format_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema a response_format asks for, with its llguidance options; None for free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        schema, strict = {"type": "object"}, True
    else:
        spec = response_format.json_schema
        schema, strict = (spec.schema if spec is not None else None), bool(spec and spec.strict)
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format json_schema.schema must be a JSON object", "response_format")
    # Non-strict schemas may use keywords llguidance does not implement; it then ignores them. The
    # schema's own x-guidance options, if any, win over these defaults.
    return {**closed(schema), "x-guidance": {**JSON_STYLE, "lenient": not strict, **schema.get("x-guidance", {})}}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties
    and does not say otherwise. As xgrammar's strict mode (vLLM's default) does: otherwise a small
    model, once past the declared fields, tends to invent more until it runs out of tokens."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def tools_grammar(tools: Sequence[Tool], tool_choice: str | dict[str, Any], parallel: bool,
                  answer: dict[str, Any] | None = None) -> str:
    """Lark: one or more tool calls ("required", a named function), or for "auto" either
    tool calls or an answer: JSON following ``answer`` (a response_format's schema) if given,
    else text that is not a call."""
    from llguidance import LLMatcher

    tools = _chosen_tools(tools, tool_choice)
    bodies = [_call_schema(tool) for tool in tools]
    body = dict(bodies[0]) if len(bodies) == 1 else {"anyOf": bodies}
    # Options apply to a whole %json schema, so only at its top level.
    body["x-guidance"] = {**JSON_STYLE, "lenient": not all(tool.function.strict for tool in tools)}
    rules = [
        "start: calls" + (" | answer" if tool_choice == "auto" else ""),
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        f'call: "{TOOL_CALL_OPEN}" %json {json.dumps(body)} "{TOOL_CALL_CLOSE}"',
        f"answer: %json {json.dumps(answer)}" if answer is not None else "answer: TEXT",
        f"TEXT: {NOT_A_CALL}",
    ]
    return LLMatcher.grammar_from_lark("\n".join(rules))


def _chosen_tools(tools: Sequence[Tool], tool_choice: str | dict[str, Any]) -> list[Tool]:
    if isinstance(tool_choice, str):
        return list(tools)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    chosen = [tool for tool in tools if tool.function.name == name]
    if not chosen:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return chosen


def _call_schema(tool: Tool) -> dict[str, Any]:
    fn = tool.function
    return {
        "type": "object",
        # No parameters: an empty parameter list, as OpenAI reads it (not "any object").
        "properties": {"name": {"const": fn.name},
                       "arguments": closed(fn.parameters or {"type": "object", "properties": {}})},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _check_tools(grammar: str, tools: Sequence[Tool]) -> None:
    """Like ``_check``, naming the tool whose parameters schema is wrong (llguidance's own message for
    the whole tools grammar ends in an echo of its source)."""
    from llguidance import LLMatcher

    if not LLMatcher.validate_grammar(grammar):
        return
    for i, tool in enumerate(tools):
        _check(LLMatcher.grammar_from_json_schema(_call_schema(tool)), f"tools[{i}].function.parameters")
    _check(grammar, "tools")


def _check(grammar: str, param: str) -> None:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"invalid {param}: {error.strip().splitlines()[-1]}", param)


# ---------------------------------------------------------------- grammars -> masked decoding


class GrammarCompiler:
    """Builds per-sequence matchers; holds the llguidance tokenizer, built once per engine on first use
    (about half a second) so engines that never see a constrained request never pay for it."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]):
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, eos_token=self._eos_token_ids or None)
        return self._tokenizer

    def matcher(self, grammar: str) -> GrammarMatcher:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"invalid grammar: {matcher.get_error()}", "response_format")
        return GrammarMatcher(matcher, tokenizer.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def finished(self) -> bool:
        """Nothing more can follow (or the matcher failed, which masking should make impossible)."""
        return self.matcher.is_stopped()

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            log.warning("grammar rejected token %d: %s", token_id, self.matcher.get_error())


def mask_logits(logits: torch.Tensor, grammars: Sequence[tuple[int, GrammarMatcher]]) -> None:
    """Sets to -inf, in place, the logits of the tokens each constrained row's grammar forbids.

    logits: [batch, vocab]; grammars: (row, matcher) for the constrained rows only.
    """
    rows = [row for row, _ in grammars]
    words = (grammars[0][1].vocab_size + 31) // 32
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # [constrained, words]: token t is bit t%32 of word t//32
    for k, (_, grammar) in enumerate(grammars):
        grammar.matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [constrained, words, 32]
    allowed = bits.reshape(len(rows), words * 32).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # model rows past the tokenizer's vocabulary are never valid
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    forbidden = ~allowed[:, :vocab].to(logits.device, non_blocking=True)
    for k, row in enumerate(rows):  # in place on each row: no gather/scatter of the whole batch
        logits[row].masked_fill_(forbidden[k], float("-inf"))


# ---------------------------------------------------------------- tool calls in the prompt


def tool_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, chat_template: str | None) -> list[ChatMessage]:
    """The conversation as a template that does not render tools must see it: the tools described
    in the system message, and earlier assistant tool calls written out in the format the grammar
    enforces. Templates that render tools themselves get the messages unchanged."""
    template = chat_template or ""
    if "tools" in template and "tool_calls" in template:
        return list(messages)
    out = [_calls_as_text(m) if m.role == "assistant" and m.tool_calls else m for m in messages]
    if not tools:
        return out
    prompt = tool_prompt(tools)
    if out and out[0].role in ("system", "developer"):
        return [ChatMessage(role=out[0].role, content=f"{out[0].text()}\n\n{prompt}"), *out[1:]]
    return [ChatMessage(role="system", content=prompt), *out]


def tool_prompt(tools: Sequence[Tool]) -> str:
    lines = [json.dumps(_tool_dict(tool)) for tool in tools]
    return (
        "You can call these tools:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n"
        f'To call a tool, reply with {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <arguments object>}}'
        f"{TOOL_CALL_CLOSE}. Otherwise reply in plain text."
    )


def _tool_dict(tool: Tool) -> dict[str, Any]:
    fn = tool.function
    out: dict[str, Any] = {"name": fn.name}
    if fn.description:
        out["description"] = fn.description
    out["parameters"] = fn.parameters or {"type": "object", "properties": {}}
    return out


def _calls_as_text(message: ChatMessage) -> ChatMessage:
    calls = "\n".join(call_text(call.function.name, call.function.arguments) for call in message.tool_calls or ())
    text = message.text()
    return ChatMessage(role="assistant", content=f"{text}\n{calls}" if text else calls, name=message.name)


def call_text(name: str, arguments: str) -> str:
    try:
        args = json.dumps(json.loads(arguments or "{}"))
    except ValueError:
        args = json.dumps(arguments)
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {args}}}{TOOL_CALL_CLOSE}'


# ---------------------------------------------------------------- tool calls out of the output

_CALL_HEAD = re.compile(r'\s*' + re.escape(TOOL_CALL_OPEN) + r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*" + re.escape(TOOL_CALL_CLOSE))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Arguments:
    """Scans an arguments JSON value as it arrives, to know where it ends."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def scan(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all of them unless it ends inside)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


@dataclass
class ToolCallReader:
    """Reads a tools-grammar output as it streams: either plain content, or tool calls as OpenAI
    deltas (first id, type and name with empty arguments, then argument fragments)."""

    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _mode: str | None = None  # None until the first character: "content" or "calls"
    _arguments: _Arguments | None = None  # the call whose arguments are streaming

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Adds output text; returns the content and the tool-call deltas it releases."""
        self._buffer += text
        start = self._buffer.lstrip()
        if self._mode is None and start and not TOOL_CALL_OPEN.startswith(start):  # else: too early to tell
            self._mode = "calls" if start.startswith(TOOL_CALL_OPEN) else "content"
        if self._mode == "content":
            content, self._buffer = self._buffer, ""
            return content, []
        deltas: list[ToolCallDelta] = []
        while self._mode == "calls" and self._step(deltas):
            pass
        return "", deltas

    def finish(self) -> str:
        """The output ended: returns text that never became a call. Tool-call markup cut off (by
        max_tokens) is dropped: the model's call syntax is never a client's content."""
        leftover, self._buffer = self._buffer, ""
        stripped = leftover.strip()
        if not stripped or self._arguments is not None or self._mode == "calls" or TOOL_CALL_OPEN.startswith(stripped):
            return ""
        return leftover

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Consumes what it can of the buffer; returns whether to try again."""
        if self._arguments is None:
            head = _CALL_HEAD.match(self._buffer)
            if head is None:
                return False
            self._buffer = self._buffer[head.end() :]
            name = json.loads(f'"{head.group(1)}"')
            call = ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=""))
            self.calls.append(call)
            deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, "function", {"name": call.function.name, "arguments": ""}))
            self._arguments = _Arguments()
            return True
        if not self._arguments.done:
            if self._arguments.depth == 0:
                self._buffer = self._buffer.lstrip()  # the space after "arguments": when it came with the value
            taken = self._arguments.scan(self._buffer)
            fragment, self._buffer = self._buffer[:taken], self._buffer[taken:]
            if fragment:
                self.calls[-1].function.arguments += fragment
                deltas.append(ToolCallDelta(len(self.calls) - 1, function={"arguments": fragment}))
            return self._arguments.done
        tail = _CALL_TAIL.match(self._buffer)
        if tail is None:
            return False
        self._buffer = self._buffer[tail.end() :]
        self._arguments = None
        return True


def read_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole tools-grammar output as (content, tool calls)."""
    reader = ToolCallReader()
    content, _ = reader.feed(text)
    content += reader.finish()
    return (content if content or not reader.calls else None), reader.calls
