"""The event-stream contentview: priority, one line per event, the assembled answer, registration."""

from __future__ import annotations

import pytest
from mitmproxy import contentviews
from mitmproxy.contentviews import Metadata
from mitmproxy.test import taddons
from mitmproxy.test import tflow

from ttft_relay import apis
from ttft_relay.stream import sse, sseview, streaming
from ttft_relay.testing import sse_samples as samples

view = sseview.event_stream_view
TOOL = ("get_weather", ['{"city"', ':"Paris"}'])

STREAMS = {
    "/v1/chat/completions": samples.openai_chat_stream(["Hel", "lo"], reasoning=["hm"], tool_call=TOOL),
    "/v1/responses": samples.responses_stream(["Hel", "lo"], reasoning=["hm"], tool_call=TOOL),
    "/v1/messages": samples.anthropic_stream(["Hel", "lo"], thinking=["hm"], tool_call=TOOL),
    "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse": samples.gemini_stream(["Hel", "lo"]),
}


def sse_flow(path: str, body: bytes) -> tflow.HTTPFlow:
    flow = tflow.tflow(resp=True)
    flow.request.path = path
    flow.response.headers["content-type"] = "text/event-stream; charset=utf-8"
    flow.response.content = body
    return flow


def metadata(path: str | None = None, content_type: str | None = "text/event-stream") -> Metadata:
    return Metadata(flow=sse_flow(path, b"") if path else None, content_type=content_type)


def test_render_priority():
    body = b"".join(STREAMS["/v1/messages"])
    assert view.render_priority(body, metadata()) > 1  # above JSON
    assert 0.1 < view.render_priority(body, metadata(content_type=None)) < 1  # sniffed: above raw only
    assert view.render_priority(b'{"a": 1}', metadata(content_type="application/json")) < 0


@pytest.mark.parametrize("path", STREAMS)
def test_one_line_per_event_then_the_answer(path):
    stream = STREAMS[path]
    text = view.prettify(b"".join(stream), metadata(path))
    event_lines, answer = text.split("\n\n═══ ")
    assert len(event_lines.splitlines()) == len(stream)
    assert "── assistant ──\nHello" in answer
    if "gemini" not in path:
        assert "── reasoning ──\nhm" in answer
        assert '── tool call get_weather (' in answer and '{"city":"Paris"}' in answer


def test_event_line_format():
    lines = view.prettify(b"".join(STREAMS["/v1/messages"]), metadata("/v1/messages")).splitlines()
    assert lines[2] == 'content_block_delta: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}'
    assert 'ping: {"type":"ping"}' in lines
    chat = view.prettify(b"".join(STREAMS["/v1/chat/completions"]), metadata()).splitlines()
    assert chat[len(STREAMS["/v1/chat/completions"]) - 1] == "[DONE]"


def test_shape_detected_from_events_without_a_flow():
    text = view.prettify(b"".join(STREAMS["/v1/responses"]), metadata())
    assert "═══ openai.responses: " in text


def test_cut_short_and_odd_bodies_still_render():
    body = b"".join(STREAMS["/v1/chat/completions"])
    cut = view.prettify(body[: len(body) // 2], metadata("/v1/chat/completions"))
    assert "── assistant ──" in cut
    odd = view.prettify(b"data: not json\ndata: second line\n\nevent: x\ndata: \xff\n\n" + b"data: " + b"y" * 10, metadata())
    assert odd.splitlines() == ["not json\\nsecond line", "x: \\xff", "y" * 10]


def test_registered_by_the_addon_and_chosen_for_event_streams():
    flow = sse_flow("/v1/messages", b"".join(STREAMS["/v1/messages"]))
    with taddons.context(sseview.SSEView()):
        assert contentviews.registry["event stream"] is view
        result = contentviews.prettify_message(flow.response, flow)
    assert result.view_name == "Event stream"
    assert "── assistant ──\nHello" in result.text


def test_events_carry_their_arrival_time_from_the_stream_tap():
    chunks = STREAMS["/v1/chat/completions"]
    flow = sse_flow("/v1/chat/completions", b"")
    tap = streaming.StreamTap(sse.StreamWatcher(apis.get(apis.OPENAI_CHAT)), None, view_max=1 << 20)
    head, rest = b"".join(chunks[:2]), b"".join(chunks[2:])
    tap(head[:-1])  # an event completed only by the next chunk gets that chunk's time
    tap(head[-1:] + rest)
    flow.response.stream = tap
    flow.response.content = tap.stored_body()
    flow.request.timestamp_start = 1000.0
    tap.arrivals[1], tap.arrivals[3] = 1000.0125, 1000.3
    lines = view.prettify(flow.response.content, Metadata(flow=flow, content_type="text/event-stream")).splitlines()
    assert lines[0].lstrip().startswith("+12.5 ms  ")  # the first event, done in the first chunk
    assert lines[1].lstrip().startswith("+300.0 ms  ")  # the second, done by the second
    assert lines[len(chunks) - 1] == "   +300.0 ms  [DONE]"
    assert "── assistant ──\nHello" in "\n".join(lines)


def test_arrival_times_are_bounded_and_skipped_when_the_body_is_not_the_tap_s():
    tap = streaming.StreamTap(sse.StreamWatcher(apis.get(apis.OPENAI_CHAT)), None, view_max=1 << 20)
    for _ in range(streaming.ARRIVALS_MAX + 5):
        tap(b": ping\n\n")
    assert len(tap.arrivals) == 2 * streaming.ARRIVALS_MAX
    flow = sse_flow("/v1/chat/completions", b"")
    flow.response.stream = tap
    other = b"".join(STREAMS["/v1/chat/completions"])  # e.g. the body edited in mitmweb
    assert not view.prettify(other, Metadata(flow=flow, content_type="text/event-stream")).startswith(" ")
