"""The served OpenAPI document, corrected where litestar cannot see what the gateway really answers.

Litestar documents each typed handler from its signature: its success body, and a 400 with its own
validation-error shape. It cannot know that every error leaves through one boundary as OpenAI's
error object (http_plumbing/http_errors.py), which statuses the services behind a handler raise, that
/metrics is Prometheus text, or anything about the two OpenAI routes, which are plain ASGI handlers
(gateway/server/openai_endpoints.py). ``document`` fixes the generated document in one place, after the
app is built, so handlers stay free of response declarations.
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin  # fenced: tests/test_private_api_fences.py
from litestar.handlers import ASGIRouteHandler
from litestar.openapi.spec import (
    OpenAPI,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIFormat,
    OpenAPIType,
    Operation,
    PathItem,
    Reference,
    RequestBody,
    Schema,
    SecurityScheme,
)

from wire.openai import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingList,
    EmbeddingRequest,
    ErrorResponse,
)
from wire.anthropic import AnthropicError, AnthropicMessage, CountTokensRequest, MessagesRequest, TokenCount
from wire.batches import BatchCreate
from wire.responses import Response, ResponsesRequest
from gateway.config import GatewayConfig
from gateway.server.routes import HealthReport
from gateway.semantic.schema import Accepted, ParrotExtension

JSON = "application/json"
_COMPONENTS = "#/components/schemas/{name}"
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

# What each status means here; every one of them carries the OpenAI error object.
ERROR_MEANINGS = {
    400: "invalid_request_error: a body, parameter or value the API does not accept (`param` names it)",
    401: "authentication_error: no valid credential (`code` invalid_api_key for client keys)",
    403: "permission_error: the credential may not do this",
    404: "not_found_error: no such model, session, variable or engine for this caller",
    409: "conflict_error: the resource is in a state that forbids this (e.g. `session_deleted`, "
         "`variable_already_bound`)",
    413: "invalid_request_error: the request body, or a variable's value, is larger than the limit",
    415: "invalid_request_error: the body is not application/json",
    424: "dependency_failed: a call this request depends on failed (the message names it)",
    429: "rate_limit_error or insufficient_quota: a rate quota of this API key (retry after Retry-After "
         "seconds) or its quota of sessions, variables or bytes (free something first)",
    502: "upstream_error: the engine failed or could not be reached",
    503: "service_unavailable: no healthy engine serves the model right now",
    504: "timeout: the engine, or a variable this request waits on, took too long",
}

# The errors each client route can answer besides 400/413 (derived from its body and parameters) and
# 401 (when API keys are configured), from the code that raises them: gateway/errors.py,
# gateway/semantic/ (graph.py, service.py, routes.py) and the engines' EngineError subclasses.
_ENGINE_FAILURES = (502, 503, 504)
_SEMANTIC_RUN = (404, 409, 424, 429, *_ENGINE_FAILURES)
ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "POST /v1/chat/completions": _SEMANTIC_RUN,
    "POST /v1/completions": _SEMANTIC_RUN,
    "GET /v1/models/{model_id}": (404,),
    "POST /v1/sessions": (429,),
    "GET /v1/sessions/{session_id}/graph": (404,),
    "DELETE /v1/sessions/{session_id}": (404,),
    "GET /v1/sessions/{session_id}/vars": (404,),
    "POST /v1/vars": (404, 429),
    "GET /v1/vars/{var_id}": (404, 504),
    "PUT /v1/vars/{var_id}": (404, 409, 429),
    "POST /v1/semantic_calls": (404, 409, 429),
    "POST /v1/responses": _SEMANTIC_RUN,  # with the parrot extension, a semantic request's failures too
    "GET /v1/responses/{response_id}": (404,),
    "DELETE /v1/responses/{response_id}": (404,),
    "POST /v1/responses/{response_id}/cancel": (400, 404),
    "GET /v1/responses/{response_id}/input_items": (404,),
    "POST /v1/messages": _SEMANTIC_RUN,
    "POST /v1/messages/count_tokens": (404, 429, *_ENGINE_FAILURES),
    "POST /v1/embeddings": (404, 429, *_ENGINE_FAILURES),
    "POST /v1/files": (415,),
    "GET /v1/files/{file_id}": (404,),
    "GET /v1/files/{file_id}/content": (404,),
    "DELETE /v1/files/{file_id}": (404,),
    "POST /v1/batches": (404,),
    "GET /v1/batches/{batch_id}": (404,),
    "POST /v1/batches/{batch_id}/cancel": (400, 404),
}
# Routes that answer Anthropic's error object (its `error.type` by status) rather than OpenAI's.
_ANTHROPIC_ROUTES = "/v1/messages"
# Engines' own routes (registration, heartbeats, deregistration) take engine credentials, not client keys.
_ENGINE_ROUTES = "/v1/engines"
_ENGINE_ROUTE_ERRORS = (401, 403, 404, 409)
# Routes whose 503 is their own report, not an error object.
_HEALTH_REPORTS = ("/health", "/health/ready")
_PROMETHEUS = "/metrics"

EXAMPLE_MODEL = "SmolLM2-135M-Instruct"  # the default model of `parrot serve`
_SSE_DESCRIPTION = ("With `stream: true`: server-sent events, each `data: ` and a chunk as JSON (an OpenAI "
                    "`{object}`), the last `data: [DONE]`.")


# Documents already made, by the app's routes and whether client keys guard them (all they depend on).
_MADE: dict[tuple[tuple[str, ...], bool], OpenAPI] = {}


def document(app: Litestar, config: GatewayConfig) -> Litestar:
    """``app`` with its OpenAPI document corrected, and returns ``app``. Made once per process for each kind of
    app and shared: building it was most of create_app's time, which a test suite pays hundreds of times."""
    kind = (tuple(route.path for route in app.routes), bool(config.auth.api_keys))
    made = _MADE.get(kind)
    if made is None:
        _MADE[kind] = _corrected(app, config)
    else:  # litestar's plugin serves what it holds here; only built when it holds nothing
        app.plugins.get(OpenAPIPlugin)._openapi = made
    return app


def _corrected(app: Litestar, config: GatewayConfig) -> OpenAPI:
    """``app``'s OpenAPI document corrected in place (litestar serves that same object)."""
    spec = app.openapi_schema
    schemas = _add_schemas(app)
    _add_openai_routes(spec, schemas)
    guarded = _client_key_guarded(app) if config.auth.api_keys else set()
    spec.components.security_schemes = {
        "engineCredential": SecurityScheme(type="http", scheme="bearer", description=(
            "engines only: the registration secret to register, then the token registration answered")),
        **({"apiKey": SecurityScheme(type="http", scheme="bearer"),  # a client key, either way (gateway/auth.py)
            "xApiKey": SecurityScheme(type="apiKey", name="x-api-key", security_scheme_in="header")}
           if guarded else {}),
    }
    for path, method, operation in _operations(spec):
        key = f"{method.upper()} {path}"
        if key in guarded:
            operation.security = [{"apiKey": []}, {"xApiKey": []}]
        elif _is_engine_route(path, method):
            operation.security = [{"engineCredential": []}]
        _document_errors(operation, _statuses(path, method, operation, key in guarded),
                         "AnthropicError" if path.startswith(_ANTHROPIC_ROUTES) else "ErrorResponse")
        if path == _PROMETHEUS:
            operation.responses["200"].content = {"text/plain": OpenAPIMediaType(schema=Schema(
                type=OpenAPIType.STRING, description="Prometheus text exposition format 0.0.4"))}
        if path in _HEALTH_REPORTS:
            operation.responses["200"].content = {JSON: _ref("HealthReport")}
            operation.responses["503"] = OpenAPIResponse(description="degraded: the same report",
                                                         content={JSON: _ref("HealthReport")})
    return spec


def _operations(spec: OpenAPI) -> Iterator[tuple[str, str, Operation]]:
    for path, item in (spec.paths or {}).items():
        for method in _METHODS:
            operation = getattr(item, method, None)
            if operation is not None:
                yield path, method, operation


def _statuses(path: str, method: str, operation: Operation, guarded: bool) -> set[int]:
    statuses = set(ROUTE_ERRORS.get(f"{method.upper()} {path}", ()))
    takes_body = operation.request_body is not None
    if takes_body or any(getattr(p, "param_in", "path") != "path" for p in operation.parameters or ()):
        statuses.add(400)  # the body or a query parameter fails validation
    if takes_body:
        statuses.add(413)
    if _is_engine_route(path, method):
        statuses.update(_ENGINE_ROUTE_ERRORS)
        if takes_body:
            statuses.add(415)
    if guarded:
        statuses.add(401)
    return statuses


def _is_engine_route(path: str, method: str) -> bool:
    return path.startswith(_ENGINE_ROUTES) and method != "get"


def _document_errors(operation: Operation, statuses: set[int], error: str) -> None:
    """Litestar's own 4xx entries describe a shape the gateway never sends: replaced by the error object."""
    responses = {code: r for code, r in (operation.responses or {}).items() if code.isdigit() and int(code) < 400}
    responses.update((str(status), _error_response(status, error)) for status in sorted(statuses))
    operation.responses = responses


def _error_response(status: int, error: str) -> OpenAPIResponse:
    content = {JSON: OpenAPIMediaType(schema=Reference(ref=_COMPONENTS.format(name=error)))}
    headers = None
    if status == 429:
        headers = {"Retry-After": OpenAPIHeader(schema=Schema(type=OpenAPIType.INTEGER),
                                                description="rate quotas: seconds until this request would be "
                                                            "admitted")}
    return OpenAPIResponse(description=ERROR_MEANINGS[status], content=content, headers=headers)


def _client_key_guarded(app: Litestar) -> set[str]:
    """'METHOD /path' of every operation the client API-key guard applies to (all but exclude_from_auth)."""
    guarded = set()
    for route in app.routes:
        handlers = [route.route_handler] if hasattr(route, "route_handler") else route.route_handlers
        for handler in handlers:
            if handler.opt.get("exclude_from_auth"):
                continue
            methods = {"POST"} if isinstance(handler, ASGIRouteHandler) else handler.http_methods
            guarded.update(f"{m} {route.path_format}" for m in methods if m != "OPTIONS")
    return guarded


# ---------------------------------------------------------------- the OpenAI routes


def _add_schemas(app: Litestar) -> dict[str, Any]:
    """Components as msgspec decodes and encodes them: the Structs the OpenAI routes take and answer,
    the health report (a raw Response to litestar), and those of the typed handlers, whose litestar
    rendering loses what msgspec enforces (``forbid_unknown_fields`` is ``additionalProperties: false``)."""
    types = [ChatCompletionRequest, CompletionRequest, ChatCompletion, Completion, Accepted, ErrorResponse,
             ParrotExtension, HealthReport, ResponsesRequest, Response, MessagesRequest, CountTokensRequest,
             AnthropicMessage, TokenCount, AnthropicError, EmbeddingRequest, EmbeddingList, BatchCreate,
             *_handler_structs(app)]
    _, components = msgspec.json.schema_components(types, ref_template=_COMPONENTS)
    extension = {"anyOf": [{"$ref": _COMPONENTS.format(name="ParrotExtension")}, {"type": "null"}]}
    for request in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest"):  # decoded as a dict, then as this
        components[request]["properties"]["parrot"] = extension
    app.openapi_schema.components.schemas.update(components)
    return components


def _handler_structs(app: Litestar) -> set[type]:
    """The msgspec Structs the typed handlers decode (``data``) and answer."""
    structs = set()
    for route in app.routes:
        for handler in getattr(route, "route_handlers", ()):
            signature = handler.parsed_fn_signature
            data = signature.parameters.get("data")
            for field in (signature.return_type, data):
                for annotation in (field.annotation, *field.inner_types) if field is not None else ():
                    annotation = getattr(annotation, "annotation", annotation)
                    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
                        structs.add(annotation)
    return structs


def _add_openai_routes(spec: OpenAPI, schemas: dict[str, Any]) -> None:
    routes = {
        "/v1/chat/completions": ("ChatCompletions", "Creates a chat completion (OpenAI API)",
                                 "ChatCompletionRequest", "ChatCompletion", "chat.completion.chunk",
                                 {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
        "/v1/completions": ("Completions", "Creates a text completion (OpenAI API)",
                            "CompletionRequest", "Completion", "text_completion",
                            {"prompt": "The capital of France is"}),
    }
    for path, (operation_id, summary, request, response, chunk, example) in routes.items():
        assert request in schemas and response in schemas
        example = {"model": EXAMPLE_MODEL, **example, "max_tokens": 16}
        operation = Operation(
            operation_id=operation_id, summary=summary,
            description="OpenAI's request and response. With a `parrot` object the request takes part in a "
                        "session's DAG of semantic variables; with `parrot.wait: false` it answers 202 at once.",
            request_body=RequestBody(required=True, content={JSON: OpenAPIMediaType(
                schema=Reference(ref=_COMPONENTS.format(name=request)), example=example)}),
            responses={
                "200": OpenAPIResponse(description="the completion, or its stream", content={
                    JSON: _ref(response),
                    "text/event-stream": OpenAPIMediaType(schema=_sse_event(chunk))}),
                "202": OpenAPIResponse(description="`parrot.wait: false`: the call is queued; its output "
                                                   "variable's id", content={JSON: _ref("Accepted")}),
            },
        )
        spec.paths[path] = PathItem(post=operation)
    _add_translated_routes(spec, schemas)
    _add_batch_routes(spec, schemas)


# The POSTs of the other APIs (typed handlers that decode their own bodies, so that errors name the item at
# fault): their request body and their answer, whole or streamed.
_TRANSLATED_ROUTES = {
    "/v1/responses": ("ResponsesRequest", "Response", "Creates a model response (OpenAI Responses API)",
                      "Responses API events, each named by its `event:` line (`response.created` ... "
                      "`response.completed`)", {"input": "What is the capital of France?", "max_output_tokens": 16}),
    "/v1/messages": ("MessagesRequest", "AnthropicMessage", "Creates a message (Anthropic Messages API)",
                     "Anthropic's events, each named by its `event:` line (`message_start` ... `message_stop`)",
                     {"max_tokens": 16, "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    "/v1/messages/count_tokens": ("CountTokensRequest", "TokenCount",
                                  "Counts a message's input tokens (Anthropic Messages API)", None,
                                  {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    "/v1/embeddings": ("EmbeddingRequest", "EmbeddingList",
                       "Creates embeddings (OpenAI API) on an engine that serves an embedding model: a model served "
                       "only for chat is a 400 (`code` model_not_embedding)", None,
                       {"input": ["The capital of France is Paris."], "encoding_format": "float"}),
}


_SEMANTIC_ROUTES = ("/v1/responses", "/v1/messages")  # take the parrot extension


def _add_translated_routes(spec: OpenAPI, schemas: dict[str, Any]) -> None:
    for path, (request, response, summary, events, example) in _TRANSLATED_ROUTES.items():
        assert request in schemas and response in schemas
        operation = spec.paths[path].post
        operation.summary = summary
        operation.request_body = RequestBody(required=True, content={JSON: OpenAPIMediaType(
            schema=Reference(ref=_COMPONENTS.format(name=request)), example={"model": EXAMPLE_MODEL, **example})})
        content = {JSON: _ref(response)}
        if events is not None:
            content["text/event-stream"] = OpenAPIMediaType(schema=Schema(
                type=OpenAPIType.OBJECT, required=["data"], description=f"With `stream: true`: {events}.",
                properties={"data": Schema(type=OpenAPIType.STRING), "event": Schema(type=OpenAPIType.STRING)}))
        operation.responses = {"200": OpenAPIResponse(description="the answer, or its stream", content=content)}
        if path in _SEMANTIC_ROUTES:
            operation.description = ("With a `parrot` object the request is a semantic request of the chat path "
                                     "(docs/semantic-variables.md); with `parrot.wait: false` it answers 202 at once.")
            operation.responses["202"] = OpenAPIResponse(description="`parrot.wait: false`: the call is queued; its "
                                                         "output variable's id", content={JSON: _ref("Accepted")})


def _add_batch_routes(spec: OpenAPI, schemas: dict[str, Any]) -> None:
    """The bodies the Files and Batch handlers read themselves: a multipart upload, a batch to create."""
    assert "BatchCreate" in schemas
    spec.paths["/v1/batches"].post.request_body = RequestBody(required=True, content={JSON: OpenAPIMediaType(
        schema=Reference(ref=_COMPONENTS.format(name="BatchCreate")),
        example={"input_file_id": "file-abc123", "endpoint": "/v1/chat/completions", "completion_window": "24h"})})
    spec.paths["/v1/files"].post.request_body = RequestBody(required=True, content={
        "multipart/form-data": OpenAPIMediaType(schema=Schema(
            type=OpenAPIType.OBJECT, required=["file", "purpose"],
            properties={"file": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY,
                                       description="JSON lines, one request each (the Batch API's input format)"),
                        "purpose": Schema(type=OpenAPIType.STRING, enum=["batch"])}))})


def _sse_event(chunk: str) -> Schema:
    """One server-sent event: before OpenAPI 3.2 (no ``itemSchema``) a stream's ``schema`` describes each
    event, its fields as the SSE format names them (how schemathesis reads it too)."""
    return Schema(type=OpenAPIType.OBJECT, required=["data"], description=_SSE_DESCRIPTION.format(object=chunk),
                  properties={"data": Schema(type=OpenAPIType.STRING), "event": Schema(type=OpenAPIType.STRING),
                              "id": Schema(type=OpenAPIType.STRING), "retry": Schema(type=OpenAPIType.INTEGER)})


def _ref(name: str) -> OpenAPIMediaType:
    return OpenAPIMediaType(schema=Reference(ref=_COMPONENTS.format(name=name)))
