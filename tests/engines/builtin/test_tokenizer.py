"""The chat template and the incremental detokenizer, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import msgspec
import pytest

from engines.builtin.tokenizer import IncrementalDetokenizer, chat_prompt_tokens, text_tokens
from wire.openai import ChatMessage, FunctionCall, FunctionDefinition, Tool, ToolCall

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

MULTILINGUAL = "Déjà vu: 日本語のテキスト 🦜🦜 and naïve café — done."


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def stream(tokenizer, text: str, stop=(), prompt_tokens=()) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds ``text``'s tokens one by one, as the engine would; returns the deltas released."""
    detok = IncrementalDetokenizer(tokenizer, stop, prompt_tokens)
    deltas = []
    for token_id in text_tokens(tokenizer, text):
        deltas.append(detok.push(token_id))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return [d for d in deltas if d], detok


def test_tokens_split_mid_character_stream_back_to_the_exact_text(tokenizer):
    ids = text_tokens(tokenizer, MULTILINGUAL)
    # The case under test: some tokens alone are not valid UTF-8.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas, detok = stream(tokenizer, MULTILINGUAL)
    assert "".join(deltas) == MULTILINGUAL == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.stop_reason is None
    assert len(deltas) > 10  # streamed, not released all at the end


def test_first_token_decodes_with_its_leading_space_after_a_prompt(tokenizer):
    prompt = text_tokens(tokenizer, "The capital of France is")
    deltas, _ = stream(tokenizer, " Paris, of course.", prompt_tokens=prompt)
    assert deltas[0].startswith(" Paris")
    assert "".join(deltas) == " Paris, of course."


def test_stop_string_spanning_tokens_cuts_exactly_and_is_never_leaked(tokenizer):
    text = "The capital of France is Paris. It is lovely."
    stop = "is Par"  # crosses the " is" / " Paris" token boundary
    ids = text_tokens(tokenizer, text)
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    deltas, detok = stream(tokenizer, text, stop=[stop])
    assert "".join(deltas) == "The capital of France " == detok.text
    assert detok.stop_reason == stop
    # Nothing that could begin the stop string was released early.
    assert not any(d.endswith(("i", "is", "is ", "is P", "is Pa")) for d in deltas)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, detok = stream(tokenizer, "one, two, three. four", stop=["three", ", t", "four"])
    assert "".join(deltas) == "one"
    assert detok.stop_reason == ", t"


def test_held_back_stop_prefix_is_released_when_the_sequence_ends(tokenizer):
    deltas, detok = stream(tokenizer, "I love Paris", stop=["Paris!"])
    assert "".join(deltas) == "I love Paris"
    assert deltas[-1].endswith("Paris")  # held until finish()
    assert detok.stop_reason is None


def test_stop_string_inside_multibyte_text(tokenizer):
    deltas, detok = stream(tokenizer, MULTILINGUAL, stop=["🦜"])
    assert "".join(deltas) == "Déjà vu: 日本語のテキスト "
    assert detok.stop_reason == "🦜"


def test_special_tokens_are_not_rendered(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(t) for t in text_tokens(tokenizer, "Hi there") + [tokenizer.eos_token_id])
    assert out + detok.finish() == "Hi there"


def test_chat_prompt_uses_the_model_template(tokenizer):
    ids = chat_prompt_tokens(tokenizer, [ChatMessage(role="user", content="What is the capital of France?")])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_prompt_accepts_developer_tool_calls_tool_messages_and_tools(tokenizer):
    messages = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content=[{"type": "text", "text": "Weather?"}]),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[ToolCall(id="call_1", function=FunctionCall(name="weather", arguments='{"city": "Paris"}'))],
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ]
    tools = [Tool(function=FunctionDefinition(name="weather", parameters={"type": "object"}))]
    messages = msgspec.convert(msgspec.to_builtins(messages), list[ChatMessage])
    text = tokenizer.decode(chat_prompt_tokens(tokenizer, messages, tools))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
