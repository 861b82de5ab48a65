"""Guard: no open proxy, relay access keys, credentials never leave the request.

Unit tests of the pure helpers and hooks, then end-to-end runs of a real mitmdump
(and mitmweb) on loopback: listeners on 0.0.0.0 are bound only by relays that
must refuse to start or stop right away, and no traffic goes to them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest
from mitmproxy import exceptions
from mitmproxy.addons import proxyauth
from mitmproxy.proxy import mode_specs
from mitmproxy.test import taddons, tflow

from addons import guard, scope, state
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from tests.fakes import client
from tests.harness import MitmdumpProcess

RELAY_KEY = "relay-key-0123456789-alice"
OTHER_RELAY_KEY = "relay-key-0123456789-bob"
UPSTREAM_KEY = "sk-upstream-FAKEKEY-9876543210"
FAKE_GEMINI_KEY = "AIza-test-FAKEKEY-0123456789"
FAKE_AZURE_KEY = "azure-test-FAKEKEY-0123456789"
FAKE_COOKIE = "session=cookie-FAKEKEY-0123456789"
FAKE_PROXY_PASSWORD = "proxy-pass-FAKEKEY-0123"
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


# --- exposure (pure) ----------------------------------------------------------------


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("", False), ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("relay.example", False),
])
def test_is_loopback(host, loopback):
    assert guard.is_loopback(host) is loopback


def test_loopback_listeners_need_no_protection():
    modes = ["regular@8080", "reverse:https://api.openai.com@8001", "regular@[::1]:8081"]
    assert guard.unprotected_listeners(modes, "127.0.0.1", None, False) == []
    # A mode's own host wins over listen_host, in both directions.
    assert guard.unprotected_listeners(["regular@127.0.0.1:8080"], "", None, False) == []
    assert guard.unprotected_listeners(["regular@0.0.0.0:8080"], "127.0.0.1", None, False) == [
        "regular@0.0.0.0:8080 on 0.0.0.0 (set proxyauth)"]


def test_each_exposed_listener_names_its_protection():
    modes = ["regular@8080", "reverse:https://api.openai.com@8001", "transparent@8082", "local"]
    assert guard.unprotected_listeners(modes, "", None, False) == [
        "regular@8080 on all interfaces (set proxyauth)",
        "reverse:https://api.openai.com@8001 on all interfaces (set relay_access_keys)",
        "transparent@8082 on all interfaces (the relay cannot protect this kind of listener)",
    ]  # local mode has no network listener
    assert guard.unprotected_listeners(modes[:2], "", "u:p", True) == []
    # proxyauth does not stand in for access keys (it breaks Bearer keys), nor the reverse.
    assert len(guard.unprotected_listeners(modes[:2], "", "u:p", False)) == 1
    assert len(guard.unprotected_listeners(modes[:2], "", None, True)) == 1
    # "any" accepts every password: no protection.
    assert len(guard.unprotected_listeners(["socks5@1080"], "0.0.0.0", "any", False)) == 1


def test_web_ui_needs_a_password_off_loopback():
    assert guard.web_ui_problem("127.0.0.1", "") is None
    assert guard.web_ui_problem("0.0.0.0", "$argon2id$v=19$...") is None
    assert "web_password" in guard.web_ui_problem("0.0.0.0", "")
    assert "all interfaces" in guard.web_ui_problem("", "")


# --- exposure (addon) ---------------------------------------------------------------


def _guarded(tctx: taddons.context) -> guard.Guard:
    g = guard.Guard()
    tctx.master.addons.add(proxyauth.ProxyAuth(), g)  # the relay reads proxyauth's option
    return g


def test_exposure_rejects_an_open_listener_and_takes_the_override(caplog):
    with taddons.context() as tctx:
        _guarded(tctx)
        tctx.options.update(mode=["regular@0"], listen_host="127.0.0.1")
        with pytest.raises(exceptions.OptionsError, match="refusing to start as an open proxy"):
            tctx.options.update(listen_host="0.0.0.0")
        assert tctx.options.listen_host == "127.0.0.1"  # the change was rejected
        tctx.options.update(listen_host="0.0.0.0", proxyauth="user:secret")
        tctx.options.update(proxyauth=None, relay_allow_open_proxy=True)
    assert "serving without authentication (relay_allow_open_proxy): regular@0 on 0.0.0.0" in caplog.text


def test_exposure_warns_that_proxyauth_breaks_reverse_listeners(caplog):
    with taddons.context() as tctx:
        _guarded(tctx)
        tctx.options.update(mode=["reverse:https://api.openai.com@0"], listen_host="127.0.0.1")
        tctx.options.update(proxyauth="user:secret")
    assert "rejects API keys" in caplog.text


# --- access keys (pure) ---------------------------------------------------------------


def test_parse_keys_takes_lines_commas_and_comments():
    text = "# team keys\nkey-one-0123456789abc  # alice\n\nkey-two-0123456789abc, key-three-0123456789ab\n"
    assert guard.parse_keys(text) == ["key-one-0123456789abc", "key-two-0123456789abc", "key-three-0123456789ab"]


def test_key_sources_are_env_or_file_never_literals(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_KEYS_TEST", f"{RELAY_KEY} {OTHER_RELAY_KEY}")
    keys_file = tmp_path / "keys"
    keys_file.write_text("relay-key-from-file-0123\n")
    assert guard.load_access_keys(["env:RELAY_KEYS_TEST", f"file:{keys_file}"]) == [
        RELAY_KEY, OTHER_RELAY_KEY, "relay-key-from-file-0123"]
    assert guard.load_access_keys([]) == []
    monkeypatch.setenv("RELAY_KEYS_SHORT", "short")
    monkeypatch.setenv("RELAY_KEYS_EMPTY", " # none yet")
    for sources, message in [
        (["env:RELAY_KEYS_UNSET_X"], "RELAY_KEYS_UNSET_X is not set"),
        ([f"file:{tmp_path / 'missing'}"], "cannot read"),
        (["env:RELAY_KEYS_SHORT"], "at least 16"),
        (["env:RELAY_KEYS_EMPTY"], "hold no keys"),
        ([RELAY_KEY], "env:NAME or file:PATH"),
    ]:
        with pytest.raises(exceptions.OptionsError, match=message) as e:
            guard.load_access_keys(sources)
        assert RELAY_KEY not in str(e.value)  # a pasted key is never echoed


def test_upstream_keys_are_required_for_each_reverse_host(monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY_TEST", f" {UPSTREAM_KEY}\n")
    hosts = guard.reverse_upstream_hosts(
        ["regular@8080", "reverse:https://API.openai.com@8001", "reverse:tcp://db.internal:5432@9000"])
    assert hosts == {"api.openai.com"}  # raw TCP reverse listeners carry no API keys
    assert guard.load_upstream_keys(hosts, ["api.openai.com=env:UPSTREAM_KEY_TEST"]) == {"api.openai.com": UPSTREAM_KEY}
    with pytest.raises(exceptions.OptionsError, match="no key for api.openai.com"):
        guard.load_upstream_keys(hosts, ["api.anthropic.com=env:UPSTREAM_KEY_TEST"])
    with pytest.raises(exceptions.OptionsError, match="HOST=env:NAME"):
        guard.load_upstream_keys(hosts, [UPSTREAM_KEY])


def _request(headers: dict[str, str] | None = None, path: str = "/v1/chat/completions"):
    req = tflow.treq(path=path)
    req.headers.clear()
    req.headers.update(headers or {})
    return req


def test_presented_credentials_in_every_slot():
    req = _request({"Authorization": f"Bearer {RELAY_KEY}", "x-api-key": "a", "api-key": "b",
                    "x-goog-api-key": "c"}, path="/v1beta/models/g:generateContent?alt=sse&key=d")
    assert guard.presented_credentials(req) == {
        "authorization": RELAY_KEY, "x-api-key": "a", "api-key": "b", "x-goog-api-key": "c", "?key": "d"}
    # Other auth schemes count whole, so they never match a relay key.
    assert guard.presented_credentials(_request({"authorization": "Basic dXNlcjpwYXNz"})) == {
        "authorization": "Basic dXNlcjpwYXNz"}
    assert guard.presented_credentials(_request()) == {}


def test_rejection_needs_every_credential_to_be_a_relay_key():
    digests = [guard.key_digest(RELAY_KEY), guard.key_digest(OTHER_RELAY_KEY)]
    assert guard.rejection({"authorization": OTHER_RELAY_KEY}, digests) is None
    assert guard.rejection({"authorization": RELAY_KEY, "x-api-key": RELAY_KEY}, digests) is None
    assert "missing" in guard.rejection({}, digests)
    assert "not accepted" in guard.rejection({"x-api-key": RELAY_KEY[:-1]}, digests)
    assert "not accepted" in guard.rejection({"authorization": RELAY_KEY, "x-api-key": FAKE_OPENAI_KEY}, digests)
    assert "not accepted" in guard.rejection({"x-api-key": "ключ\udcff"}, digests)  # any characters


def test_swap_puts_the_upstream_key_where_the_relay_key_was():
    req = _request({"authorization": f"Bearer {RELAY_KEY}", "x-api-key": RELAY_KEY, "anthropic-version": "1"},
                   path="/v1beta/models/g:streamGenerateContent?alt=sse&key=" + RELAY_KEY)
    guard.swap_credentials(req, guard.presented_credentials(req), UPSTREAM_KEY)
    assert req.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert req.headers["x-api-key"] == UPSTREAM_KEY
    assert req.query["key"] == UPSTREAM_KEY and req.query["alt"] == "sse"
    assert req.headers["anthropic-version"] == "1"


@pytest.mark.parametrize(("headers", "path", "family"), [
    ({}, "/v1/chat/completions", guard.OPENAI),
    ({}, "/v1/responses", guard.OPENAI),
    ({}, "/v1/messages", guard.ANTHROPIC),
    ({"anthropic-version": "2023-06-01"}, "/v1/models", guard.ANTHROPIC),
    ({}, "/v1beta/models/gemini-2.0-flash:generateContent", guard.GEMINI),
    ({"x-goog-api-key": "k"}, "/v1beta/models", guard.GEMINI),
    ({}, "/anything", guard.OPENAI),
])
def test_api_family(headers, path, family):
    assert guard.api_family(_request(headers, path)) == family


def test_error_responses_in_each_api_format():
    openai_body = json.loads(guard.error_response(guard.OPENAI, 401, "m").content)
    assert openai_body == {"error": {"message": "m", "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}
    anthropic_resp = guard.error_response(guard.ANTHROPIC, 401, "m")
    assert json.loads(anthropic_resp.content) == {"type": "error", "error": {"type": "authentication_error", "message": "m"}}
    assert anthropic_resp.headers["content-type"] == "application/json"
    assert anthropic_resp.headers["www-authenticate"].startswith("Bearer")
    gemini_body = json.loads(guard.error_response(guard.GEMINI, 401, "m").content)
    assert gemini_body == {"error": {"code": 401, "message": "m", "status": "UNAUTHENTICATED"}}
    assert json.loads(guard.error_response(guard.OPENAI, 502, "m").content)["error"]["type"] == "server_error"


# --- access keys (addon) ---------------------------------------------------------------


def _reverse_flow(headers: dict[str, str], path: str = "/v1/chat/completions"):
    f = tflow.tflow()
    f.client_conn.proxy_mode = mode_specs.ProxyMode.parse("reverse:https://api.openai.com@8001")
    f.request = _request(headers, path)
    return f


def test_access_keys_hooks(monkeypatch):
    monkeypatch.setenv("RELAY_KEYS_TEST", RELAY_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", UPSTREAM_KEY)
    with taddons.context() as tctx:
        g = _guarded(tctx)
        access = g.addons[1]
        tctx.options.update(mode=["reverse:https://api.openai.com@8001"], relay_access_keys=["env:RELAY_KEYS_TEST"])

        ok = _reverse_flow({"authorization": f"Bearer {RELAY_KEY}"})
        access.requestheaders(ok)
        assert ok.response is None and ok.request.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"

        wrong = _reverse_flow({"authorization": "Bearer nope"})
        access.requestheaders(wrong)
        assert wrong.response.status_code == 401
        state.attach(wrong, state.FlowState(api=scope.OPENAI_CHAT))  # as the scope addon would
        access.request(wrong)
        assert state.get(wrong).error_phase == "relay" and "not accepted" in state.get(wrong).error

        proxied = tflow.tflow()  # regular mode: the client's own key goes on untouched
        proxied.request.headers["authorization"] = f"Bearer {FAKE_OPENAI_KEY}"
        access.requestheaders(proxied)
        assert proxied.response is None and proxied.request.headers["authorization"] == f"Bearer {FAKE_OPENAI_KEY}"

        # A connection left on a listener an option change removed: refused, never forwarded.
        stale = _reverse_flow({"authorization": f"Bearer {RELAY_KEY}"})
        stale.client_conn.proxy_mode = mode_specs.ProxyMode.parse("reverse:https://old.example@8009")
        access.requestheaders(stale)
        assert stale.response.status_code == 502

        with pytest.raises(exceptions.OptionsError, match="no key for api.example.org"):
            tctx.options.update(mode=["reverse:https://api.example.org@8001"])


# --- redaction (pure and addon) ----------------------------------------------------------


def test_redact_flow_replaces_every_credential():
    f = tflow.tflow(resp=True)
    f.request = _request({
        "Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-api-key": FAKE_ANTHROPIC_KEY, "api-key": FAKE_AZURE_KEY,
        "x-goog-api-key": FAKE_GEMINI_KEY, "Cookie": FAKE_COOKIE, "Proxy-Authorization": "Basic cHJveHk6cGFzcw==",
        "content-type": "application/json"}, path=f"/v1beta/models/g:generateContent?key={FAKE_GEMINI_KEY}&alt=sse")
    f.request.headers.add("cookie", "second=FAKEKEY")
    f.metadata["proxyauth"] = ("user", FAKE_PROXY_PASSWORD)
    guard.redact_flow(f)
    h = f.request.headers
    assert h["authorization"] == "Bearer REDACTED" and h["proxy-authorization"] == "Basic REDACTED"
    assert h["x-api-key"] == h["api-key"] == h["x-goog-api-key"] == "REDACTED"
    assert h.get_all("cookie") == ["REDACTED", "REDACTED"]
    assert f.request.query["key"] == "REDACTED" and f.request.query["alt"] == "sse"
    assert h["content-type"] == "application/json"
    assert f.metadata["proxyauth"] == ("user", "REDACTED")
    assert "FAKEKEY" not in repr(f.get_state())


def test_redaction_waits_for_the_request_to_leave_and_covers_flows_in_flight():
    with taddons.context() as tctx:
        redaction = _guarded(tctx).addons[2]
        done, in_flight = tflow.tflow(resp=True), tflow.tflow()
        for f in (done, in_flight):
            f.request.headers["authorization"] = f"Bearer {FAKE_OPENAI_KEY}"
            redaction.requestheaders(f)
        assert done.request.headers["authorization"] == f"Bearer {FAKE_OPENAI_KEY}"  # still to be sent
        redaction.response(done)
        assert done.request.headers["authorization"] == "Bearer REDACTED"
        assert in_flight.request.headers["authorization"] == f"Bearer {FAKE_OPENAI_KEY}"
        redaction.done()  # shutdown: the flow saver writes flows still in flight
        assert in_flight.request.headers["authorization"] == "Bearer REDACTED"
