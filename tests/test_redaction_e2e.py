"""Keys never reach mitmproxy's own log lines, saved flows or mitmweb, through a real
mitmdump / mitmweb: a bad request line, a head the client abandons, every key
spelling, a flow in flight; and one log line carries a bounded amount.
"""

from __future__ import annotations

import socket

import pytest
from mitmproxy import io
from mitmproxy.test import tflow

from ttft_relay import text
from ttft_relay.guard import redaction

from ttft_relay.workers import free_port
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import MITMWEB, MitmdumpProcess
from tests.test_guard import RELAY_KEY, UPSTREAM_KEY
from tests.test_mitmweb_e2e import PASSWORD, web_get
from tests.test_preauth_e2e import keyed, keys_file, raw, read_until_closed  # noqa: F401 (fixture)

SECRET = "sk-SECRET-0123456789abcdefghij"
WAIT = 20


# --- pure -------------------------------------------------------------------------------


def test_safe_log_text_redacts_keys_in_raw_request_bytes():
    raw_head = repr(f"POST /v1/x?KEY={SECRET}&alt=sse HTTP/1.1\r\nHost: a:1\r\nAuthorization: Bearer {SECRET}\r\n"
                    f"openai-api-key: {SECRET}\r\nx-goog-api-key:{SECRET}\r\nCookie: s={SECRET}\r\n".encode())
    safe = text.safe_log_text(f"Client closed connection before completing request headers: {raw_head}")
    assert SECRET not in safe
    assert "?KEY=REDACTED&alt=sse" in safe and "Authorization: Bearer REDACTED" in safe and "Host: a:1" in safe


def test_a_known_key_in_prose_punctuation_is_redacted_and_one_holding_it_too(monkeypatch):
    dotted = "key.with.dots-0123456789"  # a key may hold the punctuation prose puts around one
    monkeypatch.setattr(text, "_KNOWN_SECRETS", {text.key_digest(SECRET), text.key_digest(dotted)})
    for around in ("({})", "[{}]", "<{}>", "{}.", "key {}!", "`{}`", "(req-1, {})"):
        safe = text.safe_log_text(around.format(SECRET))
        assert SECRET not in safe and safe == around.format("REDACTED"), safe
    assert text.without_known_secrets(f"({dotted}).") == "(REDACTED)."
    assert text.without_known_secrets("(an-ordinary-long-token)") == "(an-ordinary-long-token)"


def test_safe_log_text_escapes_controls_and_caps_each_line():
    assert text.safe_log_text("gpt\x1b[2J\rfake line\nnext") == "gpt\\x1b[2J\\rfake line\nnext"
    line = text.safe_log_text("a" * 10_000 + "\nshort")
    first, second = line.split("\n")
    assert len(first) < text.MAX_LOG_LINE + 40 and first.endswith("(8000 more characters)") and second == "short"
    ordinary = "upstream wait (prefill/queue) 304 ms · ttft 310 ms [upstream_wait 304] · gpt-4o 200 → 127.0.0.1:1"
    assert text.safe_log_text(ordinary) == ordinary


def test_a_word_that_names_a_secret_is_prose_unless_it_starts_a_header():
    learning = ("127.0.0.1:1 openai.chat gpt-4o 200 ttft 171 ms [head_to_first_token 154] → upstream wait "
                "(prefill/queue): the upstream's own wait 156 ms, 91% of the 171 ms to the first token: "
                "learning this upstream · model: 1 of 8 requests")
    assert text.safe_log_text(learning) == learning
    assert text.safe_log_text(f"POST / HTTP/1.1\nToken: {SECRET}\nsecret:{SECRET}") == \
        "POST / HTTP/1.1\nToken: REDACTED\nsecret:REDACTED"
    assert text.safe_log_text(repr(f"GET / HTTP/1.1\r\nkey: {SECRET}\r\n".encode())).count("REDACTED") == 1
    for header in ("x-auth-token", "X-Api-Key", "api_key", "Proxy-Authorization", "my_password"):
        assert text.safe_log_text(f"bad header {header}: {SECRET} seen") == f"bad header {header}: REDACTED"


def test_redact_flow_covers_every_spelling():
    f = tflow.tflow()
    f.request.path = f"/v1/x?KEY={SECRET}&Api_Key={SECRET}&access_token={SECRET}&alt=sse"
    for name in ("openai-api-key", "anthropic-api-key", "X-Auth-Token", "x-goog-api-key"):
        f.request.headers[name] = SECRET
    redaction.redact_flow(f)
    assert SECRET not in repr(f.get_state())
    assert f.request.query["alt"] == "sse"


# --- end to end -------------------------------------------------------------------------


def sent_raw(relay, data: bytes, *, close_early: bool = False) -> bytes:
    with raw(relay) as s:
        s.sendall(data)
        if close_early:
            s.shutdown(socket.SHUT_WR)
        return read_until_closed(s)


def stopped_output(relay) -> str:
    return relay.stop()


@pytest.mark.parametrize("data, close_early, logged", [
    (f"POST /v1/chat/completions?key={SECRET}\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode(), False, True),
    (f"POST /v1/chat/completions?KEY={SECRET} HTTP/1.1\r\nx-api-key: {SECRET}\r\n".encode(), True, True),
    (f"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer {SECRET}\r\nbad header line\r\n\r\n".encode(),
     False, False),
], ids=["bad request line", "head abandoned", "bad header line"])
def test_mitmproxys_own_lines_about_a_request_carry_no_key(data, close_early, logged, fake, start_relay):
    # mitmproxy's own lines about connections are what this test reads: on here (off by default).
    relay = start_relay(reverse_to(fake), termlog_verbosity="debug", flow_detail=3, relay_connection_log=True)
    sent_raw(relay, data, close_early=close_early)
    relay.wait_for_output(r"client disconnect")
    out = stopped_output(relay)
    assert SECRET not in out, out
    if logged:  # mitmproxy printed the raw bytes, redacted (else it printed the flow, redacted too)
        assert "REDACTED" in out


def test_a_key_quoted_by_mitmproxys_smuggling_check_is_redacted(fake, start_relay, keys_file):  # noqa: F811
    """mitmproxy refuses two transfer-encodings, quoting their values in the flow's error,
    which its dumper prints (not a log record: the log redaction never sees it). A relay
    key in one is redacted there too (tests/test_wire_fuzz.py found it)."""
    relay = keyed(start_relay, reverse_to(fake), keys_file, flow_detail=3)
    sent_raw(relay, f"POST /v1/chat/completions HTTP/1.1\r\nauthorization: Bearer {RELAY_KEY}\r\n"
                    f"transfer-encoding: Bearer {RELAY_KEY}\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".encode())
    out = stopped_output(relay)
    assert "request smuggling" in out and RELAY_KEY not in out, out


def test_every_key_spelling_is_redacted_in_console_and_saved_flows(fake, start_relay, tmp_path):
    saved = tmp_path / "flows"
    relay = start_relay(reverse_to(fake), flow_detail=3, save_stream_file=saved)
    for path, headers in [
        (f"/v1/chat/completions?KEY={SECRET}", {}),
        (f"/v1/chat/completions?Key={SECRET}&alt=sse", {}),
        ("/v1/chat/completions", {"openai-api-key": SECRET}),
        ("/v1/chat/completions", {"anthropic-api-key": SECRET}),
    ]:
        conn, resp = client.request("POST", relay.url() + path, {"model": "m", "messages": []}, headers)
        with conn:
            resp.read()
    out = stopped_output(relay)
    assert SECRET not in out
    with saved.open("rb") as f:
        flows = list(io.FlowReader(f).stream())
    assert len(flows) == 4
    assert all(SECRET not in repr(flow.get_state()) for flow in flows)
    assert all(SECRET in got.path or SECRET in repr(got.headers) for got in fake.received)  # forwarded unchanged


def test_a_head_that_never_ends_is_refused_with_one_short_line(fake, start_relay):
    relay = start_relay(reverse_to(fake))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nx-filler: " + b"a" * (4 << 20)
    with raw(relay) as s:
        try:
            s.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the relay gave up on it before all of it was sent
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    out = stopped_output(relay)
    assert max(len(line) for line in out.splitlines()) < 5000


def test_mitmweb_never_shows_the_upstream_key_of_a_flow_in_flight(fake, confdir, tmp_path, keys_file, monkeypatch):  # noqa: F811
    web_port = free_port()
    relay = MitmdumpProcess([reverse_to(fake)], confdir, options={
        "web_port": web_port, "web_open_browser": "false", "web_password": PASSWORD,
        "relay_timing_log": tmp_path / "timing.jsonl", "relay_access_keys": f"file:{keys_file}",
        "relay_upstream_keys": "127.0.0.1=env:RELAY_TEST_UPSTREAM_KEY"}, env={"RELAY_TEST_UPSTREAM_KEY": UPSTREAM_KEY})
    relay.args[0] = str(MITMWEB)
    fake.behaviour.stall_after_chunks = 2
    with relay.start():
        relay.wait_for_output("Web server listening")
        conn, resp = client.request("POST", relay.url() + "/v1/chat/completions",
                                    {"model": "m", "stream": True, "messages": []},
                                    {"authorization": f"Bearer {RELAY_KEY}"}, timeout=WAIT)
        with conn:
            assert resp.status == 200
            next(resp.chunks())  # in flight: the head went out, the stream stalls
            flows = web_get(web_port, "/flows")
            assert len(flows) == 1
            shown = repr(flows)
            assert UPSTREAM_KEY not in shown and RELAY_KEY not in shown
            fake.release_stalls()
    assert fake.received[-1].header("authorization") == f"Bearer {UPSTREAM_KEY}"


def test_mitmweb_shows_no_client_key_of_a_proxy_mode_flow_in_flight(fake, confdir, tmp_path):
    """Through a proxy listener the client's own key goes upstream as it sent it, so its flow holds
    the key until the answer ends; mitmweb showed it all that while (the list, the dump, Export).
    Every view now gets the flow redacted, and the provider still gets the key."""
    import json
    import urllib.request

    web_port = free_port()
    relay = MitmdumpProcess(["regular@0"], confdir, options={
        "web_port": web_port, "web_open_browser": "false", "web_password": PASSWORD,
        "relay_timing_log": tmp_path / "timing.jsonl"})
    relay.args[0] = str(MITMWEB)
    fake.behaviour.stall_after_chunks = 2

    def web(path: str, body: dict | None = None) -> bytes:
        req = urllib.request.Request(f"http://127.0.0.1:{web_port}{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {PASSWORD}", "Content-Type": "application/json",
                                              # tornado's XSRF check: the cookie and the header agree
                                              "Cookie": "_mitmproxy_xsrf=0123abcd", "X-XSRFToken": "0123abcd"})
        with urllib.request.urlopen(req, timeout=WAIT) as resp:
            return resp.read()

    with relay.start():
        relay.wait_for_output("Web server listening")
        conn, resp = client.request("POST", f"{fake.base_url}/v1/chat/completions?api_key={SECRET}",
                                    {"model": "m", "stream": True, "messages": []},
                                    {"authorization": f"Bearer {SECRET}", "x-api-key": SECRET},
                                    proxy=relay.url(), timeout=WAIT)
        with conn:
            assert resp.status == 200
            next(resp.chunks())  # in flight: the head went out, the stream stalls
            (flow,) = web_get(web_port, "/flows")
            views = {"list": json.dumps(flow), "dump": web("/flows/dump").decode("latin-1")}
            for fmt in ("curl", "httpie", "raw_request"):
                views[fmt] = web("/commands/export", {"arguments": [fmt, f"@{flow['id']}"]}).decode()
            fake.release_stalls()
    assert {name: SECRET in shown for name, shown in views.items()} == dict.fromkeys(views, False)
    assert "Bearer" in views["curl"] and text.REDACTED in views["curl"]  # the header is there, its value not
    got = fake.received[-1]
    assert got.header("authorization") == f"Bearer {SECRET}" and got.header("x-api-key") == SECRET
