"""The OpenAI Agents SDK against the gateway: an agent with a function tool, run to completion on a real builtin
engine process on SmolLM2-135M, through the SDK's Responses model (its default) and its chat-completions model.
The first turn asks for a tool call (tool_choice "required", which the engine's grammar satisfies; the SDK resets
it to "auto" once the tool has run), so that the run always goes model -> tool -> model -> final answer."""

from __future__ import annotations

import agents
import openai
import pytest

from tests.support.models import SMOLLM

pytestmark = [pytest.mark.model, pytest.mark.subprocess]  # every test runs on smollm_gateway: `make test-fast` skips importing the SDK


@pytest.fixture
async def async_openai(smollm_gateway):
    async with openai.AsyncOpenAI(base_url=f"{smollm_gateway['gateway']}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:  # one per test: its connections belong to the test's loop
        yield client


async def run_to_completion(agent: agents.Agent, question: str, streamed: bool) -> agents.RunResultBase:
    config = agents.RunConfig(tracing_disabled=True)  # else the SDK uploads its traces to OpenAI
    if not streamed:
        return await agents.Runner.run(agent, question, max_turns=4, run_config=config)
    result = agents.Runner.run_streamed(agent, question, max_turns=4, run_config=config)
    events = [event async for event in result.stream_events()]
    deltas = [e.data.delta for e in events if e.type == "raw_response_event"
              and e.data.type in ("response.output_text.delta", "response.function_call_arguments.delta")]
    assert deltas  # the tool's arguments and the answer arrived as the SSE events' deltas
    return result


@pytest.mark.parametrize("api, streamed", [("responses", False), ("responses", True), ("chat_completions", False)])
async def test_an_agent_runs_its_function_tool_to_completion(async_openai, api, streamed):
    model = (agents.OpenAIResponsesModel(model=SMOLLM, openai_client=async_openai) if api == "responses"
             else agents.OpenAIChatCompletionsModel(model=SMOLLM, openai_client=async_openai))
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    agent = agents.Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                          max_tokens=48))
    result = await run_to_completion(agent, "What is the weather in Paris?", streamed)

    calls = [item for item in result.new_items if isinstance(item, agents.ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, agents.ToolCallOutputItem)]
    assert len(asked) >= 1 and len(calls) == len(outputs) == len(asked)
    assert outputs[0].output == f"It is sunny in {asked[0]}."
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert isinstance(result.new_items[-1], agents.MessageOutputItem)
    # Every model call's usage reached the SDK.
    usage = result.context_wrapper.usage
    assert usage.requests == len(result.raw_responses) >= 2 and usage.input_tokens > 0 and usage.output_tokens > 0
