"""A call's answer is encoded once, at the edge, with the ``parrot`` object as a member of its own."""

import msgspec

from gateway.semantic.answer import Answer

PARROT = b'{"session_id":"sess_1"}'


def test_an_engines_body_passes_through_with_the_parrot_object_appended():
    body = b'{"id":"x","system_fingerprint":"fp","choices":[{"index":0,"text":"hi"}]}\n'
    encoded = msgspec.json.decode(Answer(body, "e", "hi", None, None).encoded(PARROT))
    assert encoded == {"id": "x", "system_fingerprint": "fp", "choices": [{"index": 0, "text": "hi"}],
                       "parrot": {"session_id": "sess_1"}}


def test_an_upstreams_own_parrot_member_is_replaced_not_doubled():
    body = b'{"id":"x","parrot":{"mine":1},"choices":[]}'
    encoded = Answer(body, "e", "", None, None).encoded(PARROT)
    assert encoded.count(b'"parrot"') == 1
    assert msgspec.json.decode(encoded)["parrot"] == {"session_id": "sess_1"}


def test_an_answer_with_a_usage_of_another_shape_still_gives_its_text():
    from gateway.service import Answer as EngineAnswer

    body = b'{"choices":[{"index":0,"text":"hi","finish_reason":"stop"}],"usage":{"prompt_tokens":null}}'
    answer = Answer.passed_through("completions", EngineAnswer(body, "e"))
    assert (answer.text, answer.finish_reason, answer.usage) == ("hi", "stop", None)
