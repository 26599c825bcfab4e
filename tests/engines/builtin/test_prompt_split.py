"""Where a prompt is cut for sharing: only where substituting values into the cut prompt gives what rendering
the substituted messages gives (no model: chat templates rendered by jinja, as transformers renders them)."""

from __future__ import annotations

import jinja2
import pytest

from engines.builtin.prompt_split import PromptSplitRequest, split_prompt
from wire.openai import ChatMessage

VERBATIM = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}<|assistant|>\n"
TRIMMING = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}<|end|>\n{% endfor %}<|assistant|>\n"


def renderer(template: str):
    compiled = jinja2.Environment().from_string(template)
    return lambda messages, tools: compiled.render(messages=[{"role": m.role, "content": m.text()} for m in messages])


def split(template: str, content: str):
    body = {"messages": [{"role": "system", "content": "You are a careful analyst of long reports. " * 3},
                         {"role": "user", "content": content}]}
    return split_prompt(PromptSplitRequest("chat/completions", body), renderer(template))


@pytest.mark.parametrize("content", ["{{x}}", "Summarize:\n\n{{x}}", "{{x}} and {{y}}"])
def test_a_verbatim_template_is_split_and_its_rest_takes_any_value(content):
    values = {"x": "  Cats nap.\n", "y": "\nDogs bark. "}
    cut = split(VERBATIM, content)
    assert cut.prefix
    whole = renderer(VERBATIM)([ChatMessage(role="system", content="You are a careful analyst of long reports. " * 3),
                                ChatMessage(role="user", content=content.replace("{{x}}", values["x"])
                                            .replace("{{y}}", values["y"]))], None)
    assert cut.prefix + cut.rest_with(values) == whole


def test_a_template_that_trims_content_is_not_split():
    """With ``| trim`` a value at a message's edge loses its whitespace when rendered: the split's rest would
    keep it, so the prompt would not be the one a plain request sends."""
    cut = split(TRIMMING, "Summarize:\n\n{{x}}")
    assert cut.prefix == "" and len(cut.rest) == 1


def test_a_prompt_without_variables_is_cut_where_its_last_message_starts():
    body = {"messages": [{"role": "system", "content": "You are a careful analyst of long reports. " * 3},
                         {"role": "user", "content": "Summarize."}]}
    cut = split_prompt(PromptSplitRequest("chat/completions", body), renderer(VERBATIM))
    whole = renderer(VERBATIM)([ChatMessage(**message) for message in body["messages"]], None)
    assert cut.prefix.endswith("<|user|>") and cut.prefix + cut.rest_with({}) == whole
