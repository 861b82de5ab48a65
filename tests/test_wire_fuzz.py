"""Hypothesis on the wire: malformed and hostile HTTP/1 requests, as raw bytes, into
one real keyed relay (mitmdump -s ttft_relay/relay.py) in front of the fake upstream.

Whatever arrives, the relay answers or closes within a bound (no hang), never
crashes, never logs a key, and keeps serving a well-formed request afterwards.
Bounded for CI: FUZZ_EXAMPLES examples (env TTFT_FUZZ_EXAMPLES), each at most a
few seconds (the relay's header timeout is 2 s; the client half-closes after
sending, so a body it promised but never sent ends too).
"""

from __future__ import annotations

import os
import socket

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import client
from tests.test_guard import RELAY_KEY, UPSTREAM_KEY

FUZZ_EXAMPLES = int(os.environ.get("TTFT_FUZZ_EXAMPLES", "120"))
ANSWER_WITHIN = 15  # seconds: a bound that turns a hang into a failure
CRASHES = ("mitmproxy has crashed", "Traceback", "Unhandled error")

paths = st.sampled_from([
    "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models",
    "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
    f"/v1/chat/completions?key={RELAY_KEY}", f"/v1/chat/completions?KEY={FAKE_OPENAI_KEY}",
    "http://evil.example/v1/chat/completions", "*", "/%00%ff", "/" + "a" * 5000,
])
methods = st.sampled_from(["POST", "GET", "PUT", "HEAD", "OPTIONS", "CONNECT", "P\x00ST", "post", ""])
versions = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/9.9", "", "HTTP/1.1 extra"])
header_names = st.sampled_from([
    "authorization", "x-api-key", "openai-api-key", "x-goog-api-key", "content-type", "content-encoding",
    "content-length", "transfer-encoding", "expect", "host", "connection", "upgrade", "x-request-id",
    "anthropic-version", "trailer", "accept-encoding", "bad header", "", "x\x00y",
])
header_values = st.one_of(
    st.sampled_from([
        f"Bearer {RELAY_KEY}", "Bearer wrong-key-0123456789", RELAY_KEY, "application/json", "gzip", "br",
        "chunked", "chunked, gzip", "identity", "100-continue", "-1", "0", "99999999999999999999", "10",
        "close", "keep-alive", "websocket", "2023-06-01", "\x1b[2J", "x\r\ninjected: yes",
    ]),
    st.text(max_size=40),
)
bodies = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda model, stream: orjson.dumps({"model": model, "stream": stream,
                                                 "messages": [{"role": "user", "content": "hi"}]}),
              st.text(max_size=30), st.booleans()),
    st.just(b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
)


@st.composite
def raw_requests(draw) -> bytes:
    line = f"{draw(methods)} {draw(paths)} {draw(versions)}".encode("utf8", "surrogateescape")
    headers = draw(st.lists(st.tuples(header_names, header_values), max_size=8))
    body = draw(bodies)
    framing = draw(st.sampled_from(["length", "wrong length", "chunked", "chunked with trailers", "none"]))
    head = [line]
    if framing in ("length", "wrong length"):
        length = len(body) if framing == "length" else draw(st.integers(0, 10_000))
        headers.append(("content-length", str(length)))
    elif framing.startswith("chunked"):
        headers.append(("transfer-encoding", "chunked"))
        cut = draw(st.integers(0, len(body)))
        pieces = [p for p in (body[:cut], body[cut:]) if p]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n"
        body += b"x-trailer: yes\r\n\r\n" if framing.endswith("trailers") else b"\r\n"
    head += [f"{name}: {value}".encode("utf8", "surrogateescape") for name, value in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def exchange(port: int, data: bytes) -> bytes:
    """Send `data`, half-close, read until the relay closes (or the bound passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the relay may answer and close before all of it was sent
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


@pytest.fixture
def keyed_fuzz_relay(fake, start_relay, tmp_path, monkeypatch):
    keys = tmp_path / "relay-keys"
    keys.write_text(f"{RELAY_KEY}\n")
    monkeypatch.setenv("RELAY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    return start_relay(reverse_to(fake), relay_access_keys=f"file:{keys}",
                       relay_upstream_keys="127.0.0.1=env:RELAY_TEST_UPSTREAM_KEY",
                       relay_client_head_timeout=2, flow_detail=3, **{"relay_idle_timeout": 2, "relay_upstream_head_timeout": 5})


def test_hostile_bytes_never_crash_hang_or_leak(keyed_fuzz_relay):
    relay = keyed_fuzz_relay

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=raw_requests())
    def one(data: bytes) -> None:
        seen = len(relay.output)
        exchange(relay.port, data)  # raises TimeoutError on a hang
        assert relay.proc.poll() is None, relay.text()[-3000:]
        new = "\n".join(relay.output[seen:])
        assert not any(crash in new for crash in CRASHES), new[-3000:]

    one()
    # Still serving, and no key in anything it printed.
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions",
                                {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
                                {"authorization": f"Bearer {RELAY_KEY}"}, timeout=ANSWER_WITHIN)
    with conn:
        assert resp.status == 200 and resp.read()
    out = relay.stop()
    for secret in (RELAY_KEY, UPSTREAM_KEY, FAKE_OPENAI_KEY):
        assert secret not in out
