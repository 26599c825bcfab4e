"""Tiny GGUF files written by the tests: the byte-level BPE vocabulary they share."""

from __future__ import annotations


def byte_level_vocab() -> list[str]:
    """Every byte as GPT-2's tokenizer spells it, one merge ("Ġt"), then end-of-text and the chat markers."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def add_byte_level_tokenizer(writer, vocab: list[str]) -> None:
    """``vocab`` (byte_level_vocab()) as a GGUF's gpt2 tokenizer: its last three tokens special, the first of them
    BOS and the last EOS."""
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_merges(["Ġ t"])
    writer.add_token_types([1] * (len(vocab) - 3) + [3] * 3)
    writer.add_bos_token_id(len(vocab) - 3)
    writer.add_eos_token_id(len(vocab) - 1)
