"""langchain-tests' standard integration suites for ``ChatOpenAI(use_responses_api=True)`` and ``ChatAnthropic``
with their base URL at a real gateway in front of a real builtin engine process on SmolLM2-135M."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from tests.support.models import SMOLLM

# One event loop for the module: langchain-openai keeps its async HTTP client across calls, and on a loop per test
# its pooled connections belonged to a closed loop ("Event loop is closed").
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class ParrotStandardTests(ChatModelIntegrationTests):
    base_url: str
    model_limits: dict[str, str] = {}  # test name -> why SmolLM2-135M fails it (an xfail)

    @pytest.fixture(autouse=True)
    def _model_limits(self, request):
        reason = self.model_limits.get(request.node.name)
        if reason is not None:
            request.node.add_marker(pytest.mark.xfail(reason=reason, strict=False))

    @pytest.fixture(autouse=True)
    def _at_the_gateway(self, smollm_gateway):
        type(self).base_url = smollm_gateway["gateway"]

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # The integration suite sets no max_tokens and no temperature, so each request would be the Responses API's
        # default: sampled at temperature 1 up to the context window (8k tokens). SmolLM2-135M often never says its
        # end-of-turn then, and at a few tokens a second on a busy CPU that ran past the client's timeout (it looked
        # like a hang: the stream was still flowing). Greedy and bounded, as langchain-tests' unit suite sets them.
        # No retries: a retried failure would pass unseen.
        return {**super().standard_chat_model_params, "temperature": 0, "max_tokens": 100, "max_retries": 0,
                "timeout": 120}


# Tests that fail on SmolLM2-135M's answers, not on the API: the model greedily repeats itself ("A cat is a cat, a
# cat is a ...") until max_tokens cuts its JSON, leaves out a required field, or does not call the tool the test
# expects. Not strict: another model, or these weights on another machine's arithmetic, may pass them.
REPEATS_PAST_MAX_TOKENS = "SmolLM2-135M repeats itself inside the JSON until max_tokens (100) cuts it"
RESPONSES_MODEL_LIMITS = {
    "test_structured_output[pydantic]": REPEATS_PAST_MAX_TOKENS,
    "test_structured_output_async[pydantic]": REPEATS_PAST_MAX_TOKENS,
    "test_structured_output_optional_param": REPEATS_PAST_MAX_TOKENS,
    "test_structured_output_pydantic_2_v1": "SmolLM2-135M leaves out the required 'punchline' field",
    "test_json_mode": "SmolLM2-135M leaves out the required 'punchline' field",
    "test_agent_loop[model0]": "SmolLM2-135M does not answer with the tool's result",
    "test_agent_loop[model1]": "SmolLM2-135M does not answer with the tool's result",
    "test_unicode_tool_call_integration": "SmolLM2-135M's tool-call arguments run past max_tokens (100)",
}


MESSAGES_MODEL_LIMITS = {name: RESPONSES_MODEL_LIMITS[name] for name in (
    "test_structured_output_optional_param", "test_agent_loop[model0]", "test_agent_loop[model1]",
    "test_unicode_tool_call_integration")}


class TestResponsesStandard(ParrotStandardTests):
    model_limits = RESPONSES_MODEL_LIMITS

    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": SMOLLM, "base_url": f"{self.base_url}/v1", "api_key": "unused", "use_responses_api": True}

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestMessagesStandard(ParrotStandardTests):
    model_limits = MESSAGES_MODEL_LIMITS

    @property
    def chat_model_class(self) -> type[ChatAnthropic]:
        return ChatAnthropic

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": SMOLLM, "base_url": self.base_url, "api_key": "unused"}

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True
