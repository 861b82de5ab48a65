"""A keyed relay under clients without a key, through a real mitmdump: the key is
checked on the request head (before the body is read, before any upstream
connection), a head must arrive in time, a connection limit refuses clearly, and a
reverse listener sends only the configured upstream's origin-form target.

Raw sockets, because SDKs cannot misbehave on purpose. The cases share a keyed relay
per option set (`shared_relay`).
"""

from __future__ import annotations

import socket
import ssl
import time

import pytest

from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.upstream import FakeUpstream
from tests.test_guard import RELAY_KEY, UPSTREAM_KEY

pytestmark = pytest.mark.shared_fake

WAIT = 20


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    """The relay keys, and the upstream key in the environment the module's relays start with."""
    keys = tmp_path_factory.mktemp("keys") / "relay-keys"
    keys.write_text(f"{RELAY_KEY}\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RELAY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
        yield keys


def keyed(relays, mode: str, keys_file, **options):
    """A relay from `relays` (start_relay or shared_relay) whose `mode` listener takes RELAY_KEY."""
    return relays(mode, relay_access_keys=f"file:{keys_file}",
                  relay_upstream_keys="127.0.0.1=env:RELAY_TEST_UPSTREAM_KEY", **options)


def raw(relay) -> socket.socket:
    return socket.create_connection(("127.0.0.1", relay.port), timeout=WAIT)


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while data := s.recv(65536):
        out += data
    return out


def head(target: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_request_without_a_key_is_refused_on_its_head_before_its_body(fake, shared_relay, keys_file):
    relay = keyed(shared_relay, reverse_to(fake), keys_file)
    with raw(relay) as s:
        # 400 MB announced, none sent: the 401 must not wait for them.
        s.sendall(head("/v1/chat/completions", {"host": "x", "content-length": str(400 << 20),
                                                "content-type": "application/json"}))
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"missing relay access key" in answer
    assert fake.received == []


def test_no_upstream_connection_opens_before_the_key_is_checked(start_relay, keys_file):
    # An upstream that never accepts: a connection to it shows in its accept queue.
    with socket.socket() as upstream:
        upstream.bind(("127.0.0.1", 0))
        upstream.listen(64)
        upstream.setblocking(False)
        port = upstream.getsockname()[1]
        # eager by default; no connection opened ahead by the upstream pool either (not for a client)
        relay = keyed(start_relay, f"reverse:http://127.0.0.1:{port}@0", keys_file, relay_upstream_pool_warm=0)
        idle = [raw(relay) for _ in range(5)]
        with raw(relay) as s:
            s.sendall(head("/v1/chat/completions", {"host": "x", "content-length": "2"}) + b"{}")
            assert s.recv(65536).startswith(b"HTTP/1.1 401")
            with pytest.raises(BlockingIOError):
                upstream.accept()  # nothing connected: not for the idle ones, not for the refused one
        for s in idle:
            s.close()


def test_no_upstream_connection_opens_for_a_tls_client_before_its_key(fake_tls, start_relay, keys_file):
    # With the eager strategy mitmproxy connects upstream during a TLS client's
    # handshake (to learn what the upstream speaks), before any request.
    relay = start_relay(f"reverse:https://localhost:{fake_tls.port}@0", relay_access_keys=f"file:{keys_file}",
                        relay_upstream_keys="localhost=env:RELAY_TEST_UPSTREAM_KEY", relay_upstream_pool_warm=0)
    context = ssl.create_default_context(cafile=str(relay.ca_pem))
    idle = [context.wrap_socket(raw(relay), server_hostname="127.0.0.1") for _ in range(5)]  # handshakes done
    try:
        assert fake_tls.open_connections == 0
    finally:
        for s in idle:
            s.close()


def test_once_the_key_is_accepted_the_upstream_connect_runs_while_the_body_uploads(start_relay, keys_file, rid):
    # A fake and a relay of its own, with no pooled upstream connection yet: its first request connects.
    with FakeUpstream() as fake:
        check_the_connect_runs_while_the_body_uploads(fake, keyed(start_relay, reverse_to(fake), keys_file,
                                                                  relay_upstream_pool_warm=0), rid)


def check_the_connect_runs_while_the_body_uploads(fake: FakeUpstream, relay, rid: str) -> None:
    body = b'{"model": "gpt-4o-mini", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    with raw(relay) as s:
        s.sendall(head("/v1/chat/completions", {"host": "x", "authorization": f"Bearer {RELAY_KEY}",
                                                "content-type": "application/json", "content-length": str(len(body)),
                                                "x-request-id": rid}))
        # The body is not sent yet: a lazy connect would wait for it and the request hooks.
        assert fake.wait_connections(1, 5), "no upstream connection while the body uploads"
        assert fake.received == []
        s.sendall(body)
        answer = read_until_done(s)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert fake.wait_finished(1, WAIT) and fake.received[0].header("authorization") == f"Bearer {UPSTREAM_KEY}"
    (rec,) = relay.log.of(rid)
    assert rec["error"] is None and rec["reused_connection"] is False


def read_until_done(s: socket.socket) -> bytes:
    out = b""
    # The last chunk, a line "0" of its own (a head can end in "...dur=2.0\r\n\r\n" too)
    while not out.endswith(b"\r\n0\r\n\r\n") and (data := s.recv(65536)):
        out += data
    return out


def test_a_head_that_never_ends_is_cut_after_the_header_timeout(fake, shared_relay, keys_file):
    relay = keyed(shared_relay, reverse_to(fake), keys_file, relay_client_head_timeout=1)
    with raw(relay) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        # slowloris: one more byte now and then, each well inside mitmproxy's idle timeout
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < WAIT:
            try:
                s.sendall(b"x")
                s.settimeout(0.2)
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
    assert closed
    assert time.monotonic() - started < WAIT / 2


def test_connections_over_the_limit_get_a_clear_refusal(fake, shared_relay, keys_file):
    relay = keyed(shared_relay, reverse_to(fake), keys_file, relay_max_connections=5)
    held = [raw(relay) for _ in range(5)]
    try:
        with raw(relay) as extra:
            answer = read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"connection limit" in answer
    finally:
        for s in held:
            s.close()
    relay.wait_for_output(r"connection limit \(5\) reached")


def test_an_absolute_form_target_goes_to_the_configured_upstream_in_origin_form(fake, shared_relay, keys_file):
    relay = keyed(shared_relay, reverse_to(fake), keys_file)
    with raw(relay) as s:
        s.sendall(head("http://evil.example/v1/chat/completions",
                       {"host": "evil.example", "authorization": f"Bearer {RELAY_KEY}",
                        "content-type": "application/json", "content-length": "2"}) + b"{}")
        s.recv(65536)
    (got,) = fake.received
    assert got.path == "/v1/chat/completions"
    assert got.header("host") == fake.base_url.removeprefix("http://")
    assert got.header("authorization") == f"Bearer {UPSTREAM_KEY}"


def test_a_refused_request_without_a_body_keeps_its_connection(fake, shared_relay, keys_file):
    # (Found by tests/test_wire_fuzz.py: the refusal crashed mitmproxy's connection handler.)
    relay = keyed(shared_relay, reverse_to(fake), keys_file)
    with client.HttpConnection(relay.url(), timeout=WAIT) as conn:
        refused = conn.request("POST", "/v1/chat/completions", b"")
        assert refused.status == 401 and refused.read()
        served = conn.request("POST", "/v1/chat/completions", {"model": "m", "messages": []},
                              {"authorization": f"Bearer {RELAY_KEY}"})
        assert served.status == 200 and served.read()
    assert "mitmproxy has crashed" not in relay.text()  # (printed as it happens)


def test_the_header_timeout_covers_the_next_head_after_a_refusal(fake, shared_relay, keys_file):
    relay = keyed(shared_relay, reverse_to(fake), keys_file, relay_client_head_timeout=1)
    with client.HttpConnection(relay.url(), timeout=WAIT) as conn:
        refused = conn.request("POST", "/v1/chat/completions", b"")
        assert refused.status == 401 and refused.read()
        conn.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # and nothing more
        started = time.monotonic()
        assert conn.sock.recv(1) == b""  # closed by the relay
    assert time.monotonic() - started < WAIT / 2
