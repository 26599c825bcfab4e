"""The semantic-variable placeholder grammar, shared by the gateway and client code:
``{{name}}``, ``{{input:name}}``, ``{{output:name}}``; names are identifiers (dots and dashes allowed).
Group 1 is the kind ("input", "output" or None for a bare name), group 2 the name."""

from __future__ import annotations

import re
from typing import Any, Callable

PLACEHOLDER = re.compile(r"\{\{\s*(?:(input|output)\s*:\s*)?([A-Za-z_][\w.\-]*)\s*\}\}")


def map_texts(route: str, body: dict[str, Any], change: Callable[[str], str]) -> dict[str, Any]:
    """A copy of an OpenAI request body with ``change`` applied to every text placeholders may sit in:
    each message's content (string or text parts) for chat, the prompt(s) for completions."""
    body = dict(body)
    if route == "completions":
        prompt = body["prompt"]
        body["prompt"] = change(prompt) if isinstance(prompt, str) else [
            change(p) if isinstance(p, str) else p for p in prompt]
        return body
    messages = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": change(content)}
        elif isinstance(content, list):
            message = {**message, "content": [
                {**part, "text": change(part["text"])} if part.get("type") == "text" else part for part in content]}
        messages.append(message)
    body["messages"] = messages
    return body


def texts(route: str, body: dict[str, Any]) -> list[str]:
    """Every text of a request body that placeholders may sit in."""
    found: list[str] = []
    map_texts(route, body, lambda text: found.append(text) or text)
    return found
