"""A request's prompt prefix as a chain of hashes, known before any tokenizer runs, for the scheduler to match
against what each engine holds.

The prompt is taken as the bytes of what renders it: for chat, the tools and then the messages in order (a
shared system prompt, tools and leading turns come first); for completions, the prompt text. Those bytes are
cut into fixed chunks and each chunk's hash covers every chunk before it (a chain, as over KV blocks in
nano-vllm and vLLM): two prompts share their first k hashes exactly when they share their first k chunks, so
the longest run of an engine's hashes is the prefix it holds. Only full chunks count; the ragged tail (the
newest turn, mostly) is no one's to share.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engines.seam import ResponsesRoute, Route

CHUNK_BYTES = 256  # about 64 tokens of English: 4 KV blocks of 16
TOKENS_PER_CHUNK = 64
_encode = msgspec.json.Encoder().encode


def chain(seed: str, text: bytes) -> tuple[int, ...]:
    """The chain hashes of ``text``'s full chunks, rooted in ``seed`` (the model: engines key caches by it)."""
    hashes = []
    previous = hash(seed)
    for start in range(0, len(text) - CHUNK_BYTES + 1, CHUNK_BYTES):
        previous = hash((previous, text[start:start + CHUNK_BYTES]))
        hashes.append(previous)
    return tuple(hashes)


def rendered(route: Route | ResponsesRoute, body: dict[str, Any]) -> bytes:
    """The bytes a request's prompt is rendered from, leading with what requests share."""
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):  # a batch of prompts: placed by its first
            prompt = prompt[0] if prompt else ""
        return prompt.encode() if isinstance(prompt, str) else _encode(prompt)
    if route == "responses":
        return _encode([body.get("tools"), body.get("instructions"), body.get("input")])
    return _encode([body.get("tools"), body.get("messages")])


def prompt_prefix(route: Route | ResponsesRoute, body: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """The prompt's chain hashes and its length in tokens, estimated from its bytes (the scheduler weighs
    prefill by it)."""
    text = rendered(route, body)
    return chain(str(body.get("model")), text), tokens_in(len(text))


def tokens_in(size: int) -> int:
    """Tokens in ``size`` bytes of prompt, as the scheduler estimates them (no tokenizer in the gateway)."""
    return size * TOKENS_PER_CHUNK // CHUNK_BYTES
