"""The dashboard's surface on a gateway in front of the fake upstream (no model needed): the page and its
benchmark plots, the admin_keys setting, the graph's bounds and failures, and what watching a session does
not do (keep it alive). The live map-reduce and the browser are in test_dashboard.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.server.cli import _serve_parser, config_from_args
from gateway.config import AuthConfig, DashboardConfig, SemanticConfig, load_config
from gateway.request_rate import RequestRate
from tests.support.fake_upstream import MODEL
from tests.support import plain_http

KEY, ADMIN = "sk-user", "sk-admin"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32  # served as it is: the gateway reads no more than the name


def _client(url: str, key: str | None = KEY) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=30)


def test_the_page_needs_no_key_and_runs_only_its_own_scripts(start_gateway):
    url = start_gateway(auth=AuthConfig(api_keys=[KEY]))
    page = plain_http.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["referrer-policy"] == "no-referrer"
    for asset in ("dashboard.js", "dashboard.css", "favicon.svg"):
        assert plain_http.get(f"{url}/dashboard/static/{asset}").status_code == 200
    assert plain_http.get(f"{url}/v1/sessions").status_code == 401  # the data behind it does need one


def _result(json_name: str, png: str | None, ratio: str) -> dict:
    return {"what": f"what {json_name}", "vs": "vLLM", "ratio": ratio, "host": "AMD EPYC, AVX2, 2 CPUs",
            "date": "2026-11-29", "command": "python -m benchmarks.x", "json": json_name, "png": png}


def test_the_current_results_are_listed_and_only_their_plots_served(start_gateway, tmp_path):
    (tmp_path / "multi_engine.png").write_bytes(PNG)
    (tmp_path / "multi_engine.json").write_text("{}")
    (tmp_path / "superseded.png").write_bytes(PNG)  # a plot no current result names: neither listed nor served
    (tmp_path / "current.json").write_text(json.dumps({"results": [
        _result("multi_engine.json", "multi_engine.png", "1.50x"), _result("accuracy.json", None, "0.99x"),
        _result("multi_engine.json", "multi_engine.png", "2.00x"), _result("gone.json", "gone.png", "3.00x")]}))
    url = start_gateway(dashboard=DashboardConfig(benchmarks_dir=str(tmp_path)))
    listed = plain_http.get(f"{url}/dashboard/benchmarks").json()["data"]
    assert [(p["name"], p["url"], [r["ratio"] for r in p["results"]]) for p in listed] == [
        ("multi_engine.png", "/dashboard/benchmarks/multi_engine.png", ["1.50x", "2.00x"]),
        ("accuracy.json", None, ["0.99x"]), ("gone.json", None, ["3.00x"])]
    assert listed[0]["results"][0] == {"what": "what multi_engine.json", "vs": "vLLM", "ratio": "1.50x",
                                       "host": "AMD EPYC, AVX2, 2 CPUs", "date": "2026-11-29"}
    plot = plain_http.get(f"{url}/dashboard/benchmarks/multi_engine.png")
    assert plot.status_code == 200 and plot.content == PNG and plot.headers["content-type"] == "image/png"
    for name in ("multi_engine.json", "superseded.png", "current.json", "..%2Fmulti_engine.png", "gone.png"):
        assert plain_http.get(f"{url}/dashboard/benchmarks/{name}").status_code == 404


def test_the_checkouts_panel_shows_the_reports_list(start_gateway):
    from benchmarks import report

    url = start_gateway()  # the default folder: docs/benchmarks of this checkout
    listed = plain_http.get(f"{url}/dashboard/benchmarks").json()["data"]
    rows = report.entries(report.ROOT)
    files = list(dict.fromkeys(r["json"] for r in rows))  # one entry per result file, in the report's order
    assert [r["ratio"] for plot in listed for r in plot["results"]] == [
        r["ratio"] for name in files for r in rows if r["json"] == name]
    assert {plot["name"] for plot in listed if plot["url"]} == {r["png"] for r in rows if r["png"]}


def test_without_a_benchmarks_folder_or_its_list_the_list_is_empty(start_gateway, tmp_path):
    url = start_gateway(dashboard=DashboardConfig(benchmarks_dir=str(tmp_path / "absent")))
    assert plain_http.get(f"{url}/dashboard/benchmarks").json()["data"] == []
    (tmp_path / "plot.png").write_bytes(PNG)
    (tmp_path / "current.json").write_text("{not json")
    url = start_gateway(dashboard=DashboardConfig(benchmarks_dir=str(tmp_path)))
    assert plain_http.get(f"{url}/dashboard/benchmarks").json()["data"] == []
    assert plain_http.get(f"{url}/dashboard/benchmarks/plot.png").status_code == 404


def test_admin_keys_from_file_environment_and_command_line(tmp_path):
    path = tmp_path / "parrot.toml"
    path.write_text('[auth]\napi_keys = ["a"]\nadmin_keys = ["from-file"]\n')
    assert load_config(env={}).auth.admin_keys == []
    assert load_config(path, env={}).auth.admin_keys == ["from-file"]
    assert load_config(path, env={"PARROT_ADMIN_KEYS": "x, y"}).auth.admin_keys == ["x", "y"]
    args = _serve_parser().parse_args(["--config", str(path), "--admin-key", "cli1", "--admin-key", "cli2"])
    assert config_from_args(args).auth.admin_keys == ["cli1", "cli2"]


def test_an_admin_key_is_a_client_key_and_sees_every_session(start_gateway):
    url = start_gateway(auth=AuthConfig(api_keys=[KEY], admin_keys=[ADMIN]))
    with _client(url) as user, _client(url, ADMIN) as admin, _client(url, "sk-unknown") as stranger:
        session = user.post("/v1/sessions").json()["id"]
        assert stranger.get("/v1/sessions").status_code == 401
        assert admin.post("/v1/sessions").status_code == 201  # its own sessions, as any key
        assert session in [s["id"] for s in admin.get("/v1/sessions").json()["data"]]
        assert [s["id"] for s in user.get("/v1/sessions").json()["data"]] == [session]
        assert admin.get(f"/v1/sessions/{session}/graph").json()["session_id"] == session


def _ask(client: httpx.Client, session: str, text: str, **parrot) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "{{x}}"}],
        "parrot": {"session_id": session, "vars": {"x": {"value": text}}, **parrot}})


def test_a_session_keeps_its_latest_finished_calls_only(start_gateway):
    url = start_gateway(semantic=SemanticConfig(finished_calls_kept=2))
    with _client(url) as client:
        session = client.post("/v1/sessions").json()["id"]
        calls = [_ask(client, session, f"question {i}").json()["parrot"]["call_id"] for i in range(3)]
        graph = client.get(f"/v1/sessions/{session}/graph").json()
    assert [c["id"] for c in graph["calls"]] == calls[1:]
    assert all(c["state"] == "done" and c["engine"] for c in graph["calls"])


def test_a_failed_input_shows_as_a_failed_call_with_its_error(start_gateway):
    url = start_gateway()
    with _client(url) as client:
        session = client.post("/v1/sessions").json()["id"]
        source = client.post("/v1/vars", json={"session_id": session, "name": "source"}).json()["id"]
        accepted = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "{{x}}"}],
            "parrot": {"session_id": session, "wait": False, "vars": {"x": {"id": source}}}}).json()["parrot"]
        assert client.put(f"/v1/vars/{source}", json={"error": "the scraper broke"}).status_code == 200
        deadline = time.monotonic() + 10
        while (call := client.get(f"/v1/sessions/{session}/graph").json()["calls"][0])["state"] == "waiting":
            assert time.monotonic() < deadline, call
            time.sleep(0.02)
        output = next(v for v in client.get(f"/v1/sessions/{session}/graph").json()["variables"]
                      if v["id"] == accepted["output"]["id"])
    assert call["state"] == "failed" and "the scraper broke" in call["error"] and call["started"] is None
    assert output["ready"] is False and output["preview"] is None and "the scraper broke" in output["error"]


def test_watching_a_session_does_not_keep_it_from_going_idle(start_gateway):
    url = start_gateway(semantic=SemanticConfig(session_idle_ttl_s=0.4))
    with _client(url) as client:
        session = client.post("/v1/sessions").json()["id"]
        deadline = time.monotonic() + 20
        while client.get(f"/v1/sessions/{session}/graph").status_code == 200:  # polled as the page polls it
            client.get("/v1/sessions")
            assert time.monotonic() < deadline, "a watched session was never closed as idle"
            time.sleep(0.05)
        assert client.get(f"/v1/sessions/{session}/graph").status_code == 404


def test_the_engines_list_counts_requests_sent(start_gateway):
    url = start_gateway()
    with _client(url) as client:
        before = client.get("/v1/engines").json()[0]
        assert client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        after = client.get("/v1/engines").json()[0]
    assert after["requests_total"] == before["requests_total"] + 1
    assert {"prefix_contexts", "prefix_hit_rate", "requests_per_s"} <= after.keys()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_request_rate_counts_the_last_whole_seconds():
    clock = Clock()
    rate = RequestRate(window_s=4, clock=clock)
    for _ in range(8):
        rate.add()  # second 1000
    assert rate.per_second() == 0  # that second is not whole yet
    clock.now = 1001.5
    rate.add()
    assert rate.per_second() == 8 / 4
    clock.now = 1004.2  # seconds 1000-1003 are the window
    assert rate.per_second() == 9 / 4
    clock.now = 1005.0  # 1000 left it
    assert rate.per_second() == 1 / 4
    clock.now = 1100.0
    assert rate.per_second() == 0 and rate.total == 9


def test_the_graph_endpoints_are_documented(start_gateway):
    url = start_gateway()
    spec = plain_http.get(f"{url}/docs/openapi.json").json()
    graph = spec["paths"]["/v1/sessions/{session_id}/graph"]["get"]
    assert set(graph["responses"]) == {"200", "404"}
    assert graph["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionGraph")
    assert "CallNode" in spec["components"]["schemas"] and "VariableEdge" in spec["components"]["schemas"]
    assert "200" in spec["paths"]["/v1/sessions"]["get"]["responses"]
    assert not any(path.startswith("/dashboard") for path in spec["paths"])
