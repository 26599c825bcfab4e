"""The sampling fields are declared once (wire/sampling.py): every body that carries them has them all,
with the same types and ranges, and they are checked the same way wherever they arrive."""

from __future__ import annotations

import msgspec
import pytest

from engines.builtin.serving.contexts import ContextGenerateRequest
from gateway.semantic.schema import OutputSpec
from wire.openai import ChatCompletionRequest, CompletionRequest
from wire.sampling import SAMPLING_FIELDS, SCHEDULING_FIELDS, Sampling, SamplingWithHints, sampling_of

CARRIERS = [ChatCompletionRequest, CompletionRequest, ContextGenerateRequest, OutputSpec]


@pytest.mark.parametrize("carrier", CARRIERS, ids=lambda c: c.__name__)
def test_every_carrier_has_the_sampling_fields_with_their_declared_types(carrier):
    declared = {f.name: f.type for f in msgspec.structs.fields(Sampling)}
    carried = {f.name: f.type for f in msgspec.structs.fields(carrier)}
    assert {name: carried.get(name) for name in SAMPLING_FIELDS} == declared


@pytest.mark.parametrize("carrier", [ChatCompletionRequest, CompletionRequest, ContextGenerateRequest],
                         ids=lambda c: c.__name__)
def test_engine_bound_bodies_carry_the_scheduling_hints(carrier):
    assert issubclass(carrier, SamplingWithHints) and set(SCHEDULING_FIELDS) <= set(carrier.__struct_fields__)


@pytest.mark.parametrize("carrier", CARRIERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [{"temperature": 3}, {"top_p": -0.1}, {"top_k": -2}, {"presence_penalty": 9},
                                 {"logit_bias": {"5": 101}}])
def test_ranges_are_checked_wherever_the_fields_arrive(carrier, bad):
    base = {k: v for k, v in {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}.items()
            if k in carrier.__struct_fields__}
    msgspec.convert(base | {"temperature": 1}, carrier)  # valid without the bad value
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(base | bad, carrier)


@pytest.mark.parametrize("carrier", [ChatCompletionRequest, CompletionRequest, ContextGenerateRequest],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 10**30])
def test_a_priority_beyond_32_bits_is_refused(carrier, priority):
    base = {k: v for k, v in {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}.items()
            if k in carrier.__struct_fields__}
    assert msgspec.convert(base | {"priority": 2**31 - 1}, carrier).priority == 2**31 - 1
    with pytest.raises(msgspec.ValidationError, match="priority"):
        msgspec.convert(base | {"priority": priority}, carrier)


def test_sampling_of_takes_the_set_fields_and_chats_max_completion_tokens():
    body = {"model": "m", "messages": [], "temperature": 0, "top_p": None, "max_completion_tokens": 7, "n": 2}
    assert sampling_of(body) == {"temperature": 0, "max_tokens": 7}
