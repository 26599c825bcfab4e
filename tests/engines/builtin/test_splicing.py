"""Splicing text onto text whose tokens are known: always the tokens of the whole, on SmolLM2's real
tokenizer (byte-level BPE), from the seams where merges cross to random mixes of words, bytes and
special tokens."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engines.builtin.splicing import TokenSplicer

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

PIECES = ["Cats", " cats", "the", " ", "  ", "\n", "\n\n", "abc", "def", "é", "日本", "123", "4567", ":", "::",
          "'s", "don", "'t", "<|im_start|>", "<|im_end|>", "user", " assistant", "http://x.y/z", "😀", ".", ",",
          "\t", "{{", "}}", "-", "--", "supercalifragilisticexpialidocious"]


@pytest.fixture(scope="module")
def splicer(smollm2_tokenizer_dir):
    return TokenSplicer(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir))


def whole(splicer: TokenSplicer, left: str, right: str) -> list[int]:
    keep, tail = splicer.splice(left, right)
    return splicer.left_tokens(left)[:keep] + tail


@pytest.mark.parametrize("left, right", [
    ("Combine these notes into one paragraph: ", "Cats sleep."),  # " " + "Cats" is one token, " Cats"
    ("Combine these notes into one paragraph:", " Cats sleep."),
    ("<|im_start|>user\nSummarize this part of a report in two sentences.\n\n", "The railway"),
    ("A word cut in the midd", "le of itself"),
    ("Ends inside a character \xe6", "\u0301 and goes on"),
    ("Numbers 12", "345 and more"),
    ("", "only the right"),
    ("only the left", ""),
])
def test_a_splice_is_the_tokenization_of_the_whole(splicer, left, right):
    assert whole(splicer, left, right) == splicer.tokens(left + right)


def test_random_mixes_splice_as_the_whole_tokenizes(splicer):
    rng = random.Random(56)
    for _ in range(600):
        left = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 24)))
        right = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
        assert whole(splicer, left, right) == splicer.tokens(left + right), (left, right)


def test_a_seam_at_a_pre_token_boundary_keeps_every_left_token(splicer):
    """How a gateway cuts a prefix (before the whitespace that precedes a variable): the context's tokens
    all stand, and only the right text's are new; a left text ending in that whitespace loses its last."""
    left = "<|im_start|>user\nCombine these notes into one paragraph:"
    keep, tail = splicer.splice(left, " Cats sleep all day.")
    assert keep == len(splicer.left_tokens(left)) and tail == splicer.tokens(" Cats sleep all day.")
    keep, _ = splicer.splice(left + " ", "Cats sleep all day.")
    assert keep == len(splicer.left_tokens(left + " ")) - 1
