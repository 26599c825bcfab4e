"""Logprobs as OpenAI writes them: chat's per-token objects, legacy completions' parallel lists (and
the offsets of an echoed prompt's tokens)."""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence


from engines.builtin.tokenizer import TokenTexts
from engines.builtin.types import TokenEvent
from wire.openai import (
    ChoiceLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)


class LogprobsWriter:
    def __init__(self, tokenizer: Any, token_texts: TokenTexts):
        self.tokenizer = tokenizer
        self.token_texts = token_texts

    def chat(self, events: Iterable[TokenEvent]) -> ChoiceLogprobs:
        texts = self.token_texts
        content = [
            TokenLogprob(
                token=texts.text(e.token_id),
                logprob=e.logprob if e.logprob is not None else 0.0,
                bytes=texts.bytes(e.token_id),
                top_logprobs=[
                    TopLogprob(token=texts.text(t), logprob=lp, bytes=texts.bytes(t)) for t, lp in e.top_logprobs or ()
                ],
            )
            for e in events
        ]
        return ChoiceLogprobs(content=content)



    def offsets(self, text: str, tokens: list[int]) -> list[int]:
        """Where each token starts in ``text``: the tokenizer's own offsets when ``text`` tokenizes to
        ``tokens`` (pieces of one character share its offset), else the running length of token texts."""
        try:
            encoded = self.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        except NotImplementedError:  # a slow tokenizer has no offsets
            encoded = None
        if encoded is not None and list(encoded["input_ids"]) == tokens:
            return [start for start, _ in encoded["offset_mapping"]]
        return list(itertools.accumulate((len(self.token_texts.text(t)) for t in tokens[:-1]), initial=0))

    def top_dict(self, token_id: int, logprob: float, top: Iterable[tuple[int, float]]) -> dict[str, float]:
        """A position's legacy ``top_logprobs``: the most likely tokens and always the chosen one, as
        OpenAI documents (up to ``logprobs + 1`` entries)."""
        texts = self.token_texts
        ranked = {texts.text(t): lp for t, lp in top}
        ranked[texts.text(token_id)] = logprob  # last, unless among them; and its own, should texts collide
        return ranked

    def completion(self, events: Sequence[TokenEvent], text_offset: int) -> CompletionLogprobs:
        texts = self.token_texts
        out = CompletionLogprobs()
        for e in events:
            token = texts.text(e.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob if e.logprob is not None else 0.0)
            out.top_logprobs.append(self.top_dict(e.token_id, out.token_logprobs[-1], e.top_logprobs or ()))
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out
