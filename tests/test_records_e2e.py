"""Records that match what the client saw, and text outputs nobody can forge,
through a real mitmdump.

Tests that need nothing but a plain relay share the module's (`shared_relay`, `shared_fake`)
and find their records by `rid`; those with options, or reading the relay's whole output or
log once it stopped, start their own.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import orjson
import pytest
from mitmproxy.test import tflow

from ttft_relay import apis, state
from ttft_relay.faults import addons as faults

from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import REPO, MitmdumpProcess, read_records
from tests.test_faults_e2e import TIMEOUTS_1S, WAIT
from tests.test_preauth_e2e import raw, read_until_closed


pytestmark = pytest.mark.shared_fake


def chat_body(stream: bool) -> dict:
    return {"model": "gpt-4o-mini", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("knob, status", [("x-fake-reset-after-chunks", 502)])
def test_a_buffered_body_that_fails_records_the_status_the_client_got(knob, status, fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), **TIMEOUTS_1S)
    # Not streamed, with a length: the relay holds the head until the body is in, so the
    # client gets the relay's error, not the upstream's 200.
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", chat_body(stream=False),
                                {knob: "0"}, timeout=WAIT)
    with conn:
        assert resp.status == status
    fake.release_stalls()
    relay.stop()
    (rec,) = read_records(tmp_path / "timing.jsonl")
    assert rec["status"] == status and rec["error"]


def test_a_request_refused_by_header_validation_names_its_upstream(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    with raw(relay) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: %s\r\ncontent-length: 2\r\n"
                  b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n" % rid.encode())
        assert read_until_closed(s).startswith(b"HTTP/1.1 400")
    (rec,) = relay.log.of(rid)
    assert rec["upstream"] == fake.base_url.removeprefix("http://")


FORGED = "gpt-4o\n127.0.0.1:1 openai.chat gpt-4o 200 ttft 1 ms [] → all fine\x1b[2J"


def test_control_characters_in_a_model_cannot_forge_a_console_or_report_line(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake))
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions",
                                {"model": FORGED, "messages": [{"role": "user", "content": "hi"}]}, timeout=WAIT)
    with conn:
        resp.read()
    out = relay.stop()
    assert "→ all fine" not in [line.split("] ", 1)[-1] for line in out.splitlines()]
    assert "\x1b" not in out and "\\n127.0.0.1:1" in out
    (rec,) = read_records(tmp_path / "timing.jsonl")
    assert rec["model"] == FORGED  # the JSON record keeps the value, escaped by JSON itself
    report = subprocess.run([sys.executable, "-m", "ttft_relay", "report", str(tmp_path / "timing.jsonl")],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "\x1b" not in report and "\n127.0.0.1:1 openai.chat" not in report


def test_an_unwritable_log_path_stops_start_up_with_one_line(confdir, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    relay = MitmdumpProcess(["reverse:http://127.0.0.1:9@0"], confdir,
                            options={"relay_timing_log": blocker / "timing.jsonl"})
    with pytest.raises(RuntimeError) as failed:
        relay.start()
    out = str(failed.value)
    assert "Traceback" not in out
    assert "relay_timing_log" in out and str(blocker / "timing.jsonl") in out
    assert relay.proc.returncode not in (None, 0)


def test_a_chunked_request_with_trailers_is_answered_at_once(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    body = orjson.dumps(chat_body(stream=True))
    with raw(relay) as s:
        s.settimeout(5)  # mitmproxy would leave it hanging for 30 s
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: %s\r\n" % rid.encode()
                  + b"transfer-encoding: chunked\r\n"
                  b"content-type: application/json\r\ntrailer: x-checksum\r\n\r\n"
                  + b"%x\r\n%s\r\n0\r\nx-checksum: abc\r\n\r\n" % (len(body), body))
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 501"), answer[:300]
    assert b"trailers" in answer
    (rec,) = relay.log.of(rid)
    assert "trailers" in rec["error"] and rec["error_phase"] == "relay"


def test_a_client_that_pauses_reading_is_not_blamed_on_the_stream(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), termlog_verbosity="debug", **TIMEOUTS_1S)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(WAIT)
    s.connect(("127.0.0.1", relay.port))
    body = orjson.dumps(chat_body(stream=True))
    with s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"x-fake-chunks: 12000\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        # Not reading: the relay's buffers towards this client fill, and it stops
        # reading from the upstream. That silence is the client's.
        relay.wait_for_output(r"client not reading; idle deadline deferred", timeout=WAIT)
        received = read_until_closed_or_done(s)
    assert b"data: [DONE]" in received and b"stream idle" not in received
    relay.stop()
    (rec,) = read_records(tmp_path / "timing.jsonl")
    assert rec["error"] is None


def read_until_closed_or_done(s: socket.socket) -> bytes:
    out = b""
    while not out.endswith(b"\r\n0\r\n\r\n") and (data := s.recv(1 << 20)):  # the last chunk, not a head
        out += data
    return out


def test_http2_siblings_cut_by_a_relay_timeout_are_named_as_the_relays(monkeypatch):
    # An HTTP/2 upstream connection carries several flows; a deadline of one closes it.
    deadlines = faults.Deadlines()
    shared = tflow.tflow().server_conn
    flows = []
    for _ in range(3):
        f = tflow.tflow()
        f.server_conn = shared
        state.attach(f, state.FlowState(api=apis.get(apis.OPENAI_CHAT), stream=True))
        deadlines.timers[f] = (0.0, None)
        flows.append(f)
    closed = []
    monkeypatch.setattr(faults, "close_upstream", lambda flow, reason: closed.append(flow) or True)
    timed_out, *siblings = flows
    deadlines._fail(timed_out, state.get(timed_out), "stream idle for 1 s")
    assert closed == [timed_out] and state.get(timed_out).error == "stream idle for 1 s"
    for f in siblings:
        st = state.get(f)
        assert st.error.startswith("the relay closed the shared upstream connection: stream idle for 1 s")
        assert st.error_phase == "relay"


def test_a_request_id_that_is_not_utf8_still_gets_its_record(fake, shared_relay):
    """mitmproxy keeps a header's non-UTF-8 bytes as surrogates, which JSON cannot carry:
    the record was dropped (an addon error); it is written with U+FFFD in their place."""
    relay = shared_relay(reverse_to(fake))
    body = orjson.dumps({"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: r\xff1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
    with raw(relay) as s:
        s.sendall(head + body)
        assert read_until_closed(s).startswith(b"HTTP/1.1 200")
    (rec,) = relay.log.of("r\ufffd1")  # no other test's request id
    assert rec["status"] == 200 and rec["error"] is None
