"""Grammar-constrained decoding on the tiny random Llama: whatever a random model samples at
temperature 1, constrained output parses and validates; unconstrained neighbours are untouched.
Plus the tool-call text format read back incrementally, and the prompt side of tools."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pydantic
import pytest

from engines.builtin.tool_calls import ToolCallReader, read_tool_calls
from engines.builtin.tool_prompt import call_text, tool_messages
from engines.builtin.grammar import closed, output_grammar
from engines.builtin.types import SamplingParams
from wire.openai import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCall,
)
from wire.errors import InvalidRequest

pytestmark = pytest.mark.timeout(120)
PROMPT = list(range(1000, 1023))


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog", "parrot"]
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool
    tags: list[Literal["small", "loud"]] = pydantic.Field(max_length=2)


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=10)
    unit: Literal["C", "F"]


WEATHER = Tool(function=FunctionDefinition(name="get_weather", parameters=Weather.model_json_schema()))
CLOCK = Tool(function=FunctionDefinition(name="get_time", parameters={"type": "object", "properties": {}}))
BARE_CLOCK = Tool(function=FunctionDefinition(name="get_time"))  # no parameters: OpenAI's empty parameter list


def schema_format(schema: dict, strict: bool = True) -> ResponseFormat:
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="out", schema=schema, strict=strict))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from engines.builtin.config import EngineConfig
    from engines.builtin.core import EngineCore

    core = EngineCore(EngineConfig(model=str(tiny_model_dir), num_blocks=128))
    core.start()
    yield core
    core.shutdown()


def detokenize(engine, token_ids: list[int]) -> str:
    return engine.tokenizer.decode([t for t in token_ids if t not in engine.eos_token_ids])


async def sample(engine, params: SamplingParams) -> tuple[str, str]:
    events = [event async for event in engine.generate_from_prompt(PROMPT, params)]
    return detokenize(engine, [e.token_id for e in events]), events[-1].finish_reason


@pytest.mark.parametrize("strict", [True, False])
async def test_schema_output_validates_for_every_seed(engine, strict):
    grammar = output_grammar(schema_format(Pet.model_json_schema(), strict), None, None, None).grammar
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar) for seed in range(6)]
    outputs = await asyncio.gather(*(sample(engine, p) for p in params))
    for text, finish in outputs:
        assert finish == "stop", text  # the grammar ended the sequence, not max_tokens
        Pet.model_validate_json(text)
    assert len({text for text, _ in outputs}) > 1  # really sampled, not one forced string


async def test_json_object_output_is_an_object(engine):
    grammar = output_grammar(ResponseFormat(type="json_object"), None, None, None).grammar
    # A random model nests and pads freely; 2 seeds that close within the budget are enough here.
    for seed in (0, 1, 2, 3):
        text, finish = await sample(engine, SamplingParams(max_tokens=60, temperature=1.0, seed=seed, grammar=grammar))
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


async def test_unconstrained_neighbours_sample_as_if_alone(engine):
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = await sample(engine, free)
    grammar = output_grammar(schema_format(Pet.model_json_schema()), None, None, None).grammar
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=8, grammar=grammar)
    crowded, (text, _) = await asyncio.gather(sample(engine, free), sample(engine, constrained))
    assert crowded == alone
    Pet.model_validate_json(text)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_forced_tool_calls_parse_into_valid_calls(engine, choice):
    output = output_grammar(None, [WEATHER, BARE_CLOCK], choice, None)
    assert output.tool_calls
    for seed in range(4):
        text, finish = await sample(engine, SamplingParams(max_tokens=80, temperature=1.0, seed=seed, grammar=output.grammar))
        assert finish == "stop", text  # one call (parallel_tool_calls unset) and the grammar is done
        content, calls = read_tool_calls(text)
        assert content is None and len(calls) == 1, text
        call = calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(choice, dict) or call.function.name == "get_weather":
            assert call.function.name == "get_weather"
            Weather.model_validate_json(call.function.arguments)
        else:
            assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


async def test_tool_choice_auto_with_a_response_format_answers_in_that_format_or_calls(engine):
    """OpenAI's combination: the model may call a tool; if it answers instead, the answer follows
    response_format. A random model at temperature 1 takes both branches over a few seeds."""
    output = output_grammar(schema_format(Pet.model_json_schema()), [WEATHER], "auto", None)
    assert output.tool_calls
    # Pushed both ways: towards "<" (which opens a call) and towards "{" (which opens an answer).
    call, answer = (engine.tokenizer.encode(text, add_special_tokens=False)[0] for text in ("<", "{"))
    branches = set()
    for seed, bias in enumerate([{call: 20.0}, {answer: 20.0}] * 2):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=output.grammar, logit_bias=bias)
        text, finish = await sample(engine, params)
        assert finish == "stop", text
        content, calls = read_tool_calls(text)
        if calls:
            assert content is None and calls[0].function.name == "get_weather"
            Weather.model_validate_json(calls[0].function.arguments)
            branches.add("call")
        else:
            Pet.model_validate_json(content)
            branches.add("answer")
    assert branches == {"call", "answer"}


async def test_parallel_tool_calls_allow_several(engine):
    output = output_grammar(None, [CLOCK], "required", True)
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=output.grammar, logit_bias={198: 50.0})  # 198: "\n"
    text, _ = await sample(engine, params)
    _, calls = read_tool_calls(text)
    assert len(calls) > 1 and all(c.function.name == "get_time" for c in calls)


def test_invalid_requests_name_their_parameter():
    with pytest.raises(InvalidRequest) as bad_schema:
        output_grammar(schema_format({"type": "strang"}), None, None, None)
    assert bad_schema.value.param == "response_format"
    with pytest.raises(InvalidRequest) as bad_choice:
        output_grammar(None, [WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    assert bad_choice.value.param == "tool_choice"
    with pytest.raises(InvalidRequest) as bad_answer:  # tools offered too: still the format that is wrong
        output_grammar(schema_format({"type": "strang"}), [WEATHER], "auto", None)
    assert bad_answer.value.param == "response_format"
    bad_tool = Tool(function=FunctionDefinition(name="f", parameters={"type": "strang"}))
    with pytest.raises(InvalidRequest) as bad_parameters:
        output_grammar(None, [WEATHER, bad_tool], "auto", None)
    assert bad_parameters.value.param == "tools[1].function.parameters"
    assert "strang" in str(bad_parameters.value)  # llguidance's reason, not an echo of the grammar


def test_tool_choice_none_keeps_a_call_out_of_the_text(engine):
    none = output_grammar(None, [WEATHER], "none", None)
    assert not none.tool_calls

    def accepts(text: str) -> bool:
        matcher = engine.grammars.matcher(none.grammar)
        for token in engine.tokenizer.encode(text, add_special_tokens=False):
            if matcher.finished:
                return False
            matcher.advance(token)
        return not matcher.matcher.is_error()

    assert accepts("Sunny in Paris.") and accepts("<b>Sunny</b>") and accepts("<tool")
    assert not accepts('<tool_call>{"name": "get_weather"') and not accepts(" <tool_call>")


def test_plain_text_and_no_tools_leave_output_free():
    assert output_grammar(None, None, "none", None).grammar is None
    assert output_grammar(ResponseFormat(type="text"), None, None, None).grammar is None
    # Tools win over response_format unless tool_choice is "none".
    json_only = output_grammar(ResponseFormat(type="json_object"), [WEATHER], "none", None)
    assert json_only.grammar is not None and not json_only.tool_calls


def test_closed_schema_forbids_unlisted_properties_only_where_unsaid():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}, "c": {"type": "object"}},
        "$defs": {"D": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["c"]  # a free-form object stays free
    assert out["$defs"]["D"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is not modified


# ---------------------------------------------------------------- reading calls back


CALLS_TEXT = (
    call_text("get_weather", '{"city": "Pa}ris", "unit": "C"}')
    + "\n"
    + call_text("lookup", '{"q": "a \\"}</tool_call>\\" b", "nested": {"x": [1, {"y": 2}]}}')
)


@pytest.mark.parametrize("chunk", [1, 3, 7, len(CALLS_TEXT)])
def test_reader_streams_the_same_calls_whatever_the_chunking(chunk):
    reader = ToolCallReader()
    deltas = []
    for start in range(0, len(CALLS_TEXT), chunk):
        content, new = reader.feed(CALLS_TEXT[start : start + chunk])
        assert content == ""
        deltas += new
    assert reader.finish() == ""
    # As OpenAI streams them: a header delta (id, type, name, empty arguments), then fragments.
    headers = [d for d in deltas if d.id is not None]
    assert [(h.index, h.type, h.function) for h in headers] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "lookup", "arguments": ""}),
    ]
    assembled = ["", ""]
    for d in deltas:
        if d.id is None:
            assert set(d.function) == {"arguments"}
            assembled[d.index] += d.function["arguments"]
    assert [json.loads(a) for a in assembled] == [
        {"city": "Pa}ris", "unit": "C"},
        {"q": 'a "}</tool_call>" b', "nested": {"x": [1, {"y": 2}]}},
    ]
    assert [c.function.arguments for c in reader.calls] == assembled
    assert [c.function.name for c in read_tool_calls(CALLS_TEXT)[1]] == ["get_weather", "lookup"]


def test_reader_passes_plain_text_through():
    reader = ToolCallReader()
    assert reader.feed("Hello") == ("Hello", [])
    assert reader.feed(" <b>world</b>") == (" <b>world</b>", [])
    markup = ToolCallReader()
    assert markup.feed("<to") == ("", [])  # could still become a call
    assert markup.feed("p>hi") == ("<top>hi", [])
    assert read_tool_calls("Just text.") == ("Just text.", [])


@pytest.mark.parametrize("cut_off", ["<tool", "<tool_call>", '<tool_call>\n{"name": "get_wea'])
def test_call_markup_cut_off_by_max_tokens_is_no_content(cut_off):
    reader = ToolCallReader()

    assert reader.feed(cut_off) == ("", []) and reader.finish() == ""
    assert read_tool_calls(cut_off) == ("", [])


def test_tools_reach_a_template_that_does_not_render_them(tokenizer_with_plain_template):
    template = tokenizer_with_plain_template
    history = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", tool_calls=[ToolCall(id="call_1", function=FunctionCall("get_weather", '{"city": "Paris"}'))]),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ]
    messages = tool_messages(history, [WEATHER], template)
    assert messages[0].role == "system" and '"name": "get_weather"' in messages[0].text()
    assert messages[2].text() == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    with_system = tool_messages([ChatMessage(role="system", content="Be brief."), *history], [WEATHER], template)
    assert with_system[0].text().startswith("Be brief.\n\nYou can call these tools")
    assert tool_messages(history, None, template)[0].role == "user"  # tool_choice "none": no tool prompt
    native = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"
    assert tool_messages(history, [WEATHER], native) == history


@pytest.fixture(scope="module")
def tokenizer_with_plain_template(smollm2_tokenizer_dir) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).chat_template
