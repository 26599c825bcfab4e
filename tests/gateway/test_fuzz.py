"""Property-based fuzzing of the gateway from its own served OpenAPI document (schemathesis).

Every documented operation gets generated requests, valid and invalid, sent to a real gateway on
loopback in front of the fake upstream. Each response must not be a 5xx, must have a documented
status and content type, and its body must match the documented schema: a spec that lies fails here.
"""

from __future__ import annotations

import os

import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.server.app import create_app
from gateway.config import UpstreamConfig
from gateway.server.openapi import EXAMPLE_MODEL
from tests.support.fake_upstream import MODEL
from tests.support.gateways import gateway_config

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Examples per operation: generating them (hypothesis drawing bodies from the document's schemas) is most of this
# module's time, not the requests. `make test` draws 30; `make test-fast` fewer (PARROT_FUZZ_EXAMPLES), as
# hypothesis' own settings profiles do for a quick loop against a thorough CI run.
EXAMPLES = int(os.environ.get("PARROT_FUZZ_EXAMPLES", "30"))
CONFIG = schemathesis.Config.from_dict({
    "generation": {"max-examples": EXAMPLES, "database": "none", "mode": "all"},
    "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
    "request-timeout": 20,
})


# The gateway under test serves this same document: test_the_fuzzed_document_is_the_served_one.
DOCUMENT = create_app(gateway_config([UpstreamConfig(model=MODEL, base_url="http://127.0.0.1:1/v1")])
                      ).openapi_schema.to_schema()
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


@schema.hook
def map_body(context, body):
    """Generated bodies name models nobody serves (a 404 at once): the documented examples' model and
    about half of the others become the served one, so that requests reach the graph and the upstream."""
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and (model == EXAMPLE_MODEL or len(model) % 2 == 0):
        return {**body, "model": MODEL}
    return body


# Headers that frame the HTTP message itself belong to the HTTP server, not to any operation: a generated
# empty `Transfer-Encoding` is refused by uvicorn's parser with a plain-text 400 before the app runs.
FRAMING_HEADERS = frozenset({"transfer-encoding", "content-length", "host", "connection", "expect", "upgrade"})


@schema.hook
def map_headers(context, headers):
    if not headers:
        return headers
    return {name: value for name, value in headers.items() if name.lower() not in FRAMING_HEADERS}


def test_the_fuzzed_document_is_the_served_one(http, gateway_url):
    assert http.get(f"{gateway_url}/docs/openapi.json").json() == DOCUMENT


@schema.parametrize()
def test_every_operation_answers_as_documented(case, gateway_url):
    case.call_and_validate(base_url=gateway_url, checks=CHECKS)



def test_streams_match_their_documented_events(gateway_url):
    """Each server-sent event as the document describes one (generated bodies stream only now and then)."""
    bodies = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}
    for path, body in bodies.items():
        case = schema[path]["POST"].Case(body={**body, "stream": True, "model": MODEL})
        response = case.call_and_validate(base_url=gateway_url, checks=CHECKS)
        assert response.headers["content-type"][0].startswith("text/event-stream")  # a stream was checked
