"""POST /v1/embeddings through the openai SDK and LangChain's OpenAIEmbeddings, against a real gateway on loopback
in front of the fake upstream, one of whose models is configured as an embedding model."""

from __future__ import annotations

import openai
import pytest

from gateway.config import LimitsConfig, QuotasConfig, UpstreamConfig
from gateway.server.app import create_app
from tests.support.fake_upstream import MODEL, embedding
from tests.support.gateways import gateway_config
from tests.support import plain_http

EMBED = "fake-embed"


def _upstreams(fake_url: str) -> list[UpstreamConfig]:
    return [UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1"),
            UpstreamConfig(model=EMBED, base_url=f"{fake_url}/v1", upstream_model="fake-embedder", embeddings=True)]


@pytest.fixture(scope="module")
def url(serve_module, fake_url) -> str:
    return serve_module(create_app(gateway_config(_upstreams(fake_url))))


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-a", max_retries=0, timeout=10) as client:
        yield client


def test_the_sdk_embeds_strings(client, fake_stats):
    result = client.embeddings.create(model=EMBED, input=["hello there", "general kenobi"], encoding_format="float")

    assert [d.index for d in result.data] == [0, 1]
    assert result.data[0].embedding == pytest.approx(embedding("hello there"))
    assert result.data[1].embedding == pytest.approx(embedding("general kenobi"))
    assert result.usage.prompt_tokens == 4 and result.usage.total_tokens == 4
    sent = fake_stats()["last_body"]
    assert sent["model"] == "fake-embedder" and sent["input"] == ["hello there", "general kenobi"]


def test_the_sdks_default_base64_encoding_passes_through(client):
    """The SDK asks for base64 by default and decodes it: the gateway forwards both untouched."""
    result = client.embeddings.create(model=EMBED, input="one string", dimensions=4)
    assert result.data[0].embedding == pytest.approx(embedding("one string", 4), abs=1e-6)


def test_token_ids_and_unknown_fields_pass_through(url, http, fake_stats):
    answer = http.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": [[1, 2, 3]], "truncate_prompt_tokens": 8})
    assert answer.status_code == 200 and answer.headers["x-parrot-engine"]
    assert answer.json()["usage"]["prompt_tokens"] == 3
    assert fake_stats()["last_body"]["truncate_prompt_tokens"] == 8


def test_langchain_openai_embeddings(url):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain would otherwise tokenize with tiktoken (a download) first.
    embedder = OpenAIEmbeddings(model=EMBED, base_url=f"{url}/v1", api_key="sk-a", check_embedding_ctx_length=False,
                                max_retries=0)
    vectors = embedder.embed_documents(["alpha beta", "gamma"])
    assert vectors[0] == pytest.approx(embedding("alpha beta"), abs=1e-6)
    assert embedder.embed_query("gamma") == pytest.approx(vectors[1])


def test_a_chat_model_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="hello")
    assert caught.value.body["param"] == "model" and caught.value.body["code"] == "model_not_embedding"
    assert MODEL in caught.value.body["message"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="no-such-model", input="hello")
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body, param", [({"model": EMBED, "input": ""}, "input"),
                                         ({"model": EMBED, "input": ["a", ""]}, "input"),
                                         ({"model": EMBED}, "input"),
                                         ({"model": EMBED, "input": "a", "dimensions": 0}, "dimensions")])
def test_malformed_bodies_name_their_field(url, http, body, param):
    answer = http.post(f"{url}/v1/embeddings", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_upstream_errors_are_passed_on(url, http):
    answer = http.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": "x", "fake": {"status": 422}})
    assert answer.status_code == 422


def test_quotas_limits_and_auth_apply(start_gateway, fake_url):
    gateway = start_gateway(_upstreams(fake_url), quotas=QuotasConfig(requests_per_minute=1),
                            limits=LimitsConfig(max_body_bytes=2000))
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-q", max_retries=0, timeout=10) as client:
        client.embeddings.create(model=EMBED, input="one")
        with pytest.raises(openai.RateLimitError):
            client.embeddings.create(model=EMBED, input="two")
    assert plain_http.post(f"{gateway}/v1/embeddings", json={"model": EMBED, "input": "x" * 5000}).status_code == 413


def test_auth_is_required_when_keys_are_configured(start_gateway, fake_url):
    from gateway.config import AuthConfig

    gateway = start_gateway(_upstreams(fake_url), auth=AuthConfig(api_keys=["sk-right"]))
    assert plain_http.post(f"{gateway}/v1/embeddings", json={"model": EMBED, "input": "x"}).status_code == 401
    answer = plain_http.post(f"{gateway}/v1/embeddings", json={"model": EMBED, "input": "x"},
                        headers={"authorization": "Bearer sk-right"})
    assert answer.status_code == 200


def test_metrics_count_embeddings(client, url, http):
    client.embeddings.create(model=EMBED, input="count me")
    text = http.get(f"{url}/metrics").text
    success = [line for line in text.splitlines() if line.startswith("parrot:request_success_total") and EMBED in line]
    prompt = [line for line in text.splitlines() if line.startswith("parrot:prompt_tokens_total") and EMBED in line]
    assert success and float(success[0].split()[-1]) >= 1
    assert prompt and float(prompt[0].split()[-1]) >= 2
