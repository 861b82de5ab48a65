"""Unit tests of ttft_relay/faults/addons.py: the API error formats, the deadline rules, timers that
never outlive their flow, and the rendering the seam asks for."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from mitmproxy.test import taddons, tflow

from ttft_relay import apis, state
from ttft_relay.faults import addons as faults
from ttft_relay.faults import apierrors
from ttft_relay.stream import sse

APIS = [apis.OPENAI_CHAT, apis.OPENAI_RESPONSES, apis.ANTHROPIC_MESSAGES, apis.GEMINI, apis.OTHER]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("status", [502, 504])
def test_error_reply_is_the_apis_json(api, status):
    reply = faults.error_reply(apis.get(api), status, "ttft-relay: boom")
    assert reply.status_code == status
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers[faults.ERROR_HEADER] == apierrors.error_code(status)
    body = orjson.loads(reply.content)
    if api == apis.ANTHROPIC_MESSAGES:
        assert body == {"type": "error", "error": {"type": "timeout_error" if status == 504 else "api_error",
                                                   "message": "ttft-relay: boom"}}
    elif api == apis.GEMINI:
        assert body["error"]["code"] == status and body["error"]["message"] == "ttft-relay: boom"
    else:
        assert body == {"error": {"message": "ttft-relay: boom", "type": "server_error", "param": None,
                                  "code": apierrors.error_code(status)}}


@pytest.mark.parametrize("api", APIS)
def test_error_event_is_one_event_the_relays_own_watcher_reads_as_an_error(api):
    event = apierrors.error_event(apis.get(api), 502, "ttft-relay: cut")
    events = sse.SSEParser().feed(event)
    assert len(events) == 1 and event.endswith(b"\n\n")
    watcher = sse.StreamWatcher(apis.get(api))
    watcher.feed(event, 1.0)
    assert "ttft-relay: cut" in (watcher.error or "")


def test_an_event_is_appended_only_at_an_event_boundary_of_a_plain_event_stream():
    from mitmproxy import http

    w = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
    resp = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    del resp.headers["content-length"]
    assert faults.can_append_event(resp, w)
    w.feed(b'data: {"choi', 1.0)
    assert not faults.can_append_event(resp, w)
    w.feed(b'ces": []}\n\n', 1.1)
    assert faults.can_append_event(resp, w)
    for headers in ({"content-type": "application/json"}, {"content-type": "text/event-stream", "content-length": "9"},
                    {"content-type": "text/event-stream", "content-encoding": "br"}):
        resp = http.Response.make(200, b"", headers)
        if "content-length" not in headers:
            del resp.headers["content-length"]
        assert not faults.can_append_event(resp, w)


LIMITS = faults.Limits(head=600, first_token=300, idle=120)


@pytest.mark.parametrize(
    "progress, now, expected",
    [
        # waiting for the head: the head and first-token bounds, the earlier wins
        (faults.Progress(started=0, streamed=True), 1, (300, "first token timeout after 300 s")),
        (faults.Progress(started=0, streamed=False), 1, (600, "no response head after 600 s")),
        # head arrived, no token yet: first-token bound, checked every `idle` seconds meanwhile
        (faults.Progress(started=0, streamed=True, head=5, last_chunk=6), 100, (220, None)),
        (faults.Progress(started=0, streamed=True, head=5, last_chunk=6), 250, (300, "first token timeout after 300 s")),
        # tokens flowing: idle from the last chunk
        (faults.Progress(started=0, streamed=True, head=5, first_token=10, last_chunk=50), 60, (170, "stream idle for 120 s")),
        # a non-streamed body: idle from the head or last chunk
        (faults.Progress(started=0, streamed=False, head=5), 6, (125, "stream idle for 120 s")),
    ],
)
def test_next_deadline(progress, now, expected):
    assert faults.next_deadline(progress, LIMITS, now) == expected


def test_no_bounds_no_deadline():
    assert faults.next_deadline(faults.Progress(started=0, streamed=True), faults.Limits(), 1) is None


def in_scope_flow(api=apis.OPENAI_CHAT, stream=True, resp=False):
    f = tflow.tflow(resp=resp)
    state.attach(f, state.FlowState(api=apis.get(api), stream=stream))
    return f


def test_deadline_timers_end_with_their_flow():
    async def run():
        addon = faults.Deadlines()
        with taddons.context(addon) as tctx:
            tctx.configure(addon, relay_upstream_head_timeout=5, relay_first_token_timeout=5, relay_idle_timeout=5)
            flows = [in_scope_flow() for _ in range(3)]
            for f in flows:
                addon.request(f)
            assert len(addon.timers) == 3
            addon.response(flows[0])
            addon.error(flows[1])
            addon.responseheaders(flows[2])  # rescheduled, still one timer
            assert len(addon.timers) == 1
            addon.response(flows[2])
            assert addon.timers == {}
            # out of scope: never timed
            addon.request(tflow.tflow())
            assert addon.timers == {}

    asyncio.run(run())


def test_a_passed_deadline_fails_the_flow_with_its_cause():
    async def run():
        addon = faults.Deadlines()
        with taddons.context(addon) as tctx:
            tctx.configure(addon, relay_first_token_timeout=1)
            f = in_scope_flow()
            addon.request(f)
            _, timer = addon.timers[f]
            timer.cancel()
            addon._check(f, started=0.0)  # long past
            st = state.get(f)
            assert st.error == "first token timeout after 1 s" and st.error_status == 504
            assert addon.timers == {}
            assert not f.live or f.error is not None  # no connection handler here: the flow is killed

    asyncio.run(run())


def test_render_uses_the_relays_cause_and_status():
    replies = faults.ErrorReplies()
    f = in_scope_flow(api=apis.ANTHROPIC_MESSAGES)
    st = state.get(f)
    st.record_error("first token timeout after 1 s", status=504)
    response, body = replies.render(f, "Server disconnected.", head_sent=False)
    assert response.status_code == 504
    assert orjson.loads(body)["error"] == {"type": "timeout_error", "message": "ttft-relay: first token timeout after 1 s"}
    assert replies.render(tflow.tflow(), "x", head_sent=False) is None  # out of scope: mitmproxy's own


def test_render_after_the_head_only_for_event_streams():
    replies = faults.ErrorReplies()
    f = in_scope_flow(resp=True)
    f.response.headers["content-type"] = "text/event-stream"
    del f.response.headers["content-length"]
    state.get(f).watcher = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
    response, body = replies.render(f, "peer reset", head_sent=True)
    assert response is None and body.startswith(b"data: {\"error\"")
    f.response.headers["content-type"] = "application/json"
    assert replies.render(f, "peer reset", head_sent=True) is None  # a JSON body is cut, not corrupted


def test_failed_connect_marks_go_to_the_flow_that_waited():
    addon = faults.FailedConnects()
    f = in_scope_flow()
    server = tflow.tserver_conn()
    server.timestamp_start, server.timestamp_tcp_setup, server.error = 10.0, None, "[Errno 111] refused"
    from mitmproxy import flow as mflow
    from mitmproxy.proxy import server_hooks

    addon.server_connect_error(server_hooks.ServerConnectionHookData(server=server, client=f.client_conn))
    f.error = mflow.Error("[Errno 111] refused")
    addon.error(f)
    assert state.get(f).marks == {"upstream_connect_start": 10.0}
    addon.client_disconnected(f.client_conn)
    assert addon.failed == {}
