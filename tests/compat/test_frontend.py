"""compat.frontend: semantic functions and native functions against a real gateway over the fake upstream.

The fake upstream answers a completion with "echo: " + its prompt, so an output shows exactly the text
the gateway generated it from.
"""

from __future__ import annotations

import threading

import pytest

from compat.frontend import Input, Output, native, semantic_function
from compat.openai import Session, VariableError
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve


@semantic_function(model=MODEL, temperature=0)
def summarize(text: Input, summary: Output(max_tokens=16)):
    """Text: {{text}}
    Summary: {{summary}}"""


@semantic_function(temperature=0)
def critique(summary, verdict: Output, reason: Output(stop=["\n"])):
    """Summary: {{summary}}
    Verdict: {{verdict}}
    Reason: {{reason}}"""


@native
def shout(text: str, suffix: str = "!") -> str:
    return text.upper() + suffix


def test_template_and_outputs_come_from_the_signature():
    assert summarize.template == "Text: {{input:text}}\nSummary: {{output:summary}}"
    assert summarize.outputs == {"summary": {"temperature": 0, "max_tokens": 16}}
    assert list(critique.outputs) == ["verdict", "reason"]
    assert critique.outputs["reason"] == {"temperature": 0, "stop": ["\n"]}
    assert list(summarize.signature.parameters) == ["text"]


def test_markup_without_annotations():
    @semantic_function(model=MODEL)
    def answer(question):
        """Q: {{input:question}} A: {{output:reply}}"""

    assert answer.template == "Q: {{input:question}} A: {{output:reply}}"
    assert answer.outputs == {"reply": {}}


def test_a_placeholder_that_is_no_parameter_fails_at_decoration():
    def greet(name, reply: Output):
        """Hello {{stranger}}: {{reply}}"""

    with pytest.raises(ValueError, match="not a parameter"):
        semantic_function(greet)


def test_a_template_without_outputs_fails_at_decoration():
    def echo(text):
        """Just {{text}}"""

    with pytest.raises(ValueError, match="at least one output"):
        semantic_function(echo)


def test_an_app_is_submitted_whole_before_anything_runs(client):
    with Session(client, model=MODEL) as session:
        document = session.variable("document")
        summary = summarize(document)
        verdict, reason = critique(summary=summary)
        loud = shout(reason, suffix="?")
        # Every handle exists; nothing has a value because the document is not set yet.
        assert not any(v["ready"] for v in session.variables())

        document.set("tea is good")

        expected_summary = "echo: Text: tea is good\nSummary: "
        assert summary.get(timeout=10) == expected_summary
        critique_prompt = f"Summary: {expected_summary}\nVerdict: "
        assert verdict.get(timeout=10) == "echo: " + critique_prompt
        expected_reason = "echo: " + critique_prompt + "echo: " + critique_prompt + "\nReason: "
        assert reason.get(timeout=10) == expected_reason
        assert loud.get(timeout=10) == expected_reason.upper() + "?"


def test_literal_inputs_and_map(client):
    with Session(client, model=MODEL):
        summary = summarize("plain text")
        length = summary.map(len)

        assert length.get(timeout=10) == str(len("echo: Text: plain text\nSummary: "))


def test_a_native_failure_reaches_the_reader(client):
    @native
    def broken(text: str) -> str:
        raise ValueError(f"cannot handle {text}")

    with Session(client, model=MODEL) as session:
        result = broken(session.variable(value="this"))

        with pytest.raises(ValueError, match="cannot handle this"):
            result.get(timeout=10)


def test_a_failed_semantic_input_fails_the_native_reader(client):
    with Session(client) as session:
        failing = session.submit(client.chat.completions, model=MODEL, messages=[{"role": "user", "content": "x"}],
                                 extra_body={"fake": {"status": 400}})

        with pytest.raises(VariableError):
            shout(failing).get(timeout=10)


def test_calls_need_a_session_and_a_model(client):
    with pytest.raises(RuntimeError, match="no session"):
        summarize("x")
    with Session(client) as session:  # no default model
        with pytest.raises(ValueError, match="no model"):
            critique("x", session=session)


def test_a_variable_argument_carries_its_session(client):
    session = Session(client).open()
    try:
        text = session.variable("text", value="from a variable")

        summary = summarize(text)  # no session given and none entered

        assert summary.session_id == session.id
        assert summary.get(timeout=10) == "echo: Text: from a variable\nSummary: "
    finally:
        session.close()


def test_a_native_function_failing_after_its_session_closed_ends_quietly(client, monkeypatch):
    crashes = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    release = threading.Event()

    @native
    def late(text: str) -> str:
        release.wait(10)
        raise ValueError("too late")

    with Session(client, model=MODEL) as session:
        result = late("x", session=session)
    release.set()  # the session is gone: the failure can no longer be reported to the gateway

    with pytest.raises(ValueError, match="too late"):
        result.get(timeout=10)
    for thread in threading.enumerate():
        if thread.name == "native-late":
            thread.join(timeout=10)
    assert crashes == []
