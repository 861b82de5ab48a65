"""End to end: a Responses WebSocket (Codex CLI's transport) through a real mitmdump with the
relay, against the fake upstream's WebSocket. The upgrade passes untouched, every message
arrives whole in both directions, the upstream sees each `response.create` once, and each
turn gets one record whose first token matches the upstream's injected prefill.

The cases share a relay per option set (`shared_relay`) and find their records by the
handshake's `x-request-id` (`rid`), which every record of its socket carries."""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

import openai
import pytest
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import LocalProtocolError

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes.ws_client import HandshakeRefused, WebSocketClient
from ttft_relay.testing.harness import read_records

pytestmark = pytest.mark.shared_fake
WAIT = 20
PREFILL_MS = 200


def turn(client: WebSocketClient, body: dict) -> tuple[float, list[dict]]:
    """Send one `response.create`; the events up to its terminal one, and when it was sent."""
    sent = client.send_text(json.dumps({"type": "response.create", **body}))
    events = []
    while (msg := client.receive(WAIT)) is not None:
        events.append({**json.loads(msg.text), "_at": msg.at})
        if events[-1]["type"] in ("response.completed", "response.failed", "response.incomplete", "error"):
            break
    return sent, events


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def ws_url(relay) -> str:
    return relay.url().replace("http://", "ws://") + "/v1/responses"


HEADERS = {"authorization": f"Bearer {FAKE_OPENAI_KEY}", "openai-beta": "responses_websockets=2026-02-06",
           "x-fake-prefill-ms": str(PREFILL_MS)}


@pytest.mark.parametrize("mode", ["reverse", "regular"])
def test_a_codex_like_session_passes_whole_and_each_turn_is_recorded(mode, fake, fake_tls, shared_relay, rid):
    headers = {**HEADERS, "x-request-id": rid}
    if mode == "reverse":
        upstream, relay = fake, shared_relay(reverse_to(fake))
        client = WebSocketClient(ws_url(relay), headers=headers)
    else:
        upstream, relay = fake_tls, shared_relay("regular@0")
        client = WebSocketClient(fake_tls.base_url.replace("https://", "wss://") + "/v1/responses",
                                 headers=headers, proxy=relay.url(), ca=relay.ca_pem)
    # Tokenizers load in the background after start and hold the GIL while they do (a cold
    # start the relay still has): the turns below measure a relay that is up.
    relay.wait_for_output(r"tokenizer")
    with client:
        assert client.accepted is not None
        assert any(isinstance(e, PerMessageDeflate) for e in client.accepted.extensions)  # compressed frames
        _, prewarm = turn(client, {"model": "gpt-5.1-codex", "generate": False, "input": []})
        previous = prewarm[-1]["response"]["id"]
        sent, events = turn(client, {"model": "gpt-5.1-codex", "previous_response_id": previous,
                                     "input": [{"type": "message", "role": "user", "content": "Say hello"}]})
        assert events[-1]["type"] == "response.completed" and text_of(events)

    (session,) = upstream.sockets  # one socket: no reconnect, no fallback
    assert [t.request.get("generate", True) for t in session.turns] == [False, True]  # each turn exactly once
    assert [t.outcome for t in session.turns] == ["complete", "complete"]
    handshake, first, second = sorted(relay.log.of(rid, 3), key=lambda r: r["turn"])
    assert (handshake["turn"], handshake["status"], handshake["ttft_ms"], handshake["error"]) == (0, 101, None, None)
    assert handshake["transport"] == first["transport"] == second["transport"] == "websocket"
    assert handshake["upstream_request_id"] == session.header("x-request-id") or handshake["upstream_request_id"]
    assert (first["prewarm"], first["ttft_ms"]) == (True, None)
    assert (second["prewarm"], second["model"], second["api"]) == (False, "gpt-5.1-codex", "openai.responses")
    assert second["error"] is None and second["usage"]["output_tokens"] > 0
    # Each turn has its socket's link figures (loopback: microseconds, nothing lost).
    assert all(r["client_min_rtt_ms"] is not None and r["client_retransmits"] == 0 for r in (first, second)), second
    assert all(r["upstream_tcp_rtt_ms"] is not None and r["loop_lag_ms"] is not None for r in (first, second))
    # The first token as the relay timed it is the prefill the upstream injected, as it happened
    # (±10 % or ±5 ms; on a busy machine the fake's own sleep runs late), and no more than the
    # client's own wait.
    upstream_turn = session.turns[1]
    injected_ms = (upstream_turn.first_token_at - upstream_turn.at) * 1000
    assert injected_ms >= PREFILL_MS
    assert abs(second["ttft_ms"] - injected_ms) <= max(0.1 * injected_ms, 5), (injected_ms, second["phases"])
    client_ms = (next(e["_at"] for e in events if e["type"] == "response.output_text.delta") - sent) * 1000
    assert second["ttft_ms"] <= client_ms + 1
    assert second["marks"]["response_head"] < second["marks"]["first_token"]


def test_a_refused_handshake_is_recorded_as_a_failing_websocket(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    with pytest.raises(HandshakeRefused) as refused:
        WebSocketClient(ws_url(relay), headers={**HEADERS, "x-fake-status": "404", "x-request-id": rid})
    assert refused.value.status == 404 and b"error" in refused.value.body  # the upstream's answer, unchanged
    (rec,) = relay.log.of(rid)
    assert (rec["turn"], rec["status"], rec["transport"]) == (0, 404, "websocket")
    assert rec["verdict"].startswith("websocket handshake failed")


def test_a_hung_handshake_is_recorded_with_the_time_it_cost(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    started = time.time()
    with pytest.raises(OSError):  # TimeoutError: the client gives up, as Codex does after 15 s
        WebSocketClient(ws_url(relay), headers={**HEADERS, "x-fake-head-delay-ms": "30000", "x-request-id": rid},
                        timeout=1.0)
    waited_ms = (time.time() - started) * 1000
    (rec,) = relay.log.of(rid)
    assert rec["client_aborted"] and rec["verdict"] == "websocket handshake failed: client aborted in upstream wait"
    # The second the client waited, less however late a busy relay read the head: all of it
    # in the phase the handshake was in.
    assert 500 <= rec["phases"]["total"] <= waited_ms + 1000, rec["marks"]
    assert rec["phases"]["upstream_wait"] >= 0.9 * rec["phases"]["total"], rec["phases"]


def test_a_turn_past_its_first_token_deadline_ends_with_response_failed(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), relay_first_token_timeout=1)
    with WebSocketClient(ws_url(relay), headers={**HEADERS, "x-fake-prefill-ms": "20000", "x-request-id": rid}) as client:
        _, events = turn(client, {"model": "gpt-5.1-codex", "input": [{"type": "message", "role": "user",
                                                                       "content": "hi"}]})
        assert events[-1]["type"] == "response.failed"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "first token timeout after 1 s" in failed["error"]["message"]
        assert failed["id"] == events[0]["response"]["id"]  # the response the client was waiting on
        assert client.receive(WAIT) is None and client.closed is not None  # then the socket ends
    turns = [r for r in relay.log.of(rid, 2) if r["turn"]]
    assert [(r["turn"], r["error"]) for r in turns] == [(1, "first token timeout after 1 s")]
    assert turns[0]["verdict"] == "error in head to first token"


def test_a_turn_in_flight_when_the_relay_stops_is_recorded(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake))
    with WebSocketClient(ws_url(relay), headers={**HEADERS, "x-fake-prefill-ms": "20000"}) as client:
        client.send_text(json.dumps({"type": "response.create", "model": "gpt-5.1-codex", "input": []}))
        assert client.receive(WAIT) is not None  # response.created: the turn is under way
        relay.stop()
    turns = [r for r in read_records(tmp_path / "timing.jsonl") if r["turn"]]
    assert [(r["turn"], r["error"]) for r in turns] == [(1, "relay shutting down")]


def test_the_openai_sdks_websocket_client(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    sdk = openai.OpenAI(base_url=relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0,
                        default_headers={"x-request-id": rid})
    with sdk, sdk.responses.connect(max_retries=0) as conn:
        conn.response.create(model="gpt-5.1-codex", input="Say hello")
        text = ""
        for event in conn:
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.failed", "error"):
                break
    assert event.type == "response.completed" and text
    (session,) = fake.sockets
    assert len(session.turns) == 1
    turns = [r for r in relay.log.of(rid, 2) if r["turn"]]
    assert [(r["turn"], r["error"], r["model"]) for r in turns] == [(1, None, "gpt-5.1-codex")]
    assert turns[0]["ttft_ms"] is not None


def test_an_upstream_that_closes_the_socket_it_accepted_fails_the_turn_the_client_sent(fake, shared_relay, rid):
    # An upstream that takes the upgrade and closes the socket at once (1011): Codex has sent its
    # first response.create (12 KB of context) by then, and gets no answer to it.
    relay = shared_relay(reverse_to(fake))
    create = {"type": "response.create", "model": "gpt-5.1-codex",
              "input": [{"type": "message", "role": "user", "content": "x" * 12_000}]}
    with WebSocketClient(ws_url(relay), headers={**HEADERS, "x-fake-close-after-accept": "1011",
                                                 "x-request-id": rid}) as client:
        try:
            client.send_text(json.dumps(create))
        except LocalProtocolError:  # the close came with the 101: too soon even to send the turn
            pass
        assert client.receive(WAIT) is None and client.closed is not None  # closed, never answered
    handshake, failed = relay.log.of(rid, 2)
    assert (handshake["turn"], handshake["status"], handshake["error"]) == (0, 101, None)
    assert failed["turn"] == 1 and "close code 1011" in failed["error"] and not failed["client_aborted"], failed
    assert failed["verdict"] == "error in upstream wait", failed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts segments with Linux's TCP_INFO")
def test_a_refused_upgrade_reaches_the_client_in_one_write(fake, shared_relay, rid):
    # Codex reads a refused upgrade's answer once: a head without its body reads as "Unknown
    # error" instead of the upstream's text. On loopback one write is one segment.
    relay = shared_relay(reverse_to(fake))
    with socket.create_connection(("127.0.0.1", relay.port), timeout=WAIT) as sock:
        sock.sendall(("GET /v1/responses HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                      "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
                      f"x-fake-status: 404\r\nx-request-id: {rid}\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < content_length(answer):
            answer += sock.recv(65536)
        segments = struct.unpack_from("=I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 160), 152)[0]
    assert answer.startswith(b"HTTP/1.1 404") and b"refused the WebSocket" in answer
    assert segments == 1, f"the answer came in {segments} segments"
    relay.log.of(rid)


def content_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    return next(int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:"))
