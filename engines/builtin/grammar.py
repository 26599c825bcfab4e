"""Structured output, compiled: ``response_format`` and ``tools`` as llguidance grammars, and the
compiler that turns a grammar into a per-context matcher (grammar_mask.py applies it each step).

Tool calls are emitted in the model family's syntax (tool_prompt.ToolCallSyntax: Hermes-style text unless the
chat template teaches another) and read back into OpenAI ``tool_calls`` (tool_calls.py).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Sequence


from wire.openai import ResponseFormat, Tool
from wire.errors import InvalidRequest
from engines.builtin.grammar_mask import GrammarMatcher
from engines.builtin.tool_prompt import HERMES, ToolCallSyntax

log = logging.getLogger(__name__)

# Compact JSON: a small model given free whitespace can pad with newlines until max_tokens.
# The separators match json.dumps, so arguments read back look like what an app would write.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


REGEX_METACHARACTERS = set("\\.^$|?*+()[]{}/")


def not_a_call(syntax: ToolCallSyntax) -> str:
    """Any text that is not a tool call in ``syntax``: llguidance lexemes take intersection (&) and negation (~)."""
    marker = "".join("\\" + ch if ch in REGEX_METACHARACTERS else ch for ch in syntax.marker)
    return r"/[\s\S]*/ & ~(/\s*" + marker + r"[\s\S]*/)"


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
    syntax: ToolCallSyntax = HERMES,
) -> OutputGrammar:
    """The grammar for a chat request; raises ``InvalidRequest`` for schemas llguidance rejects."""
    choice = tool_choice if tool_choice is not None else "auto"
    if tools and choice != "none":
        answer = format_schema(response_format) if choice == "auto" else None
        if answer is not None:  # checked alone, so that a bad schema is named as such
            _check(response_format_grammar(response_format), "response_format")
        # Several calls only when asked for outright: small models otherwise repeat a call until max_tokens.
        grammar = tools_grammar(tools, choice, parallel_tool_calls is True, answer, syntax)
        _check_tools(grammar, tools)
        return OutputGrammar(grammar, tool_calls=True)
    grammar = response_format_grammar(response_format)
    if grammar is None and tools:  # "none": a model that has seen calls in the conversation may write one anyway
        from llguidance import LLMatcher

        return OutputGrammar(LLMatcher.grammar_from_lark(f"start: TEXT\nTEXT: {not_a_call(syntax)}"))
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
                  answer: dict[str, Any] | None = None, syntax: ToolCallSyntax = HERMES) -> str:
    """Lark: one or more tool calls ("required", a named function), or for "auto" either
    tool calls or an answer: JSON following ``answer`` (a response_format's schema) if given,
    else text that is not a call."""
    from llguidance import LLMatcher

    tools = _chosen_tools(tools, tool_choice)
    bodies = [_call_schema(tool, syntax.arguments_key) for tool in tools]
    body = dict(bodies[0]) if len(bodies) == 1 else {"anyOf": bodies}
    # Options apply to a whole %json schema, so only at its top level.
    body["x-guidance"] = {**JSON_STYLE, "lenient": not all(tool.function.strict for tool in tools)}
    rules = [
        "start: calls" + (" | answer" if tool_choice == "auto" else ""),
        "calls: " + _literals(syntax.start, "call", f'({_literals(syntax.separator)} call)*' if parallel else "",
                              syntax.end),
        "call: " + _literals(syntax.open, f"%json {json.dumps(body)}", syntax.close),
        f"answer: %json {json.dumps(answer)}" if answer is not None else "answer: TEXT",
        f"TEXT: {not_a_call(syntax)}",
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


def _literals(*parts: str) -> str:
    """A Lark sequence of ``parts``: the syntax's texts as string literals (the empty ones left out), rules as they are."""
    rules = {"call"}
    return " ".join(part if part in rules or part.startswith(("(", "%json")) else json.dumps(part) for part in parts if part)


def _call_schema(tool: Tool, arguments_key: str = "arguments") -> dict[str, Any]:
    fn = tool.function
    return {
        "type": "object",
        # No parameters: an empty parameter list, as OpenAI reads it (not "any object").
        "properties": {"name": {"const": fn.name},
                       arguments_key: closed(fn.parameters or {"type": "object", "properties": {}})},
        "required": ["name", arguments_key],
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
