"""Hostile input, end to end through a real mitmdump with the relay (issue 26's items 6 and 8):
an upstream's garbage is never reflected at its size, a chunked body's framing lines and a
compressed stream's decoding are bounded, header values with CR/LF/NUL and unknown HTTP
versions never pass, a client's malformed chunked body is answered, a refused brotli bomb's
record names the relay, and running out of descriptors is one warning, not a traceback each
time. The hostile peers are ttft_relay/testing/fakes/hostile.py's.
"""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import brotli
import orjson
import pytest

from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.hostile import HOLD, HostileUpstream, gzip_bomb
from ttft_relay import text

WAIT = 30
CHAT = "/v1/chat/completions"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunks(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


FIVE_EVENTS = chunks(*(b'data: {"choices":[{"delta":{"content":"hi %d"}}]}\n\n' % i for i in range(5)))


def endless_line(s) -> Iterator[bytes]:
    yield SSE_HEAD + FIVE_EVENTS
    for _ in range(200):
        yield b"z" * 1_000_000  # 200 MB of a chunk header that never ends
    yield HOLD


ATTACKS = {
    "garbage-8mb": lambda s: [SSE_HEAD + FIVE_EVENTS + b"z" * 8_000_000 + b"\r\n", HOLD],
    "garbage-15kb": lambda s: [SSE_HEAD + FIVE_EVENTS + b"z" * 15_000 + b"\r\n", HOLD],
    "endless-line": endless_line,
    "gzip-bomb": lambda s: [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
                            b"connection: close\r\n\r\n" + gzip_bomb(1000 * 1000 * 1000, b"data: {}\n\n")],
    "bad-fields": lambda s: [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-odd: a\rb\x00c\r\n"
                             b"content-length: 2\r\n\r\n{}"],
    "ok": lambda s: [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"],
}


@pytest.fixture(scope="module")
def upstream() -> Iterator[HostileUpstream]:
    with HostileUpstream(ATTACKS) as u:
        yield u


@pytest.fixture
def relay(upstream, shared_relay):
    return shared_relay(f"reverse:{upstream.base_url}@0", relay_idle_timeout=5)


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1])


def raw_exchange(port: int, data: bytes, timeout: float = WAIT) -> bytes:
    """Send `data`, read until the relay closes or the stream's last chunk came."""
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 20):
            out += chunk
            if out.endswith(b"\r\n0\r\n\r\n"):
                break
        return out


def stream_request(attack: str, rid: str) -> bytes:
    body = json.dumps({"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    return (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nx-attack: {attack}\r\nx-request-id: {rid}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}").encode()


def error_event_message(answer: bytes) -> str:
    event = answer.rsplit(b"data: ", 1)[1].split(b"\n\n", 1)[0]
    return orjson.loads(event)["error"]["message"]


# --- an upstream's garbage (item 6) ------------------------------------------------------------


@pytest.mark.parametrize("attack", ["garbage-8mb", "garbage-15kb"])
def test_an_upstreams_garbage_is_cut_in_the_event_the_console_and_the_record_alike(attack, relay, rid):
    seen = len(relay.output)
    answer = raw_exchange(relay.port, stream_request(attack, rid))
    assert len(answer) < 4000  # five events and the error event (was: an 8 MB event)
    assert answer.count(b'"content":"hi') == 5
    message = error_event_message(answer)
    (rec,) = relay.log.of(rid)
    assert message == "ttft-relay: " + rec["error"]  # the same text in both
    assert len(rec["error"]) <= text.ERROR_MAX
    relay.wait_for_output(r"HTTP/1 protocol error")
    assert max(len(line) for line in relay.output[seen:]) < 2000  # the console (was one 8,000,067-character line)


def test_an_endless_chunk_header_is_refused_within_its_bound(relay, rid):
    before = rss_kib(relay.proc.pid)
    answer = raw_exchange(relay.port, stream_request("endless-line", rid))
    assert "chunk header or trailer section longer than 16384 bytes" in error_event_message(answer)
    assert rss_kib(relay.proc.pid) - before < 50_000  # was: the 200 MB it was sent, held
    assert relay.log.of(rid)[0]["error_phase"] == "stream"


def test_a_gzip_bomb_on_an_event_stream_is_decoded_no_further_than_64_mib(relay, rid):
    got = 0
    with socket.create_connection(("127.0.0.1", relay.port), WAIT) as s:
        s.sendall(stream_request("gzip-bomb", rid))
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    assert got <= 64 * 1024 * 1024 + 65536  # was: 1000 MB from 2.5 MB
    (rec,) = relay.log.of(rid)
    assert rec["error"] == "the upstream's compressed stream expands beyond 64 MiB when decoded"
    relay.wait_for_output(r"expands beyond 64 MiB when decoded; ending the stream")


# --- requests and answers that never pass as they are (item 8) --------------------------------


@pytest.mark.parametrize("line, field, status", [
    ("POST /v1/chat/completions HTTP/9.9", "", 505),
    ("POST /v1/chat/completions HTTP/1.1", "x-evil: a\rb", 400),
    ("POST /v1/chat/completions HTTP/1.1", "x-evil: a\x00b", 400),
])
def test_bare_cr_nul_and_unknown_versions_are_refused_on_the_head(line, field, status, relay, upstream, rid):
    before = len(upstream.sessions)
    head = "\r\n".join(x for x in (line, "Host: x", "x-attack: ok", f"x-request-id: {rid}", field,
                                   "content-type: application/json", "content-length: 2") if x)
    answer = raw_exchange(relay.port, head.encode() + b"\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 %d " % status)
    body = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["message"]  # the API's format
    assert len(upstream.sessions) == before  # nothing went upstream
    (rec,) = relay.log.of(rid)
    assert rec["error_phase"] == "relay" and rec["error"] == body["error"]["message"]


def test_an_answers_cr_and_nul_become_spaces(relay, rid):
    conn, response = client.request("POST", relay.url() + CHAT, {"model": "m"}, {"x-attack": "bad-fields",
                                                                                 "x-request-id": rid})
    with conn:
        assert response.status == 200 and response.header("x-odd") == "a b c"
    relay.log.of(rid)


def test_a_clients_malformed_chunk_size_gets_a_400(relay, upstream, rid):
    before = len(upstream.sessions)
    answer = raw_exchange(relay.port, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nx-request-id: {rid}\r\n"
                                      "transfer-encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 400 ") and b"illegal chunk header" in answer  # was: closed, no answer
    assert answer.count(b"HTTP/1.1 ") == 1
    assert len(upstream.sessions) == before
    assert relay.log.of(rid)[0]["error"].startswith("HTTP/1 protocol error: illegal chunk header")


def test_a_refused_brotli_bomb_is_recorded_as_the_relays_refusal(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    bomb = brotli.compress(b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "' + b" " * 100_000_000
                           + b'"}]}', quality=1)
    conn, response = client.request("POST", relay.url() + CHAT, bomb, {"content-type": "application/json",
                                                                       "content-encoding": "br", "x-request-id": rid})
    with conn:
        assert response.status == 413
    (rec,) = relay.log.of(rid)
    assert (rec["status"], rec["error_phase"]) == (413, "relay")  # was: upstream_wait, though nothing went upstream
    assert rec["error"] == "request body expands beyond 64 MiB when decompressed"


# --- out of descriptors (item 8) ---------------------------------------------------------------


def test_running_out_of_descriptors_is_one_warning_not_a_traceback_each_time(fake, start_relay, rid):
    relay = start_relay(reverse_to(fake), relay_max_connections=30)
    # The relay, limited to 160 descriptors, gets 300 streams at once: it serves 30, refuses
    # what it accepts beyond them, and accepts until the descriptors run out.
    subprocess.run(["prlimit", f"--pid={relay.proc.pid}", "--nofile=160:160"], check=True)
    client.request("POST", relay.url() + CHAT, {"model": "m"}, {"x-request-id": rid})[0].close()
    seen = len(relay.output)
    body = json.dumps({"model": "m", "stream": True, "messages": []})
    held = []
    try:
        for _ in range(300):
            try:
                s = socket.create_connection(("127.0.0.1", relay.port), 5)
            except OSError:
                break
            s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nx-fake-chunks: 30\r\nx-fake-gap-ms: 100\r\n"
                      f"content-length: {len(body)}\r\n\r\n{body}".encode())
            held.append(s)
        relay.wait_for_output(r"out of file descriptors, cannot accept connections")
    finally:
        for s in held:
            s.close()
    new = "\n".join(relay.output[seen:])
    assert "Traceback" not in new and new.count("Too many open files") == 1, new[-3000:]
    relay.log.of(rid)
