"""Per-key quotas (rates, concurrency, sessions, variables, bytes), idle-session expiry, and the
gateway's memory coming back after a session's variables are freed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.auth import owner_of
from gateway.config import AuthConfig, QuotaLimits, QuotasConfig, SemanticConfig
from gateway.domain_errors import RateLimited
from gateway.quotas import Quotas, count_tokens
from gateway.semantic.graph import Session
from gateway.semantic.sessions import SessionStore
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support.fake_upstream import MODEL

ALICE, BOB = "sk-alice", "sk-bob"
KEYS = AuthConfig(api_keys=[ALICE, BOB])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(http: httpx.Client, url: str, key: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    return http.post(f"{url}/v1/chat/completions", json=body, headers=auth(key))


def assert_rate_limited(response: httpx.Response, kind: str) -> int:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == kind
    retry_after = response.headers["retry-after"]
    assert retry_after.isdigit() and int(retry_after) >= 1
    return int(retry_after)


def assert_quota_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


# ---------------------------------------------------------------- the accounting, on a fake clock


async def test_requests_per_minute_refuse_with_a_retry_after_then_admit_once_it_has_passed():
    clock = FakeClock()
    quotas = Quotas(QuotasConfig(requests_per_minute=2), clock=clock)
    owner = owner_of(ALICE)
    for _ in range(2):
        await (await quotas.admit(owner)).release()
    with pytest.raises(RateLimited) as refused:
        await quotas.admit(owner)
    assert refused.value.retry_after_s == 30 and refused.value.code == "rate_limit_exceeded"
    clock.now += 29
    with pytest.raises(RateLimited):
        await quotas.admit(owner)
    clock.now += 1
    await (await quotas.admit(owner)).release()
    await (await quotas.admit(owner_of(BOB))).release()  # another key's allowance is its own


async def test_tokens_per_minute_charge_reported_usage_else_the_estimate():
    clock = FakeClock()
    quotas = Quotas(QuotasConfig(tokens_per_minute=600), clock=clock)  # 10 tokens a second
    owner = owner_of(ALICE)
    async with quotas.admitted(owner, estimate_tokens=50):
        count_tokens(700)  # what the gateway's usage decoder reports: the estimate is not charged on top
    with pytest.raises(RateLimited) as refused:
        await quotas.admit(owner)
    assert refused.value.error_type == "tokens" and refused.value.retry_after_s == 11
    clock.now += 11  # 100 in debt, then 1 to spend
    async with quotas.admitted(owner, estimate_tokens=600):
        pass  # no usage reported: the estimate is charged
    with pytest.raises(RateLimited):
        await quotas.admit(owner)
    count_tokens(10**6)  # outside an admitted request: charged to nobody


def test_a_key_table_overrides_only_the_fields_it_sets():
    config = QuotasConfig(requests_per_minute=100, sessions=5, keys={ALICE: {"sessions": 50}})
    assert config.for_key(ALICE) == QuotaLimits(requests_per_minute=100, sessions=50)
    assert config.for_key(BOB) == QuotaLimits(requests_per_minute=100, sessions=5)
    assert Quotas(config).limits(owner_of(ALICE)).sessions == 50
    assert not Quotas(QuotasConfig()).enabled  # nothing to count on the hot path by default


async def test_the_state_of_idle_keys_is_forgotten():
    clock = FakeClock()
    quotas = Quotas(QuotasConfig(requests_per_minute=60, concurrent_requests=5), clock=clock)
    for key in ("a", "b"):
        await (await quotas.admit(key)).release()
    held = await quotas.admit("c")
    assert quotas.forget_idle() == 0  # their allowance is not back yet
    clock.now += 2
    assert quotas.forget_idle() == 3  # three buckets full again; "c" still holds a seat
    await held.release()
    assert quotas.forget_idle() == 0  # a seat given back is forgotten at once


def test_sessions_are_idle_only_when_untouched_and_running_no_call():
    clock = FakeClock()
    store = SessionStore(clock=clock)
    used, untouched, busy = (store.create("owner") for _ in range(3))
    busy.calls["call_x"] = object()
    clock.now += 10
    store.get(used.id, "owner")
    clock.now += 5
    assert store.idle(10) == [untouched]
    busy.calls.clear()  # its idle time starts when the sweep saw it busy
    assert store.idle(10) == [untouched]
    clock.now += 10
    assert {s.id for s in store.idle(10)} == {untouched.id, used.id, busy.id}


def test_closing_a_session_lets_go_of_its_variables_at_once():
    """Variables point at their session: were it to keep pointing at them, their values would wait for
    the cyclic garbage collector."""
    session = Session("owner", {})
    variable = session.new_variable("v", "x" * 100)
    assert session.close() == 1
    assert session.variables == {} and session.bytes == 0 and variable.producer is None


# ---------------------------------------------------------------- rates and concurrency, over HTTP


def test_requests_per_minute_over_http(start_gateway, http):
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(requests_per_minute=2))
    assert chat(http, url, ALICE).status_code == 200
    assert http.post(f"{url}/v1/sessions", headers=auth(ALICE)).status_code == 201  # native work counts too
    assert_rate_limited(chat(http, url, ALICE), "requests")
    assert_rate_limited(http.post(f"{url}/v1/vars", json={"value": "v"}, headers=auth(ALICE)), "requests")
    assert chat(http, url, BOB).status_code == 200


def test_concurrent_requests_are_held_until_the_stream_ends(start_gateway, http):
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(keys={ALICE: {"concurrent_requests": 1}}))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "fake": {"words": 200, "chunk_delay_s": 0.05}}
    with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth(ALICE)) as stream:
        assert stream.status_code == 200
        assert_rate_limited(chat(http, url, ALICE), "requests")
        assert chat(http, url, BOB).status_code == 200  # no limit of Bob's
    wait_until(lambda: chat(http, url, ALICE).status_code == 200)  # the client left: the seat is free


def test_tokens_per_minute_over_http(start_gateway, http):
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(tokens_per_minute=100))
    answer = chat(http, url, ALICE, fake={"words": 150})
    assert answer.json()["usage"]["total_tokens"] > 150  # charged what the engine reported
    retry_after = assert_rate_limited(chat(http, url, ALICE), "tokens")
    assert retry_after > 30  # a debt of more than half a minute's allowance
    assert chat(http, url, BOB).status_code == 200


def test_a_stream_without_usage_is_charged_n_times_max_tokens(start_gateway, http):
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(tokens_per_minute=100))
    streamed = chat(http, url, ALICE, stream=True, n=2, max_tokens=60, fake={"words": 1})
    assert streamed.status_code == 200 and "usage" not in streamed.text
    assert_rate_limited(chat(http, url, ALICE), "tokens")


# ---------------------------------------------------------------- sessions, variables, bytes


def test_sessions_per_key(start_gateway, http):
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(sessions=2))
    first, _ = (http.post(f"{url}/v1/sessions", headers=auth(ALICE)).json()["id"] for _ in range(2))
    refused = http.post(f"{url}/v1/sessions", headers=auth(ALICE))
    assert_quota_error(refused, 429, "sessions_quota_exceeded")
    assert refused.json()["error"]["type"] == "insufficient_quota" and refused.headers["x-should-retry"] == "false"
    assert http.post(f"{url}/v1/vars", json={"value": "v"}, headers=auth(ALICE)).status_code == 201  # default session
    assert http.post(f"{url}/v1/sessions", headers=auth(BOB)).status_code == 201
    assert http.delete(f"{url}/v1/sessions/{first}", headers=auth(ALICE)).status_code == 200
    assert http.post(f"{url}/v1/sessions", headers=auth(ALICE)).status_code == 201


def test_variables_per_session(start_gateway, http):
    url = start_gateway(quotas=QuotasConfig(variables_per_session=3))
    session = http.post(f"{url}/v1/sessions").json()["id"]
    for i in range(3):
        assert http.post(f"{url}/v1/vars", json={"session_id": session, "value": f"{i}"}).status_code == 201
    assert_quota_error(http.post(f"{url}/v1/vars", json={"session_id": session}), 429, "variables_quota_exceeded")
    call = {"model": MODEL, "messages": [{"role": "user", "content": "{{x}}"}],
            "parrot": {"session_id": session, "vars": {"x": {"value": "a"}}}}
    assert_quota_error(http.post(f"{url}/v1/chat/completions", json=call), 429, "variables_quota_exceeded")
    assert len(http.get(f"{url}/v1/sessions/{session}/vars").json()["data"]) == 3  # the refused call left nothing


def test_bytes_per_variable(start_gateway, http):
    url = start_gateway(quotas=QuotasConfig(bytes_per_variable=10))
    session = http.post(f"{url}/v1/sessions").json()["id"]
    assert_quota_error(http.post(f"{url}/v1/vars", json={"session_id": session, "value": "x" * 11}), 413,
                       "variable_too_large")
    assert_quota_error(http.post(f"{url}/v1/vars", json={"session_id": session, "value": "é" * 6}), 413,
                       "variable_too_large")  # UTF-8 bytes, not characters
    unset = http.post(f"{url}/v1/vars", json={"session_id": session}).json()["id"]
    assert_quota_error(http.put(f"{url}/v1/vars/{unset}", json={"value": "x" * 11}), 413, "variable_too_large")
    assert http.put(f"{url}/v1/vars/{unset}", json={"value": "x" * 10}).json()["value"] == "x" * 10
    # An engine's output over the quota fails its variable (and so its consumers), not the gateway.
    call = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "fake": {"words": 20},
            "parrot": {"session_id": session, "output": "long"}}
    output = http.post(f"{url}/v1/chat/completions", json=call).json()["parrot"]["output"]["id"]
    failed = http.get(f"{url}/v1/vars/{output}", params={"wait": "true", "timeout": 10}).json()
    assert failed["value"] is None and "above this API key's quota" in failed["error"]


def test_bytes_per_session(start_gateway, http):
    url = start_gateway(quotas=QuotasConfig(bytes_per_session=20))
    session = http.post(f"{url}/v1/sessions").json()["id"]
    made = [http.post(f"{url}/v1/vars", json={"session_id": session, "value": "x" * 10}).json()["id"] for _ in range(2)]
    assert_quota_error(http.post(f"{url}/v1/vars", json={"session_id": session, "value": "y"}), 429,
                       "session_bytes_quota_exceeded")
    assert http.post(f"{url}/v1/vars", json={"session_id": session}).status_code == 201  # no value: no bytes
    # A key's default session makes room by forgetting its oldest finished variables instead.
    defaults = [http.post(f"{url}/v1/vars", json={"value": "z" * 10}).json()["id"] for _ in range(3)]
    assert http.get(f"{url}/v1/vars/{defaults[0]}").status_code == 404
    assert http.get(f"{url}/v1/vars/{defaults[2]}").json()["value"] == "z" * 10
    assert http.get(f"{url}/v1/vars/{made[0]}").json()["value"] == "x" * 10


# ---------------------------------------------------------------- expiry


def test_an_idle_session_expires_and_its_variables_are_gone(start_gateway, http):
    url = start_gateway(auth=KEYS, semantic=SemanticConfig(session_idle_ttl_s=0.3))
    session = http.post(f"{url}/v1/sessions", headers=auth(ALICE)).json()["id"]
    variable = http.post(f"{url}/v1/vars", json={"session_id": session, "value": "v"}, headers=auth(ALICE)).json()
    default_var = http.post(f"{url}/v1/vars", json={"value": "d"}, headers=auth(ALICE)).json()

    def gone(var_id: str) -> bool:
        return http.get(f"{url}/v1/vars/{var_id}", headers=auth(ALICE)).status_code == 404

    # Each read is a use: polled less often than the TTL, so that the session can go idle between reads.
    wait_until(lambda: gone(variable["id"]) and gone(default_var["id"]), interval_s=1.0, timeout_s=20)
    assert http.get(f"{url}/v1/sessions/{session}/vars", headers=auth(ALICE)).status_code == 404
    again = http.post(f"{url}/v1/vars", json={"value": "d"}, headers=auth(ALICE)).json()  # a new default session
    assert again["session_id"] != default_var["session_id"]


# ---------------------------------------------------------------- memory


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_memory_of_deleted_sessions_goes_back_to_the_os(tmp_path: Path, http):
    """A gateway process: create a session, fill it with 24 × 4 MB variables, delete it; four times.
    Its RSS must come back near where it started each time, not grow by round. (An expired session is
    closed by the same code as a deleted one.)"""
    config = tmp_path / "parrot.toml"
    config.write_text("[quotas]\nbytes_per_session = 268435456\n")
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "serve", "--no-builtin", "--port", str(port),
                                "--log-level", "warning"],
                               env={**os.environ, "PARROT_CONFIG": str(config)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(http, url), timeout_s=30)
        start = _rss_mib(gateway.pid)
        value = "x" * (4 * 2**20 - 64)
        after = []
        for _ in range(4):
            session = http.post(f"{url}/v1/sessions").json()["id"]
            for i in range(24):
                made = http.post(f"{url}/v1/vars", json={"session_id": session, "value": f"{value}{i}"})
                assert made.status_code == 201, made.text
            assert _rss_mib(gateway.pid) > start + 80  # the values were held
            assert http.delete(f"{url}/v1/sessions/{session}").json()["freed_variables"] == 24
            after.append(_rss_mib(gateway.pid))
        # Without a fixed mmap threshold glibc kept ~25 MiB more; with the values held by reference
        # cycles, all of them (+384 MiB after four rounds).
        assert max(after) <= start + 12, (start, after)
        assert after[-1] <= after[0] + 8, (start, after)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def _up(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(f"{url}/v1/models").status_code == 200
    except httpx.TransportError:
        return False


def test_calls_waiting_on_inputs_count_against_their_keys_pending_calls(start_gateway, http):
    """A wait=false call outlives its request: waiting on an input nobody produces, it is held until its
    input timeout. A key holds at most its quota of them; another key is not refused for it, and a call
    that ends (its session deleted) frees its place."""
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(keys={ALICE: {"pending_calls": 2}}))

    def queue(key: str, session: str) -> httpx.Response:
        never = http.post(f"{url}/v1/vars", json={"session_id": session}, headers=auth(key)).json()["id"]
        return chat(http, url, key, messages=[{"role": "user", "content": "{{m}}"}],
                    parrot={"session_id": session, "wait": False, "vars": {"m": {"id": never}}})

    alices, bobs = (http.post(f"{url}/v1/sessions", headers=auth(key)).json()["id"] for key in (ALICE, BOB))
    assert [queue(ALICE, alices).status_code for _ in range(2)] == [202, 202]
    assert_quota_error(queue(ALICE, alices), 429, "pending_calls_quota_exceeded")
    assert [queue(BOB, bobs).status_code for _ in range(3)] == [202] * 3
    assert http.delete(f"{url}/v1/sessions/{alices}", headers=auth(ALICE)).status_code == 200

    again = http.post(f"{url}/v1/sessions", headers=auth(ALICE)).json()["id"]
    wait_until(lambda: queue(ALICE, again).status_code == 202)


def test_a_request_that_can_never_fit_a_session_is_a_400_not_a_429(start_gateway, http):
    """More variables than a whole session may hold, in one request: no retry can help (it was a 429)."""
    url = start_gateway(auth=KEYS, quotas=QuotasConfig(variables_per_session=3))
    session = http.post(f"{url}/v1/sessions", headers=auth(ALICE)).json()["id"]
    names = ["a", "b", "c", "d"]

    too_many = chat(http, url, ALICE, messages=[{"role": "user", "content": " ".join("{{%s}}" % n for n in names)}],
                    parrot={"session_id": session, "vars": {n: {"value": n} for n in names}})
    assert_quota_error(too_many, 400, "too_many_variables")
    assert http.get(f"{url}/v1/sessions/{session}/vars", headers=auth(ALICE)).json()["data"] == []

    for name in ("x", "y"):
        http.post(f"{url}/v1/vars", json={"session_id": session, "name": name}, headers=auth(ALICE))
    fits_alone = chat(http, url, ALICE, messages=[{"role": "user", "content": "{{a}}"}],
                      parrot={"session_id": session, "vars": {"a": {"value": "a"}}})
    assert_quota_error(fits_alone, 429, "variables_quota_exceeded")  # it would fit once others are deleted
