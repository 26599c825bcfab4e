"""Tool calls in each family's own syntax: the grammar makes the model write it, the reader reads it back into
OpenAI tool calls, whole or streamed a character at a time; which syntax a chat template teaches."""

from __future__ import annotations

import json

import pytest

from engines.builtin.grammar import output_grammar
from engines.builtin.tool_calls import ToolCallReader, read_tool_calls
from engines.builtin.tool_prompt import HERMES, LLAMA3_JSON, MISTRAL, tool_call_syntax
from wire.openai import FunctionDefinition, Tool

OUTPUTS = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
}
SYNTAXES = {"hermes": HERMES, "mistral": MISTRAL, "llama3_json": LLAMA3_JSON}


def calls_of(reader_calls):
    return [(call.function.name, json.loads(call.function.arguments)) for call in reader_calls]


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_each_syntax_reads_back_whole_and_streamed(syntax):
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, calls = read_tool_calls(OUTPUTS[syntax], SYNTAXES[syntax])
    assert content is None and calls_of(calls) == expected
    reader = ToolCallReader(SYNTAXES[syntax])
    streamed = "".join(reader.feed(ch)[0] for ch in OUTPUTS[syntax]) + reader.finish()
    assert streamed == "" and calls_of(reader.calls) == expected


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_plain_text_stays_content(syntax):
    assert read_tool_calls("It is sunny in Paris.", SYNTAXES[syntax]) == ("It is sunny in Paris.", [])


@pytest.fixture(scope="module")
def guidance_tokenizer(smollm2_tokenizer_dir):
    import llguidance.hf
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    return hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer)


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_the_grammar_takes_the_syntax_and_no_other(syntax, guidance_tokenizer):
    from llguidance import LLMatcher

    hf_tokenizer, tokenizer = guidance_tokenizer
    tools = [Tool(function=FunctionDefinition(name="get_weather", parameters={
                 "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
             Tool(function=FunctionDefinition(name="get_time"))]
    grammar = output_grammar(None, tools, "required", True, SYNTAXES[syntax]).grammar
    for other, text in OUTPUTS.items():
        matcher = LLMatcher(tokenizer, grammar)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        accepted = matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
        assert accepted == (other == syntax), (syntax, text)


def test_the_syntax_follows_the_chat_template():
    assert tool_call_syntax(None) is HERMES
    assert tool_call_syntax("{{ messages }}") is HERMES  # renders no tools: tool_prompt's Hermes prompt
    qwen = "{% if tools %}<tools>{{ tools }}</tools> ... <tool_call> {% endif %}{{ message.tool_calls }}"
    mistral = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}{{ message.tool_calls }}[TOOL_CALLS]"
    llama = ('{% if tools %}{"name": function name, "parameters": dictionary}{% endif %}{{ message.tool_calls }}'
             "<|eot_id|>")
    assert (tool_call_syntax(qwen), tool_call_syntax(mistral), tool_call_syntax(llama)) == (HERMES, MISTRAL, LLAMA3_JSON)


MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}</s>"
    "{%- else %}{{ message.content }}</s>{%- endif %}{%- endfor %}"
)


def test_a_mistral_template_gets_tool_calls_in_mistral_syntax_through_the_chat_api(tiny_model_dir, tmp_path, serve):
    """The tiny Llama with a Mistral-style template: the tools grammar makes it write [TOOL_CALLS][...], and the
    answer is OpenAI tool_calls, whole and streamed."""
    import shutil

    import openai

    from engines.builtin.config import EngineConfig
    from engines.builtin.core import EngineCore
    from engines.builtin.server.app import create_app

    model_dir = tmp_path / "tiny-mistral-template"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    core = EngineCore(EngineConfig(model=str(model_dir), num_blocks=64))
    core.start()
    try:
        client = openai.OpenAI(base_url=serve(create_app(llm=core, model_name="tiny")) + "/v1", api_key="unused",
                               max_retries=0)
        request = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40,
                       temperature=0, tools=[{"type": "function", "function": {"name": "get_time"}}],
                       tool_choice="required")
        reply = client.chat.completions.create(**request)
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments, reply.choices[0].message.content) == ("get_time", "{}", None)
        streamed = [chunk.choices[0].delta for chunk in client.chat.completions.create(**request, stream=True)
                    if chunk.choices]
        assert [d.tool_calls[0].function.name for d in streamed if d.tool_calls and d.tool_calls[0].function.name] \
            == ["get_time"]
        assert not any(d.content for d in streamed)
    finally:
        core.shutdown()
