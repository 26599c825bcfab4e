"""The translations to and from chat completions (gateway/translation/), pure: no gateway needed."""

from __future__ import annotations

import msgspec

from gateway.translation.chat import ChunkReader
from gateway.translation.messages import stop_reason, tool_input
from gateway.translation.messages import to_chat as messages_to_chat
from gateway.translation.responses import chat_messages
from wire.anthropic import MessagesRequest
from wire.responses import FunctionCallItem, FunctionCallOutputItem, MessageItem, OutputText, ReasoningItem


def test_an_assistant_turns_text_and_calls_are_one_chat_message():
    messages = chat_messages("Be brief.", [
        MessageItem(role="developer", content="Use tools."),
        MessageItem(role="user", content="weather?"),
        MessageItem(role="assistant", content=[OutputText(text="Looking.")]),
        ReasoningItem(),
        FunctionCallItem(call_id="c1", name="w", arguments='{"x": 1}'),
        FunctionCallItem(call_id="c2", name="w", arguments='{"x": 2}'),
        FunctionCallOutputItem(call_id="c1", output="sunny"),
        FunctionCallOutputItem(call_id="c2", output="rain")])

    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool", "tool"]
    assert messages[3]["content"] == "Looking." and [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]


def test_anthropic_stop_reasons():
    assert stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", None, ["END"]) == ("end_turn", None)
    assert stop_reason("stop", 2, ["END"]) == ("end_turn", None)  # a stop token, not a sequence
    assert stop_reason("length", None, None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, None) == ("tool_use", None)


def test_tool_arguments_that_are_no_object_are_kept():
    assert tool_input('{"a": 1}') == {"a": 1} and tool_input("") == {}
    assert tool_input("[1]") == {"arguments": [1]} and tool_input("{oops") == {"arguments": "{oops"}


def test_tool_results_come_before_the_users_text():
    request = msgspec.convert({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "and now?"}]}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "tools": [{"name": "w", "input_schema": {"type": "object"}}]}, MessagesRequest)

    chat = messages_to_chat(request)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "user"]
    assert chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"x": 1}'}}]}
    assert chat["messages"][2]["content"] == "Error: boom"
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False


def test_chunks_are_read_whatever_the_reads_boundaries():
    data = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n'
    reader = ChunkReader()
    chunks = [chunk for at in range(0, len(data), 7) for chunk in reader.feed(data[at:at + 7])]
    assert [c.choices[0].delta.content for c in chunks[:1]] == ["a"] and chunks[1].usage.prompt_tokens == 3
    assert len(chunks) == 2
