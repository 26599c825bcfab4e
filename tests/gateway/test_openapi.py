"""The served OpenAPI document: what the fuzz test cannot see from an open gateway."""

from __future__ import annotations

from gateway.config import AuthConfig
from tests.support.gateways import gateway_config

PUBLIC = ("/health", "/health/ready", "/health/live", "/metrics")


def test_a_keyed_gateway_documents_its_401s_as_they_are_answered(start_gateway, http):
    url = start_gateway(auth=AuthConfig(api_keys=["sk-test"]))
    document = http.get(f"{url}/docs/openapi.json", headers={"authorization": "Bearer sk-test"}).json()
    assert document["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
    client_operations = [(path, method, op) for path, item in document["paths"].items()
                         for method, op in item.items()
                         if path not in PUBLIC and not (path.startswith("/v1/engines") and method != "get")]
    assert {("/v1/chat/completions", "post"), ("/v1/vars/{var_id}", "get")} <= {(p, m) for p, m, _ in client_operations}
    assert document["components"]["securitySchemes"]["xApiKey"] == {"type": "apiKey", "name": "x-api-key",
                                                                     "in": "header"}
    for path, method, operation in client_operations:
        assert operation["security"] == [{"apiKey": []}, {"xApiKey": []}], (method, path)
        error = "AnthropicError" if path.startswith("/v1/messages") else "ErrorResponse"  # each API's own shape
        assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{error}"}, (method, path)
    answer = http.get(f"{url}/v1/models")
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert http.get(f"{url}/v1/models", headers={"x-api-key": "sk-test"}).status_code == 200
    answer = http.post(f"{url}/v1/messages", json={})
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
    assert "401" not in document["paths"]["/metrics"]["get"]["responses"]
    assert http.get(f"{url}/metrics").status_code == 200


def test_an_open_gateway_documents_no_client_keys():
    from gateway.server.app import create_app

    document = create_app(gateway_config([])).openapi_schema.to_schema()
    assert "apiKey" not in document["components"]["securitySchemes"]
    assert "401" not in document["paths"]["/v1/chat/completions"]["post"]["responses"]
