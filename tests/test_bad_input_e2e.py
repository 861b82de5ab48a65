"""Bad and unusual input end to end, through a real mitmdump: forwarded untouched (or
answered clearly), exactly one record per in-scope request, and the relay keeps serving
(a normal streamed request afterwards works).

Two relays serve the module (`shared_relay`: plain, and with a trim budget so that the
trimmer reads every body); a test finds its records by its `x-request-id` (`rid`).
"""

from __future__ import annotations

import gzip
import hashlib
import socket
import ssl
import zlib

import brotli
import httpx2
import orjson
import pytest

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.http_wire import find_header

pytestmark = pytest.mark.shared_fake

WAIT = 30
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {FAKE_OPENAI_KEY}"}
GOOD = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def still_serving(relay, rid: str) -> None:
    conn, response = client.request("POST", relay.url() + CHAT, GOOD, {**AUTH, "x-request-id": rid}, timeout=WAIT)
    with conn:
        assert response.status == 200
        assert response.read().endswith(b"data: [DONE]\n\n")


BODIES = {
    "invalid JSON": b'{"model": "gpt-4o-mini", "messages": [',
    "invalid UTF-8": b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "not an object": b'[{"role": "user", "content": "hi"}]',
    "messages not a list": b'{"model": "gpt-4o-mini", "messages": {"role": "user"}}',
    "content of odd types": orjson.dumps({"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": 12}, {"role": "user", "content": None}, {"role": "user", "content": {"a": [1]}},
        {"role": 5, "content": [{"type": "image_url"}, 3, None]}, "nope", None]}),
    "deeply nested": b'{"model": "gpt-4o-mini", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "empty": b"",
    "model not a string": b'{"model": ["x"], "stream": "yes", "messages": []}',
}


@pytest.mark.parametrize("name", list(BODIES))
def test_odd_bodies_are_forwarded_untouched(name, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), relay_trim_max_tokens=50)  # a budget: the trimmer reads every body
    body = BODIES[name]
    conn, response = client.request("POST", relay.url() + CHAT, body,
                                    {**AUTH, "content-type": "application/json", "x-request-id": rid}, timeout=WAIT)
    with conn:
        status, got = response.status, response.read()
    assert fake.wait_finished(1, WAIT)
    assert (status, got) == (fake.sent[-1].status, fake.sent[-1].body)
    assert fake.received[-1].body == body
    still_serving(relay, rid)
    relay.log.of(rid, 2)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                          "application/json; charset=latin-1", ""])
def test_odd_content_types_are_forwarded_untouched(content_type, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    body = orjson.dumps(GOOD)
    conn, response = client.request("POST", relay.url() + CHAT, body,
                                    {**AUTH, "content-type": content_type, "x-request-id": rid}, timeout=WAIT)
    with conn:
        assert response.status == 200
        got = response.read()
    assert fake.wait_finished(1, WAIT)
    assert got == fake.sent[-1].body and fake.received[-1].body == body
    relay.log.of(rid)


def test_a_50_mb_body_is_forwarded_byte_for_byte(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    filler = "x" * (50 * 1024 * 1024)
    body = orjson.dumps({**GOOD, "messages": [{"role": "user", "content": filler}]})
    conn, response = client.request("POST", relay.url() + CHAT, body, {**AUTH, "x-request-id": rid}, timeout=120)
    with conn:
        assert response.status == 200
        response.read()
    assert hashlib.sha256(fake.received[-1].body).digest() == hashlib.sha256(body).digest()
    still_serving(relay, rid)
    relay.log.of(rid, 2)


def test_a_chunked_request_body_is_forwarded(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    body = orjson.dumps(GOOD)
    conn, response = client.request("POST", relay.url() + CHAT, body, {**AUTH, "x-request-id": rid}, chunked=True,
                                    upload_pieces=5,
                                    upload_pause_s=0.01, timeout=WAIT)
    with conn:
        assert response.status == 200 and response.read().endswith(b"data: [DONE]\n\n")
    assert fake.received[-1].body == body
    relay.log.of(rid)


ENCODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
}


@pytest.mark.parametrize("coding", list(ENCODERS) + ["gzip-corrupt"])
def test_compressed_request_bodies(coding, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), relay_trim_max_tokens=50)
    plain = orjson.dumps(GOOD)
    if coding == "gzip-corrupt":
        coding, body = "gzip", b"\x1f\x8b not gzip at all"
    else:
        body = ENCODERS[coding](plain)
    conn, response = client.request("POST", relay.url() + CHAT, body,
                                    {**AUTH, "content-encoding": coding, "x-request-id": rid}, timeout=WAIT)
    with conn:
        response.read()
    received = fake.received[-1]
    assert find_header(received.headers, "content-encoding") == coding
    assert received.body == body or zlib.decompress(received.body, 47) == plain  # untouched, or re-encoded same
    still_serving(relay, rid)
    relay.log.of(rid, 2)


def test_paths_out_of_scope_are_forwarded_without_a_record(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    for n, (method, path) in enumerate([("GET", "/health"), ("POST", "/v2/models"), ("GET", "/"),
                                        ("OPTIONS", "/x")], 1):
        conn, response = client.request(method, relay.url() + path, b"", {"x-request-id": rid}, timeout=WAIT)
        with conn:
            assert response.status == 404
            got = response.read()
        assert fake.wait_finished(n, WAIT) and got == fake.sent[-1].body
    relay.log.none_of(rid)  # checked once the relay stopped


def test_a_websocket_upgrade_is_passed_on_and_answered(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "x-request-id": rid}
    conn, response = client.request("GET", relay.url() + "/v1/realtime?model=gpt-4o", b"", headers, timeout=WAIT)
    with conn:
        assert response.status == 404  # the fake speaks no websocket: its answer comes back unchanged
        got = response.read()
    assert fake.wait_finished(1, WAIT) and got == fake.sent[-1].body
    assert find_header(fake.received[-1].headers, "upgrade") == "websocket"
    still_serving(relay, rid)
    relay.log.of(rid, 2)


def test_garbage_instead_of_http_leaves_the_relay_serving(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    for garbage in (b"\x00\xff" * 100 + b"\r\n\r\n", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\n"
                    b"Content-Length: -5\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", relay.port), timeout=WAIT) as s:
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
    still_serving(relay, rid)


def test_an_http2_client(fake, shared_relay, rid):
    """HTTP/2 (negotiated with ALPN over TLS to the relay's reverse listener): streamed
    answers, and an upstream failure answered in the API's format on the h2 stream."""
    relay = shared_relay(reverse_to(fake), http2=True)
    url = f"https://127.0.0.1:{relay.port}{CHAT}"
    mine = {**AUTH, "x-request-id": rid}
    with httpx2.Client(http2=True, verify=ssl.create_default_context(cafile=relay.ca_pem), timeout=WAIT) as h2:
        with h2.stream("POST", url, json=GOOD, headers=mine) as response:
            assert response.http_version == "HTTP/2" and response.status_code == 200
            body = b"".join(response.iter_bytes())
        assert fake.wait_finished(1, WAIT) and body == fake.sent[-1].body
        with h2.stream("POST", url, json=GOOD, headers={**mine, "x-fake-reset-before-headers": "1"}) as response:
            assert response.status_code == 502
            assert orjson.loads(response.read())["error"]["type"] == "server_error"
        with h2.stream("POST", url, json=GOOD, headers={**mine, "x-fake-reset-after-chunks": "3"}) as response:
            assert response.status_code == 200
            body = b"".join(response.iter_bytes())  # ends cleanly: no stream reset
        assert fake.wait_finished(3, WAIT)
        assert body.startswith(fake.sent[-1].body) and b'"ttft-relay: ' in body[len(fake.sent[-1].body):]
    assert [r["error"] is None for r in relay.log.of(rid, 3)] == [True, False, False]
