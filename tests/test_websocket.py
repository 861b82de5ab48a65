"""WebSocket turns: the pure parts, and the addon's hooks on mitmproxy's test flows."""

from __future__ import annotations

import orjson
import pytest
from mitmproxy import flow
from mitmproxy.test import taddons, tflow
from mitmproxy.websocket import WebSocketMessage
from wsproto.frame_protocol import Opcode

from ttft_relay import apis, state
from ttft_relay.apis import openai_responses
from ttft_relay.faults import addons as faults
from ttft_relay.stream import streaming, websocket
from ttft_relay.timing import addon as timing


class Records:
    """A sink on timing's `timing_record` hook."""

    def __init__(self) -> None:
        self.got: list[dict] = []

    def timing_record(self, record, flow) -> None:
        self.got.append(record.as_dict())


def responses_events(text_pieces=("Hel", "lo"), response_id="resp_1") -> list[dict]:
    created = {"type": "response.created", "response": {"id": response_id, "status": "in_progress"}}
    deltas = [{"type": "response.output_text.delta", "item_id": "msg_1", "delta": p} for p in text_pieces]
    done = {"type": "response.completed", "response": {"id": response_id, "status": "completed",
                                                        "usage": {"input_tokens": 12, "output_tokens": 2}}}
    return [created, {"type": "response.in_progress"}, *deltas, done]


@pytest.fixture
def relay():
    t = timing.Timing()
    deadlines = faults.Deadlines()
    turns = websocket.WebSocketTurns(t)
    sink = Records()
    with taddons.context(t, deadlines, turns, sink) as tctx:
        tctx.configure(t, relay_timing_log="", relay_timing_console=False)
        # No event loop here for the deadlines' timers: their bounds are tested end to end.
        tctx.configure(deadlines, relay_upstream_head_timeout=0, relay_first_token_timeout=0, relay_idle_timeout=0)
        yield turns, sink


def socket_flow(path="/v1/responses", api=apis.OPENAI_RESPONSES):
    f = tflow.twebsocketflow(messages=False)
    f.request.path = path
    state.attach(f, state.FlowState(api=apis.get(api), transport="websocket"))
    return f


def send(turns, flow, payload: dict | bytes, *, from_client: bool, at: float) -> WebSocketMessage:
    content = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    msg = WebSocketMessage(Opcode.TEXT, from_client, content, timestamp=at)
    flow.websocket.messages.append(msg)
    turns.websocket_message(flow)
    return msg


def test_parse_turn_request():
    assert openai_responses.parse_turn_request(b'{"type":"response.create","model":"gpt-5.1"}')["model"] == "gpt-5.1"
    assert openai_responses.parse_turn_request(b'{"type":"response.processed"}') is None
    assert openai_responses.parse_turn_request(b'{"type":"response.create",') is None  # not JSON: not ours
    assert openai_responses.turn_model({"type": "response.create", "response": {"model": "gpt-realtime"}}) == "gpt-realtime"


def test_each_turn_gets_one_record_with_its_own_marks_and_usage(relay):
    turns, sink = relay
    f = socket_flow()
    turns.websocket_start(f)
    t0 = 1000.0
    send(turns, f, {"type": "response.create", "model": "gpt-5.1-codex", "generate": False}, from_client=True, at=t0)
    send(turns, f, {"type": "response.created", "response": {"id": "resp_0"}}, from_client=False, at=t0 + 0.03)
    send(turns, f, {"type": "response.completed", "response": {"id": "resp_0", "usage": {}}},
         from_client=False, at=t0 + 0.04)
    t1 = 1010.0
    send(turns, f, {"type": "response.create", "model": "gpt-5.1-codex", "previous_response_id": "resp_0",
                    "input": [{"type": "message", "role": "user", "content": "hi"}]}, from_client=True, at=t1)
    for i, event in enumerate(responses_events()):
        send(turns, f, event, from_client=False, at=t1 + 0.05 + 0.01 * i)
    prewarm, turn = sink.got
    assert (prewarm["turn"], prewarm["prewarm"], prewarm["ttft_ms"]) == (1, True, None)
    assert prewarm["id"] == f"{f.id}#1" and prewarm["transport"] == "websocket" and prewarm["error"] is None
    assert (turn["turn"], turn["prewarm"], turn["model"], turn["api"]) == (2, False, "gpt-5.1-codex", "openai.responses")
    assert turn["ts"] == t1 and turn["marks"]["response_head"] == 50.0
    assert turn["ttft_ms"] == pytest.approx(70.0) and turn["phases"]["head_to_first_token"] == pytest.approx(20.0)
    assert turn["usage"] == {"input_tokens": 12, "output_tokens": 2}
    assert turn["error"] is None and turn["reused_connection"] is True
    lines = f.comment.split("\n")  # mitmweb: the socket's turns, newest first
    assert "(turn 2)" in lines[0] and lines[0].endswith(", ttft 70 ms.")
    assert "(turn 1 (prewarm))" in lines[1] and lines[1].endswith(", ttft -.")


def test_a_socket_closed_mid_turn_records_the_cut_turn(relay):
    turns, sink = relay
    f = socket_flow()
    turns.websocket_start(f)
    send(turns, f, {"type": "response.create", "model": "m"}, from_client=True, at=1.0)
    send(turns, f, responses_events()[0], from_client=False, at=1.1)
    f.websocket.close_code, f.websocket.closed_by_client = 1006, False
    turns.websocket_end(f)
    turns.websocket_end(f)  # once only
    (rec,) = sink.got
    assert rec["error"].startswith(websocket.CLOSED_EARLY) and "1006" in rec["error"]
    assert rec["error_phase"] == "head_to_first_token" and not rec["client_aborted"]


def test_an_upstream_error_event_ends_the_turn(relay):
    turns, sink = relay
    f = socket_flow()
    turns.websocket_start(f)
    send(turns, f, {"type": "response.create", "model": "m", "previous_response_id": "resp_gone"},
         from_client=True, at=1.0)
    send(turns, f, {"type": "error", "error": {"type": "invalid_request_error", "code": "previous_response_not_found",
                                               "message": "Previous response not found."}}, from_client=False, at=1.2)
    (rec,) = sink.got
    assert "previous_response_not_found" in rec["error"] or "Previous response" in rec["error"]


def test_realtime_turns_end_in_response_done_and_may_start_on_the_server(relay):
    turns, sink = relay
    f = socket_flow("/v1/realtime?model=gpt-realtime", apis.OPENAI_REALTIME)
    turns.websocket_start(f)
    send(turns, f, {"type": "session.created", "session": {}}, from_client=False, at=0.5)
    send(turns, f, {"type": "response.created", "response": {"id": "resp_r"}}, from_client=False, at=1.0)
    send(turns, f, {"type": "response.output_audio_transcript.delta", "delta": "Hi"}, from_client=False, at=1.2)
    send(turns, f, {"type": "response.done", "response": {"status": "completed",
                                                          "usage": {"input_tokens": 3, "output_tokens": 1}}},
         from_client=False, at=1.3)
    (rec,) = sink.got
    assert rec["api"] == "openai.realtime" and rec["ttft_ms"] == pytest.approx(200.0)
    assert rec["usage"] == {"input_tokens": 3, "output_tokens": 1}


def test_other_sockets_and_binary_messages_are_only_passed(relay):
    turns, sink = relay
    f = socket_flow("/v1/other", apis.OTHER)
    turns.websocket_start(f)
    send(turns, f, {"type": "response.create"}, from_client=True, at=1.0)
    g = socket_flow()
    turns.websocket_start(g)
    g.websocket.messages.append(WebSocketMessage(Opcode.BINARY, True, b"\x00\x01", timestamp=1.0))
    turns.websocket_message(g)
    turns.websocket_end(f)
    turns.websocket_end(g)
    assert sink.got == []


def test_only_the_newest_messages_are_kept(relay):
    turns, sink = relay
    with taddons.context(turns) as tctx:
        tctx.configure(turns, relay_websocket_messages=3)
        f = socket_flow()
        turns.websocket_start(f)
        sent = [send(turns, f, {"type": "response.create", "model": "m", "n": i}, from_client=True, at=float(i))
                for i in range(10)]
        assert f.websocket.messages == sent[-3:]


def test_older_messages_are_kept_within_the_view_bytes(relay):
    turns, sink = relay
    with taddons.context(turns, streaming.Streaming()) as tctx:  # the view's bound is Streaming's option
        tctx.configure(turns, relay_websocket_messages=100, relay_stream_view_max="1k")
        f = socket_flow()
        turns.websocket_start(f)
        big = [send(turns, f, b"x" * 600, from_client=True, at=float(i)) for i in range(5)]
        assert f.websocket.messages == big[-1:]  # two would hold 1200 bytes: the newest alone stays
        small = [send(turns, f, b"y" * 300, from_client=True, at=10.0 + i) for i in range(5)]
        assert f.websocket.messages == small[-3:]


def test_a_message_refused_by_the_bounds_gets_a_record_that_says_so(relay, monkeypatch):
    turns, sink = relay
    f = socket_flow()
    f.request.headers["x-request-id"] = "r"
    turns.websocket_start(f)
    reason = "ttft-relay: message over 1 MiB (relay_websocket_message_max) from the client"
    monkeypatch.setattr(websocket.websocket_limits, "_refused", {f.client_conn: "client"})
    f.websocket.close_code, f.websocket.close_reason, f.websocket.closed_by_client = 1009, reason, True
    turns.websocket_end(f)
    (rec,) = sink.got
    assert (rec["turn"], rec["error"], rec["error_phase"], rec["client_aborted"]) == (1, reason, "relay", False)


def test_a_slow_turn_marks_its_socket_and_a_slow_prewarm_does_not(relay):
    turns, sink = relay
    turns.timing.slow_ms = 500
    f = socket_flow()
    turns.websocket_start(f)
    send(turns, f, {"type": "response.create", "model": "m", "generate": False}, from_client=True, at=1000.0)
    send(turns, f, {"type": "response.completed", "response": {"id": "r0", "usage": {}}}, from_client=False, at=1002.0)
    assert not f.marked
    send(turns, f, {"type": "response.create", "model": "m"}, from_client=True, at=1010.0)
    for i, event in enumerate(responses_events()):
        send(turns, f, event, from_client=False, at=1010.6 + 0.01 * i)
    assert f.marked == timing.SLOW_MARKER
    first = f.comment.split("\n")[0]
    assert "(turn 2, SLOW)" in first and first.endswith(", ttft 620 ms.")  # the first delta is the third event


@pytest.mark.parametrize("closed_by_client, code, open_s, error, refused", [
    (False, 1011, 60.0, None, True),  # an error code, however late
    (False, 1000, 0.2, None, True),  # a normal close right after the 101, before the turn the client sent
    (False, 1000, 60.0, None, False),  # an idle socket closed normally
    (True, 1000, 0.2, None, False),  # the client left
    (None, None, 0.2, "Connection reset by peer", True),  # the upstream's side broke
    (None, None, 0.2, "Client disconnected.", False),
])
def test_which_upstream_closes_refused_the_session(closed_by_client, code, open_s, error, refused):
    f = socket_flow()
    f.websocket.closed_by_client, f.websocket.close_code = closed_by_client, code
    f.error = flow.Error(error) if error else None
    assert websocket.refused_session(f, open_s) is refused
