"""Guard: no open proxy, relay access keys, credentials never leave the request.

Unit tests of the pure helpers and hooks, then end-to-end runs of a real mitmdump
(and mitmweb) on loopback: listeners on 0.0.0.0 are bound only by relays that
must refuse to start or stop right away, and no traffic goes to them.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
from pathlib import Path

import anthropic
import openai
import pytest
from mitmproxy import exceptions, http, io
from mitmproxy.addons import proxyauth
from mitmproxy.proxy import mode_specs
from mitmproxy.test import taddons, tflow

from ttft_relay import apis, state
from ttft_relay.guard import exposure, hygiene, keys, limits, redaction, refusals, tls
from ttft_relay.patches.fixes import upstream_copy
from ttft_relay.workers import free_port
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import MITMWEB, REPO, MitmdumpProcess

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
    assert exposure.is_loopback(host) is loopback


def test_loopback_listeners_need_no_protection():
    modes = ["regular@8080", "reverse:https://api.openai.com@8001", "regular@[::1]:8081"]
    assert exposure.unprotected_listeners(modes, "127.0.0.1", None, False) == []
    # A mode's own host wins over listen_host, in both directions.
    assert exposure.unprotected_listeners(["regular@127.0.0.1:8080"], "", None, False) == []
    assert exposure.unprotected_listeners(["regular@0.0.0.0:8080"], "127.0.0.1", None, False, certs=True) == [
        "regular@0.0.0.0:8080 on 0.0.0.0 (set proxyauth)"]


def test_each_exposed_listener_names_its_protection():
    modes = ["regular@8080", "reverse:https://api.openai.com@8001", "transparent@8082", "local"]
    assert exposure.unprotected_listeners(modes, "", None, False, certs=True) == [
        "regular@8080 on all interfaces (set proxyauth)",
        "reverse:https://api.openai.com@8001 on all interfaces (set relay_access_keys)",
        "transparent@8082 on all interfaces (the relay cannot protect this kind of listener)",
    ]  # local mode has no network listener
    assert exposure.unprotected_listeners(modes[:2], "", "u:p", True, certs=True) == []
    # proxyauth does not stand in for access keys (it breaks Bearer keys), nor the reverse.
    assert len(exposure.unprotected_listeners(modes[:2], "", "u:p", False, certs=True)) == 1
    assert len(exposure.unprotected_listeners(modes[:2], "", None, True, certs=True)) == 1
    # "any" accepts every password: no protection.
    assert len(exposure.unprotected_listeners(["socks5@1080"], "0.0.0.0", "any", False, "optional")) == 1


def test_off_loopback_authentication_needs_tls_too_unless_opted_out():
    modes = ["regular@8080", "reverse:https://api.openai.com@8001", "socks5@1080"]
    assert exposure.unprotected_listeners(modes, "0.0.0.0", "u:p", True) == [
        "regular@8080 on 0.0.0.0 without TLS (set certs)",
        "reverse:https://api.openai.com@8001 on 0.0.0.0 without TLS (set certs)",
        "socks5@1080 on 0.0.0.0 without TLS (this kind cannot have it: set relay_client_tls=optional)",
    ]
    assert exposure.unprotected_listeners(modes[:2], "0.0.0.0", "u:p", True, "all", certs=True) == []
    assert exposure.unprotected_listeners(modes, "0.0.0.0", "u:p", True, "optional") == []
    assert exposure.unprotected_listeners(modes[1:2], "0.0.0.0", None, False) == [
        "reverse:https://api.openai.com@8001 on 0.0.0.0 (set relay_access_keys) without TLS (set certs)"]
    # Loopback needs neither, whatever the policy.
    assert exposure.unprotected_listeners(modes, "127.0.0.1", None, False, "all") == []
    assert exposure.plain_http_listeners(modes, "0.0.0.0", "optional") == modes
    assert exposure.plain_http_listeners(modes, "0.0.0.0", "off-loopback") == []
    assert exposure.plain_http_listeners(["regular@127.0.0.1:8080"], "", "optional") == []


@pytest.mark.parametrize(("policy", "loopback", "required"), [
    ("off-loopback", True, False), ("off-loopback", False, True), ("all", True, True), ("all", False, True),
    ("optional", True, False), ("optional", False, False),
])
def test_which_listeners_accept_only_tls(policy, loopback, required):
    assert exposure.requires_tls(policy, loopback) is required


def test_web_ui_needs_a_password_off_loopback():
    assert exposure.web_ui_problem("127.0.0.1", "") is None
    assert exposure.web_ui_problem("0.0.0.0", "$argon2id$v=19$...") is None
    assert "web_password" in exposure.web_ui_problem("0.0.0.0", "")
    assert "all interfaces" in exposure.web_ui_problem("", "")


# --- exposure (addon) ---------------------------------------------------------------


def _guarded(tctx: taddons.context) -> list[object]:
    """The guard's addons, as relay.py lists them, added to `tctx`."""
    secrets = redaction.SecretRedaction()
    guards = [redaction.LogRedaction(), exposure.Exposure(), limits.ClientLimits(), limits.WebSocketLimits(),
              hygiene.FieldSyntax(), hygiene.OriginForm(), hygiene.RequestFraming(), keys.AccessKeys(), secrets,
              redaction.WebOptions(secrets)]
    tctx.options.update(listen_host="127.0.0.1")  # taddons' default is every interface
    # The relay reads proxyauth's option and relay_client_tls.
    tctx.master.addons.add(proxyauth.ProxyAuth(), tls.ClientTLS(), *guards)
    return guards


def test_exposure_rejects_an_open_listener_and_takes_the_override(caplog):
    with taddons.context() as tctx:
        _guarded(tctx)
        tctx.options.update(mode=["regular@0"], listen_host="127.0.0.1")
        with pytest.raises(exceptions.OptionsError, match="refusing to start as an open proxy"):
            tctx.options.update(listen_host="0.0.0.0")
        assert tctx.options.listen_host == "127.0.0.1"  # the change was rejected
        tctx.options.update(listen_host="0.0.0.0", proxyauth="user:secret", relay_client_tls="optional")
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
    assert keys.parse_keys(text) == ["key-one-0123456789abc", "key-two-0123456789abc", "key-three-0123456789ab"]


def test_key_sources_are_env_or_file_never_literals(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_KEYS_TEST", f"{RELAY_KEY} {OTHER_RELAY_KEY}")
    keys_file = tmp_path / "keys"
    keys_file.write_text("relay-key-from-file-0123\n")
    assert keys.load_access_keys(["env:RELAY_KEYS_TEST", f"file:{keys_file}"]) == [
        RELAY_KEY, OTHER_RELAY_KEY, "relay-key-from-file-0123"]
    assert keys.load_access_keys([]) == []
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
            keys.load_access_keys(sources)
        assert RELAY_KEY not in str(e.value)  # a pasted key is never echoed


def test_upstream_keys_are_required_for_each_reverse_host(monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY_TEST", f" {UPSTREAM_KEY}\n")
    hosts = keys.reverse_upstream_hosts(
        ["regular@8080", "reverse:https://API.openai.com@8001", "reverse:tcp://db.internal:5432@9000"])
    assert hosts == {"api.openai.com"}  # raw TCP reverse listeners carry no API keys
    assert keys.load_upstream_keys(hosts, ["api.openai.com=env:UPSTREAM_KEY_TEST"]) == {"api.openai.com": UPSTREAM_KEY}
    with pytest.raises(exceptions.OptionsError, match="no key for api.openai.com"):
        keys.load_upstream_keys(hosts, ["api.anthropic.com=env:UPSTREAM_KEY_TEST"])
    with pytest.raises(exceptions.OptionsError, match="HOST=env:NAME"):
        keys.load_upstream_keys(hosts, [UPSTREAM_KEY])


def _request(headers: dict[str, str] | None = None, path: str = "/v1/chat/completions"):
    req = tflow.treq(path=path)
    req.headers.clear()
    req.headers.update(headers or {})
    return req


def test_presented_credentials_in_every_slot():
    req = _request({"Authorization": f"Bearer {RELAY_KEY}", "x-api-key": "a", "api-key": "b",
                    "x-goog-api-key": "c"}, path="/v1beta/models/g:generateContent?alt=sse&key=d")
    assert keys.presented_credentials(req) == {
        "authorization": RELAY_KEY, "x-api-key": "a", "api-key": "b", "x-goog-api-key": "c", "?key": "d"}
    # Other auth schemes count whole, so they never match a relay key.
    assert keys.presented_credentials(_request({"authorization": "Basic dXNlcjpwYXNz"})) == {
        "authorization": "Basic dXNlcjpwYXNz"}
    assert keys.presented_credentials(_request()) == {}


def test_rejection_needs_every_credential_to_be_a_relay_key():
    digests = [keys.key_digest(RELAY_KEY), keys.key_digest(OTHER_RELAY_KEY)]
    assert keys.rejection({"authorization": OTHER_RELAY_KEY}, digests) is None
    assert keys.rejection({"authorization": RELAY_KEY, "x-api-key": RELAY_KEY}, digests) is None
    assert "missing" in keys.rejection({}, digests)
    assert "not accepted" in keys.rejection({"x-api-key": RELAY_KEY[:-1]}, digests)
    assert "not accepted" in keys.rejection({"authorization": RELAY_KEY, "x-api-key": FAKE_OPENAI_KEY}, digests)
    assert "not accepted" in keys.rejection({"x-api-key": "ключ\udcff\ud800"}, digests)  # any characters


def test_swap_puts_the_upstream_key_where_the_relay_key_was():
    req = _request({"authorization": f"Bearer {RELAY_KEY}", "x-api-key": RELAY_KEY, "anthropic-version": "1"},
                   path="/v1beta/models/g:streamGenerateContent?alt=sse&key=" + RELAY_KEY)
    keys.swap_credentials(req, keys.presented_credentials(req), UPSTREAM_KEY)
    assert req.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert req.headers["x-api-key"] == UPSTREAM_KEY
    assert req.query["key"] == UPSTREAM_KEY and req.query["alt"] == "sse"
    assert req.headers["anthropic-version"] == "1"


@pytest.mark.parametrize(("headers", "path", "api"), [
    ({}, "/v1/chat/completions", apis.OPENAI_CHAT),
    ({}, "/v1/responses", apis.OPENAI_CHAT),
    ({}, "/v1/messages", apis.ANTHROPIC_MESSAGES),
    ({"anthropic-version": "2023-06-01"}, "/v1/models", apis.ANTHROPIC_MESSAGES),
    ({}, "/v1beta/models/gemini-2.0-flash:generateContent", apis.GEMINI),
    ({"x-goog-api-key": "k"}, "/v1beta/models", apis.GEMINI),
    ({}, "/anything", apis.OPENAI_CHAT),
])
def test_api_shape_for_errors(headers, path, api):
    assert refusals.api_shape(_request(headers, path)).name == api


def test_refusals_in_each_api_format():
    openai_body = json.loads(refusals.refusal(apis.get(apis.OPENAI_CHAT), 401, "m").content)
    assert openai_body == {"error": {"message": "m", "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}
    anthropic_resp = refusals.refusal(apis.get(apis.ANTHROPIC_MESSAGES), 401, "m")
    assert json.loads(anthropic_resp.content) == {"type": "error", "error": {"type": "authentication_error", "message": "m"}}
    assert anthropic_resp.headers["content-type"] == "application/json"
    assert anthropic_resp.headers["www-authenticate"].startswith("Bearer")
    gemini_body = json.loads(refusals.refusal(apis.get(apis.GEMINI), 401, "m").content)
    assert gemini_body == {"error": {"code": 401, "message": "m", "status": "UNAUTHENTICATED"}}
    assert json.loads(refusals.refusal(apis.get(apis.OPENAI_CHAT), 502, "m").content)["error"]["type"] == "server_error"


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
        access = next(a for a in _guarded(tctx) if isinstance(a, keys.AccessKeys))
        tctx.options.update(mode=["reverse:https://api.openai.com@8001"], relay_access_keys=["env:RELAY_KEYS_TEST"])

        ok = _reverse_flow({"authorization": f"Bearer {RELAY_KEY}"})
        access.requestheaders(ok)
        # The flow (what mitmweb shows in flight) never holds the upstream key; what is sent does.
        assert ok.response is None and ok.request.headers["authorization"] == "Bearer REDACTED"
        sent = ok.request.copy()
        upstream_copy._outgoing[ok](sent)
        assert sent.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"

        wrong = _reverse_flow({"authorization": "Bearer nope"})
        access.requestheaders(wrong)
        assert wrong.response.status_code == 401
        state.attach(wrong, state.FlowState(api=apis.get(apis.OPENAI_CHAT)))  # as the scope addon would
        access.error(wrong)  # a refused flow is answered on its head, then killed
        assert wrong.error is not None and wrong.error.msg == "Connection killed."
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
    redaction.redact_flow(f)
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
        secrets = next(a for a in _guarded(tctx) if isinstance(a, redaction.SecretRedaction))
        done, in_flight = tflow.tflow(resp=True), tflow.tflow()
        for f in (done, in_flight):
            f.request.headers["authorization"] = f"Bearer {FAKE_OPENAI_KEY}"
            secrets.requestheaders(f)
        assert done.request.headers["authorization"] == f"Bearer {FAKE_OPENAI_KEY}"  # still to be sent
        secrets.response(done)
        assert done.request.headers["authorization"] == "Bearer REDACTED"
        assert in_flight.request.headers["authorization"] == f"Bearer {FAKE_OPENAI_KEY}"
        secrets.done()  # shutdown: the flow saver writes flows still in flight
        assert in_flight.request.headers["authorization"] == "Bearer REDACTED"


# --- end to end: relay access keys -----------------------------------------------------


GEMINI_STREAM_PATH = "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse"
GEMINI_BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


@pytest.fixture
def keyed_relay(fake, start_relay, monkeypatch, tmp_path):
    """A relay whose reverse listener (to the fake) requires RELAY_KEY or OTHER_RELAY_KEY
    and sends UPSTREAM_KEY upstream."""
    keys = tmp_path / "relay-keys"
    keys.write_text(f"{RELAY_KEY}  # alice\n{OTHER_RELAY_KEY}  # bob\n")
    monkeypatch.setenv("RELAY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    return start_relay(reverse_to(fake), relay_access_keys=f"file:{keys}",
                       relay_upstream_keys="127.0.0.1=env:RELAY_TEST_UPSTREAM_KEY")


def _relay_key_never_sent(upstream) -> None:
    for got in upstream.received:
        assert RELAY_KEY not in got.path and OTHER_RELAY_KEY not in got.path
        assert all(RELAY_KEY not in v and OTHER_RELAY_KEY not in v for _, v in got.headers)


def test_sdks_with_a_relay_key_reach_the_upstream_with_its_key(keyed_relay, fake):
    sdk = openai.OpenAI(base_url=keyed_relay.url() + "/v1", api_key=RELAY_KEY, max_retries=0)
    stream = sdk.chat.completions.create(model="gpt-4o-mini", stream=True, messages=CHAT["messages"])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert fake.received[-1].header("authorization") == f"Bearer {UPSTREAM_KEY}"

    sdk = anthropic.Anthropic(base_url=keyed_relay.url(), api_key=OTHER_RELAY_KEY, max_retries=0)
    with sdk.messages.stream(model="claude-opus-4-6", max_tokens=64, messages=CHAT["messages"]) as stream:
        assert "".join(stream.text_stream)
    got = fake.received[-1]
    # Whichever slot this SDK version uses (x-api-key, or Bearer), the upstream key is in it.
    assert UPSTREAM_KEY in (got.header("x-api-key"), (got.header("authorization") or "").removeprefix("Bearer "))

    # Gemini's ?key= travels in the URL: swapped there, the rest of the query kept.
    conn, resp = client.request("POST", f"{keyed_relay.url()}{GEMINI_STREAM_PATH}&key={RELAY_KEY}", GEMINI_BODY)
    with conn:
        assert resp.status == 200 and resp.read()
    assert fake.received[-1].path == f"{GEMINI_STREAM_PATH}&key={UPSTREAM_KEY}"
    _relay_key_never_sent(fake)


def test_wrong_or_missing_relay_keys_get_401_in_the_apis_own_format(keyed_relay, fake, tmp_path):
    sdk = openai.OpenAI(base_url=keyed_relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        sdk.chat.completions.create(model="gpt-4o-mini", messages=CHAT["messages"])
    assert e.value.code == "invalid_api_key" and e.value.type == "invalid_request_error"

    sdk = anthropic.Anthropic(base_url=keyed_relay.url(), api_key=RELAY_KEY[:-1], max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        sdk.messages.create(model="claude-opus-4-6", max_tokens=64, messages=CHAT["messages"])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"

    conn, resp = client.request("POST", keyed_relay.url() + GEMINI_STREAM_PATH, GEMINI_BODY,
                                {"x-goog-api-key": "not-a-relay-key"})
    with conn:
        assert resp.status == 401 and resp.json()["error"]["status"] == "UNAUTHENTICATED"
    # Paths outside the relay's scope need the key too: the listener forwards everything.
    for headers in ({}, {"authorization": f"Bearer {RELAY_KEY}", "x-api-key": FAKE_ANTHROPIC_KEY}):
        conn, resp = client.request("GET", keyed_relay.url() + "/health", headers=headers)
        with conn:
            assert resp.status == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert fake.received == []  # nothing reached the upstream

    keyed_relay.stop()
    records = keyed_relay.log.records()
    assert len(records) == 3  # the in-scope calls; /health is not an LLM call
    assert all(r["status"] == 401 and r["error_phase"] == "relay" for r in records)
    assert {r["error"] for r in records} == {"relay access key not accepted"}
    assert {r["verdict"] for r in records} == {"refused by relay: key not accepted"}


# --- end to end: no secret in any output --------------------------------------------------


def _read_flows(path: Path) -> list[http.HTTPFlow]:
    with path.open("rb") as f:
        return list(io.FlowReader(f).stream())


def test_no_secret_reaches_console_records_or_saved_flows(fake, fake_tls, start_relay, monkeypatch, tmp_path):
    """Every way a key can arrive, through relays printing full flows (flow_detail=3) and saving
    them (-w): afterwards no output holds a key. All fake secrets contain FAKEKEY."""
    detail = {"flow_detail": 3}
    proxy_creds = "user:" + FAKE_PROXY_PASSWORD
    basic = "Basic " + base64.b64encode(proxy_creds.encode()).decode()
    secrets = ["FAKEKEY", basic.split()[1]]

    # 1. A plain relay: the clients' own keys pass through, in every slot and mode.
    # Distinct ports: mitmproxy refuses two listeners on 127.0.0.1:0.
    plain = start_relay(reverse_to(fake), f"regular@{free_port()}", f"reverse:http://127.0.0.1:{free_port()}@{free_port()}",
                        save_stream_file=tmp_path / "plain.flows", connection_strategy="lazy", **detail)
    sdk = openai.OpenAI(base_url=plain.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0)
    assert list(sdk.chat.completions.create(model="gpt-4o-mini", stream=True, messages=CHAT["messages"]))
    sdk = anthropic.Anthropic(base_url=plain.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0)
    assert sdk.messages.create(model="claude-opus-4-6", max_tokens=64, messages=CHAT["messages"]).content
    sdk = openai.OpenAI(base_url=fake_tls.base_url + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0,
                        http_client=openai.DefaultHttpxClient(
                            proxy=plain.url(1), verify=ssl.create_default_context(cafile=str(plain.ca_pem))))
    assert sdk.chat.completions.create(model="gpt-4o-mini", messages=CHAT["messages"]).choices
    every_slot = {"x-api-key": FAKE_ANTHROPIC_KEY, "api-key": FAKE_AZURE_KEY, "x-goog-api-key": FAKE_GEMINI_KEY,
                  "cookie": FAKE_COOKIE}
    conn, resp = client.request("POST", f"{plain.url()}{GEMINI_STREAM_PATH}&key={FAKE_GEMINI_KEY}", GEMINI_BODY,
                                every_slot)
    with conn:
        assert resp.status == 200 and resp.read()
    conn, resp = client.request("POST", plain.url(2) + "/v1/chat/completions", CHAT,
                                {"authorization": f"Bearer {FAKE_OPENAI_KEY}"})
    with conn:
        assert resp.status == 502  # connection refused (a lazy connect, so the request was read): an error flow
    # A stream still running when the relay stops: saved at shutdown.
    watch = fake.next_stream()
    conn, resp = client.request("POST", plain.url() + "/v1/chat/completions", CHAT,
                                {"authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-fake-stall-after-chunks": "1",
                                 "x-test-marker": "in-flight"})
    with conn:
        assert watch.wait_chunk_sent(0, timeout=10)
        plain.stop()
    assert all(FAKE_GEMINI_KEY in got.path or got.header("authorization") or got.header("x-api-key")
               for got in fake.received)  # the upstream did get the keys

    # 2. A relay with access keys: neither the relay key nor the upstream key shows.
    keys = tmp_path / "relay-keys"
    keys.write_text(RELAY_KEY + "\n")
    monkeypatch.setenv("RELAY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    keyed = start_relay(reverse_to(fake), relay_access_keys=f"file:{keys}",
                        relay_upstream_keys="127.0.0.1=env:RELAY_TEST_UPSTREAM_KEY",
                        save_stream_file=tmp_path / "keyed.flows", **detail)
    sdk = openai.OpenAI(base_url=keyed.url() + "/v1", api_key=RELAY_KEY, max_retries=0)
    assert list(sdk.chat.completions.create(model="gpt-4o-mini", stream=True, messages=CHAT["messages"]))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0).models.list()
    keyed.stop()

    # 3. A proxy with proxyauth: mitmproxy keeps the password in the flow's metadata.
    authed = start_relay("regular@0", proxyauth=proxy_creds, save_stream_file=tmp_path / "authed.flows", **detail)
    for creds in (basic, "Basic d3Jvbmc6RkFLRUtFWQ=="):  # right, then wrong ("wrong:FAKEKEY")
        conn, resp = client.request("POST", fake.base_url + "/v1/chat/completions", CHAT,
                                    {"proxy-authorization": creds}, proxy=authed.url())
        with conn:
            assert resp.status in (200, 407) and resp.read() is not None
    authed.stop()

    outputs = {
        "console": "\n".join(r.text() for r in (plain, keyed, authed)).encode(),
        "timing log": (tmp_path / "timing.jsonl").read_bytes(),
        **{name: (tmp_path / f"{name}.flows").read_bytes() for name in ("plain", "keyed", "authed")},
    }
    for name, data in outputs.items():
        for secret in secrets:
            assert secret.encode() not in data, f"{secret} in the {name}"
    for secret in (RELAY_KEY, UPSTREAM_KEY, proxy_creds):
        assert not any(secret.encode() in data for data in outputs.values())
    # ...and not because nothing was written:
    assert outputs["console"].count(b"Bearer REDACTED") >= 5 and b"x-goog-api-key: REDACTED" in outputs["console"]
    assert len(outputs["timing log"].splitlines()) >= 6
    saved = _read_flows(tmp_path / "plain.flows")
    assert len(saved) == 6
    in_flight = next(f for f in saved if f.request.headers.get("x-test-marker") == "in-flight")
    assert in_flight.request.headers["authorization"] == "Bearer REDACTED"
    assert list(_read_flows(tmp_path / "authed.flows")[0].metadata["proxyauth"]) == ["user", "REDACTED"]


# --- end to end: refusing to start as an open proxy -----------------------------------------

def _process(confdir, modes, *args: str, relay_conf: Path | None = None, tool: Path | None = None) -> MitmdumpProcess:
    proc = MitmdumpProcess(list(modes), confdir, extra_args=list(args), relay_conf=relay_conf)
    if tool is not None:
        proc.args[0] = str(tool)
    return proc


def _refused(proc: MitmdumpProcess) -> str:
    """Runs a relay that must refuse to start; returns its output."""
    done = subprocess.run(proc.args, env=proc.env, cwd=REPO, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    return output


@pytest.mark.parametrize(("modes", "args", "conf", "expected"), [
    (["regular@0"], ["--listen-host", "0.0.0.0"], None, "regular@0 on 0.0.0.0 (set proxyauth)"),
    ([f"regular@0.0.0.0:{free_port()}"], [], None, "(set proxyauth)"),
    # mitm.conf's listeners (the command line names none), applied before the guard loads.
    ([], [], "mode: ['regular@0.0.0.0:0']\n", "regular@0.0.0.0:0 on 0.0.0.0 (set proxyauth)"),
    (["regular@0"], ["--listen-host", "0.0.0.0", "--set", "proxyauth=any"], None, "(set proxyauth)"),
    (["reverse:https://api.openai.com@0"], ["--listen-host", "0.0.0.0", "--set", "proxyauth=u:p"], None,
     "(set relay_access_keys)"),
    # Authentication alone is not enough off loopback: keys and prompts would cross in clear.
    (["regular@0"], ["--listen-host", "0.0.0.0", "--set", "proxyauth=u:secret-pass"], None,
     "regular@0 on 0.0.0.0 without TLS (set certs)"),
])
def test_an_open_listener_stops_the_relay(confdir, tmp_path, modes, args, conf, expected):
    relay_conf = None
    if conf is not None:
        relay_conf = tmp_path / "mitm.conf"
        relay_conf.write_text(conf)
    output = _refused(_process(confdir, modes, *args, relay_conf=relay_conf))
    assert "refusing to start as an open proxy" in output and expected in output


@pytest.mark.parametrize("args", [
    ["--set", "proxyauth=user:secret-pass", "--set", "certs={cert}"],
    ["--set", "proxyauth=user:secret-pass", "--set", "relay_client_tls=optional"],
    ["--set", "relay_allow_open_proxy=true"],
])
def test_a_protected_or_allowed_listener_starts(confdir, certs, args):
    args = [arg.format(cert=f"localhost={certs.cert_and_key_pem}") for arg in args]
    relay = _process(confdir, ["regular@0"], "--listen-host", "0.0.0.0", *args).start()
    output = relay.stop()
    assert "refusing" not in output
    assert ("serving without authentication" in output) == ("relay_allow_open_proxy=true" in args)


def test_a_reverse_listener_with_access_keys_and_tls_starts(confdir, certs, monkeypatch):
    monkeypatch.setenv("RELAY_TEST_KEYS", RELAY_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", UPSTREAM_KEY)
    relay = _process(confdir, ["reverse:https://api.openai.com@0"], "--listen-host", "0.0.0.0",
                     "--set", "relay_access_keys=env:RELAY_TEST_KEYS", "--set", f"certs={certs.cert_and_key_pem}").start()
    assert "refusing" not in relay.stop()


def test_missing_upstream_key_stops_the_relay(confdir, monkeypatch):
    monkeypatch.setenv("RELAY_TEST_KEYS", RELAY_KEY)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    output = _refused(_process(confdir, ["reverse:https://api.anthropic.com@0"],
                               "--set", "relay_access_keys=env:RELAY_TEST_KEYS"))
    assert "environment variable ANTHROPIC_API_KEY is not set" in output


def test_mitmweb_off_loopback_needs_a_password(confdir):
    web = ["--web-host", "0.0.0.0", "--web-port", str(free_port()), "--set", "web_open_browser=false"]
    output = _refused(_process(confdir, ["regular@0"], *web, tool=MITMWEB))
    assert "mitmweb on web_host 0.0.0.0 needs web_password" in output

    relay = _process(confdir, ["regular@0"], *web, "--set", "web_password=correct-horse-battery", tool=MITMWEB)
    relay.start()
    try:
        relay.wait_for_output("Web server listening")
    finally:
        relay.stop()
