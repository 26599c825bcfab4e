"""Text appended to text whose tokens are already known (a context's prefix, a fork's text computed ahead),
tokenized exactly as the whole would be: what makes a semantic call's prompt the prompt a plain request
sends, token for token.

Tokenizing the right text on its own and appending its ids is wrong at the seam: BPE merges across it
(" " + "Cats" is two tokens, " Cats" one). Re-tokenizing the whole left text for each request is right but
costs milliseconds for a long shared prefix. So the seam is healed: the left text's last few tokens are
tokenized again together with the right text, from a cut whose tokens cannot depend on what follows.
For a byte-level BPE with a regex pre-tokenizer (GPT-2, Llama 3, Qwen, SmolLM2) only the last pre-token
of a text can change when text is appended, and tokens never cross pre-tokens; a cut a few tokens back
therefore holds unless it falls inside a long word. That is checked, not assumed: the seam is tokenized
from a second cut further back, and the two must agree. Where they do not (the cut fell inside a word),
or where the tokenizer gives no offsets, the whole is tokenized: never wrong, only slower.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

# Tokens before the end of the left text where the seam is cut; the check cuts twice as far back.
SEAM_TOKENS = 4
# Characters of the right text the cut's check tokenizes (merges reach no further than a pre-token).
CHECK_CHARS = 32


class Spliced(NamedTuple):
    """``left_ids[:keep] + tail`` is the tokenization of left + right."""

    keep: int
    tail: list[int]


class _Encoded(NamedTuple):
    ids: list[int]
    starts: list[int]  # each token's first character in the text
    ends: list[int]


class TokenSplicer:
    def __init__(self, tokenizer: Any, max_kept: int = 64):
        """``max_kept``: left texts whose encodings are kept (a shared prefix is spliced by every fork)."""
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer, no offsets
        self._encodings: OrderedDict[str, _Encoded] = OrderedDict()
        self._max_kept = max_kept

    def tokens(self, text: str) -> list[int]:
        """``text`` on its own, no special tokens added."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def left_tokens(self, text: str) -> list[int]:
        """``tokens(text)``, remembered for the splices to come."""
        return self._encoded(text).ids

    def splice(self, left: str, right: str) -> Spliced:
        """How ``left``'s tokens change, and what follows them, when ``right`` is appended to it."""
        encoded = self._encoded(left)
        ids = encoded.ids
        if not right:
            return Spliced(len(ids), [])
        near = self._cut(encoded, len(ids) - SEAM_TOKENS)
        far = self._cut(encoded, near - SEAM_TOKENS)
        if self._backend is None or far <= 0 or not self._agree(left, right, encoded, near, far):
            return _spliced(ids, 0, self.tokens(left + right))
        return _spliced(ids, near, self.tokens(left[encoded.starts[near]:] + right))

    def _agree(self, left: str, right: str, encoded: _Encoded, near: int, far: int) -> bool:
        """Whether tokenizing the seam from ``near`` gives what tokenizing it from ``far`` (further back) gives:
        then ``near`` does not fall inside a pre-token whose merges the left text's earlier part decides."""
        head = right[:CHECK_CHARS]
        from_near = self.tokens(left[encoded.starts[near]:] + head)
        from_far = self.tokens(left[encoded.starts[far]:] + head)
        return from_far == encoded.ids[far:near] + from_near

    @staticmethod
    def _cut(encoded: _Encoded, at: int) -> int:
        """The last token at or before ``at`` that starts a character (a byte-level token can end mid-character:
        its successor then shares its first character), 0 when none does."""
        at = max(0, at)
        while at > 0 and encoded.starts[at] < encoded.ends[at - 1]:
            at -= 1
        return at

    def _encoded(self, text: str) -> _Encoded:
        encoded = self._encodings.get(text)
        if encoded is not None:
            self._encodings.move_to_end(text)
            return encoded
        if self._backend is None:
            encoded = _Encoded(self.tokens(text), [], [])
        else:
            encoding = self._backend.encode(text, add_special_tokens=False)
            encoded = _Encoded(list(encoding.ids), [s for s, _ in encoding.offsets], [e for _, e in encoding.offsets])
        self._encodings[text] = encoded
        if len(self._encodings) > self._max_kept:
            self._encodings.popitem(last=False)
        return encoded


def _spliced(ids: list[int], cut: int, after_cut: list[int]) -> Spliced:
    """The splice whose tokens from ``cut`` on are ``after_cut``: the left tokens they repeat are kept."""
    same = 0
    for left_id, new_id in zip(ids[cut:], after_cut):
        if left_id != new_id:
            break
        same += 1
    return Spliced(cut + same, after_cut[same:])
