"""The coding-agent fakes do what they claim: Responses over WebSocket, thinking blocks, the refusing proxy.

Timing checks are lower bounds only (a sleep never ends early).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from ttft_relay.testing.fakes import FakeUpstream
from ttft_relay.testing.fakes.client import WebSocketClient, WebSocketRefused, request
from ttft_relay.testing.fakes.refusing_proxy import RefusingProxy
from ttft_relay.testing.fakes.replies import THINKING_PIECES, answer_text

DELAY_SLACK = 0.9  # lower-bound checks allow for timer granularity


def ws_url(fake: FakeUpstream) -> str:
    return f"ws://127.0.0.1:{fake.port}/v1/responses"


def text_of(events: list[tuple[float, dict]]) -> str:
    return "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta")


# --- Responses over WebSocket ------------------------------------------------------


def test_a_turn_streams_the_responses_events_as_text_messages(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake)) as ws:
        events = ws.turn({"model": "gpt-test", "input": [{"role": "user", "content": "hi"}]})
    kinds = [e["type"] for _, e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert text_of(events) == answer_text(5)
    completed = events[-1][1]["response"]
    assert completed["model"] == "gpt-test" and completed["usage"]["output_tokens"] == 5
    assert fake.wait_finished(1)
    (session,) = fake.sockets
    assert session.status == 101 and fake.sent[0].status == 101
    assert [m["type"] for m in session.response_creates] == ["response.create"]
    (turn,) = session.turns
    assert turn.outcome == "complete" and turn.events == kinds
    assert turn.first_token_at is not None and turn.at <= turn.first_token_at
    assert session.close_code == 1000


def test_permessage_deflate_is_agreed_when_offered_and_not_otherwise(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake)) as ws:
        assert [ext.name for ext in ws.accepted.extensions] == ["permessage-deflate"]
        assert text_of(ws.turn({"model": "m"})) == answer_text(5)
    with WebSocketClient(ws_url(fake), deflate=False) as ws:
        assert ws.accepted.extensions == []
        assert text_of(ws.turn({"model": "m"})) == answer_text(5)
    assert fake.wait_finished(2)
    assert fake.sockets[0].extensions.startswith("permessage-deflate")
    assert fake.sockets[1].extensions is None


def test_prewarm_then_a_turn_continuing_from_it(fake: FakeUpstream) -> None:
    """Codex's sequence: `generate: false` creates an empty response, the real turn names it."""
    with WebSocketClient(ws_url(fake)) as ws:
        prewarm = ws.turn({"model": "m", "generate": False, "input": []})
        prewarm_id = prewarm[-1][1]["response"]["id"]
        assert text_of(prewarm) == "" and prewarm[-1][1]["response"]["output"] == []
        turn = ws.turn({"model": "m", "previous_response_id": prewarm_id, "input": []})
        assert text_of(turn) == answer_text(5)
        assert turn[-1][1]["response"]["id"] != prewarm_id
    (session,) = fake.sockets
    assert [t.prewarm for t in session.turns] == [True, False]
    assert session.turns[0].first_token_at is None


def test_an_unknown_previous_response_id_is_the_apis_error_event(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake)) as ws:
        (event,) = ws.turn({"model": "m", "previous_response_id": "resp_nope"})
    assert event[1]["type"] == "error" and event[1]["error"]["code"] == "previous_response_not_found"
    assert fake.wait_socket_turns(1) and fake.sockets[0].turns[0].outcome == "error"


def test_prefill_goes_before_the_first_text_delta(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake), {"x-fake-prefill-ms": "200"}) as ws:
        start = time.time()
        events = ws.turn({"model": "m"})
    first_text = next(at for at, e in events if e["type"] == "response.output_text.delta")
    assert events[0][0] - start < first_text - start
    assert first_text - start >= 0.2 * DELAY_SLACK
    assert fake.sockets[0].turns[0].first_token_at - fake.sockets[0].turns[0].at >= 0.2 * DELAY_SLACK


def test_status_knob_refuses_the_upgrade_with_a_json_error(fake: FakeUpstream) -> None:
    with pytest.raises(WebSocketRefused) as refused:
        WebSocketClient(ws_url(fake), {"x-fake-status": "426"})
    assert refused.value.status == 426
    assert "error" in json.loads(refused.value.body)
    assert fake.wait_finished(1) and fake.sockets[0].status == 426 and fake.sockets[0].turns == []


def test_reset_after_chunks_cuts_the_socket_mid_turn(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake), {"x-fake-reset-after-chunks": "3"}) as ws:
        ws.send_json({"type": "response.create", "model": "m"})
        received = []
        with pytest.raises(ConnectionError):
            while True:
                received.append(ws.receive_json()[1]["type"])
    assert len(received) == 3
    assert fake.wait_finished(1) and fake.sent[0].outcome == "reset"
    assert fake.sockets[0].turns[0].outcome == "reset"


def test_stall_holds_a_turn_until_released(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake), {"x-fake-stall-after-chunks": "2"}) as ws:
        ws.send_json({"type": "response.create", "model": "m"})
        assert [ws.receive_json()[1]["type"] for _ in range(2)] == ["response.created", "response.in_progress"]
        ws.sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            ws.receive_json()
        ws.sock.settimeout(10)
        fake.release_stalls()
        while ws.receive_json()[1]["type"] != "response.completed":
            pass
    assert fake.wait_socket_turns(1) and fake.sockets[0].turns[0].outcome == "complete"


def test_client_going_away_mid_turn_is_noticed(fake: FakeUpstream) -> None:
    fake.behaviour.stall_after_chunks = 1
    ws = WebSocketClient(ws_url(fake))
    ws.send_json({"type": "response.create", "model": "m"})
    ws.receive_json()
    ws.sock.close()
    assert fake.wait_finished(1)
    assert fake.sent[0].outcome == "client_closed" and fake.sockets[0].turns[0].outcome == "client_closed"
    assert fake.wait_connections(0)


def test_other_messages_are_recorded_and_not_answered(fake: FakeUpstream) -> None:
    with WebSocketClient(ws_url(fake)) as ws:
        ws.send_json({"type": "response.processed", "response_id": "resp_x"})
        assert text_of(ws.turn({"model": "m"})) == answer_text(5)
    assert [m["type"] for m in fake.sockets[0].messages] == ["response.processed", "response.create"]


def test_frames_that_are_not_websocket_are_recorded_as_a_protocol_error(fake: FakeUpstream) -> None:
    ws = WebSocketClient(ws_url(fake))
    ws.sock.sendall(b"0\r\n\r\n")  # what a proxy that chunk-frames an upgraded connection writes
    assert fake.wait_finished(1)
    ws.sock.close()
    assert fake.sent[0].outcome == "protocol_error" and fake.sockets[0].protocol_error


# --- Anthropic thinking, HTTP first-token time ------------------------------------------


def test_a_thinking_request_gets_a_thinking_block_and_the_prefill_before_it(fake: FakeUpstream) -> None:
    body = {"model": "claude-test", "stream": True, "thinking": {"type": "adaptive"},
            "messages": [{"role": "user", "content": "hi"}]}
    start = time.time()
    connection, response = request("POST", fake.base_url + "/v1/messages?beta=true", body, {"x-fake-prefill-ms": "150"})
    with connection:
        text = response.read().decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert [d["thinking"] for d in deltas if d["type"] == "thinking_delta"] == list(THINKING_PIECES)
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == answer_text(5)
    (sent,) = fake.sent
    assert sent.first_token_at - start >= 0.15 * DELAY_SLACK


def test_without_thinking_there_is_no_thinking_block(fake: FakeUpstream) -> None:
    connection, response = request("POST", fake.base_url + "/v1/messages", {"model": "c", "stream": True})
    with connection:
        assert b"thinking" not in response.read()


# --- refusing proxy ------------------------------------------------------------------------


def test_the_refusing_proxy_answers_403_at_once_and_notes_the_target() -> None:
    with RefusingProxy() as proxy:
        connection, response = request("GET", "http://telemetry.example/v1/x", proxy=proxy.url)
        with connection:
            assert response.status == 403
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(b"CONNECT api.example:443 HTTP/1.1\r\nHost: api.example:443\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 403")
        assert proxy.refused == ["GET http://telemetry.example/v1/x", "CONNECT api.example:443"]

