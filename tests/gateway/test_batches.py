"""/v1/files and /v1/batches through the openai SDK against a real gateway on loopback in front of the fake upstream
(which echoes the last message): a batch of 50 lines with 3 bad ones, per-key isolation, size caps, cancel, and a
batch that resumes its remaining lines after a gateway restart."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from gateway.config import FilesConfig, StateConfig, UpstreamConfig
from gateway.server.app import create_app
from tests.support.fake_upstream import MODEL
from tests.support.gateways import gateway_config
from tests.support.servers import serve_in_thread
from tests.support import plain_http

EMBED = "fake-embed"


def _upstreams(fake_url: str) -> list[UpstreamConfig]:
    return [UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1"),
            UpstreamConfig(model=EMBED, base_url=f"{fake_url}/v1", embeddings=True)]


@pytest.fixture(scope="module")
def url(serve_module, fake_url, tmp_path_factory) -> str:
    files = FilesConfig(max_file_bytes=200_000)
    return serve_module(create_app(gateway_config(_upstreams(fake_url), files=files)))


def _client(url: str, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    with _client(url) as client:
        yield client


def chat_line(i: int, system: str = "You answer briefly.", **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": 10, "messages": [{"role": "system", "content": system},
                                                                      {"role": "user", "content": f"question {i}"}],
                     **body}}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def test_files_upload_list_retrieve_content_delete(client):
    data = jsonl([chat_line(0)])
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(data) and uploaded.filename == "in.jsonl"
    assert uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(uploaded.id).read() == data
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_another_keys_files_and_batches_are_not_found(client, url):
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with _client(url, "sk-b") as other:
        for call in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                     lambda: other.files.delete(uploaded.id), lambda: other.batches.retrieve(batch.id),
                     lambda: other.batches.cancel(batch.id),
                     lambda: other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert uploaded.id not in [f.id for f in other.files.list()]
        assert batch.id not in [b.id for b in other.batches.list()]
    wait_done(client, batch.id)


def test_an_upload_over_the_cap_is_a_413(client):
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 300_000)), purpose="batch")
    assert caught.value.status_code == 413


def test_only_the_batch_purpose(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"


def test_a_batch_of_50_lines_with_3_bad_ones(client):
    lines: list = [chat_line(i, system=f"System prompt {i % 3}") for i in range(47)]
    lines.insert(10, b"{not json")
    lines.insert(20, {**chat_line(100), "url": "/v1/completions"})  # not the batch's endpoint
    lines.insert(30, chat_line(101, model="no-such-model"))  # answered by the gateway: a 404
    lines[30]["body"]["model"] = "no-such-model"
    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 50
    batch = wait_done(client, batch.id)

    assert batch.status == "completed" and batch.metadata == {"job": "nightly"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (50, 47, 3)
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(int(o["custom_id"].split("-")[1]) for o in out) == list(range(47))
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
        assert o["response"]["body"]["choices"][0]["message"]["content"] == f"echo: question {o['custom_id'][4:]}"
    errors = {json.loads(line)["custom_id"]: json.loads(line) for line in
              client.files.content(batch.error_file_id).text.splitlines()}
    assert set(errors) == {None, "req-100", "req-101"}
    assert errors[None]["error"]["code"] == "invalid_json" and errors[None]["response"] is None
    assert errors["req-100"]["error"]["code"] == "invalid_request" and "url" in errors["req-100"]["error"]["message"]
    assert errors["req-101"]["response"]["status_code"] == 404 and errors["req-101"]["error"] is None
    assert errors["req-101"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert batch.id in [b.id for b in client.batches.list()]


def test_completions_and_embeddings_batches(client):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"once upon {i}", "max_tokens": 5}} for i in range(3)]
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    assert batch.request_counts.completed == 3
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": EMBED, "input": f"text {i}"}} for i in range(3)]
    uploaded = client.files.create(file=("e.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                    completion_window="24h").id)
    assert batch.request_counts.completed == 3
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert all(len(o["response"]["body"]["data"][0]["embedding"]) == 8 for o in out)


def test_lines_run_as_throughput_work(start_gateway, fake_url, fake_stats, tmp_path):
    """An upstream with priority scheduling gets a batch line at the throughput priority, not the latency one."""
    upstream = UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1", priority_scheduling="lower_first")
    url = start_gateway([upstream], files=FilesConfig())
    with _client(url) as client:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "live"}])
        live = fake_stats()["last_body"]["priority"]
        uploaded = client.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
        wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
    assert fake_stats()["last_body"]["priority"] > live  # lower_first: a larger number waits


def test_cancel(start_gateway, fake_url, tmp_path):
    url = start_gateway(_upstreams(fake_url), files=FilesConfig(batch_concurrency=1))
    with _client(url) as client:
        lines = [chat_line(i, fake={"delay_s": 0.2}) for i in range(20)]
        uploaded = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        time.sleep(0.5)
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status == "cancelled"
        assert 0 < cancelled.request_counts.completed < 20
        assert len(client.files.content(cancelled.output_file_id).text.splitlines()) == cancelled.request_counts.completed


def test_files_and_a_running_batch_survive_a_restart(fake_url, tmp_path):
    config = gateway_config(_upstreams(fake_url), files=FilesConfig(batch_concurrency=1),
                            state=StateConfig(path=str(tmp_path / "state.sqlite3")))  # what survives a restart
    lines = [chat_line(i, system=f"s{i}", fake={"delay_s": 0.1}) for i in range(12)]
    with serve_in_thread(create_app(config)) as url, _client(url) as client:
        uploaded = client.files.create(file=("a.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        time.sleep(0.45)
        before = client.batches.retrieve(batch.id).request_counts.completed
    assert 0 < before < 12
    with serve_in_thread(create_app(config)) as url, _client(url) as client:
        assert client.files.content(uploaded.id).read() == jsonl(lines)
        done = wait_done(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        out = [json.loads(line)["custom_id"] for line in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(out) == sorted(f"req-{i}" for i in range(12))  # each line answered once


def test_malformed_batch_requests(client, url):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    answer = plain_http.post(f"{url}/v1/batches", json={"input_file_id": "x", "endpoint": "/v1/other",
                                                    "completion_window": "24h"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "endpoint"
