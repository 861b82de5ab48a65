"""The Timing addon's hooks on hand-made flows (no proxy, no network)."""

import asyncio
import dataclasses

import orjson
import pytest
from mitmproxy import http
from mitmproxy.proxy import server_hooks
from mitmproxy.test import taddons, tflow

from ttft_relay import apis, scope, state
from ttft_relay.stream import sse
from ttft_relay.timing import addon as timing
from ttft_relay.timing import phases, record
from ttft_relay.testing import sse_samples

T0 = 1_700_000_000.0


def make_flow(*, stream: bool = True, new_connection: bool = True, status: int = 200):
    f = tflow.tflow(resp=True)
    f.request.scheme, f.request.host, f.request.port = "https", "api.example.com", 443
    f.request.path = "/v1/chat/completions"
    f.request.timestamp_start, f.request.timestamp_end = T0, T0 + 0.010
    conn = f.server_conn
    conn.tls_version = "TLSv1.3"
    conn.timestamp_start, conn.timestamp_tcp_setup, conn.timestamp_tls_setup = (
        (T0 + 0.012, T0 + 0.013, T0 + 0.213) if new_connection else (T0 - 60, T0 - 59.9, T0 - 59.8)
    )
    f.response.status_code = status
    f.response.timestamp_start, f.response.timestamp_end = T0 + 0.5, T0 + 2.0
    st = state.attach(f, state.FlowState(api=apis.get(apis.OPENAI_CHAT), model="gpt-x", stream=stream))
    st.marks["forwarded"] = T0 + 0.011
    return f, st


@pytest.fixture
def addon(tmp_path):
    t = timing.Timing()
    with taddons.context(t) as tctx:
        tctx.configure(t, relay_timing_log=str(tmp_path / "logs" / "t.jsonl"), relay_slow_ms=100)
        yield t


def records(addon):
    path = addon.writer.path
    addon.writer.close()
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_streamed_flow_gets_one_record_everywhere(addon):
    f, st = make_flow()
    addon.responseheaders(f)
    assert f.response.headers["server-timing"] == (
        "client_upload;dur=10.0, relay;dur=2.0, upstream_connect;dur=1.0, upstream_tls;dur=200.0, upstream_wait;dur=287.0"
    )
    st.watcher = w = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
    for i, chunk in enumerate(sse_samples.openai_chat_stream(["Hel", "lo"])):
        w.feed(chunk, T0 + 0.6 + i * 0.01)
    addon.response(f)
    addon.response(f)  # a second call must not write a second record
    (rec,) = records(addon)
    assert rec == f.metadata[timing.METADATA_KEY]
    assert rec["reused_connection"] is False
    assert rec["rtt_ms"] == pytest.approx(200.0)
    assert rec["marks"]["upstream_tls"] == pytest.approx(213.0)
    assert rec["phases"]["upstream_tls"] == pytest.approx(200.0)
    assert f.comment.startswith("upstream network (round trip) 401 ms · SLOW: ttft ")  # the verdict first; relay_slow_ms=100
    assert f.comment.splitlines()[1].startswith("upstream network (round trip): the link to the upstream 401 ms, ")
    assert f.marked == timing.SLOW_MARKER


def test_slow_marking_spares_fast_flows_and_prewarm_turns(addon):
    def rec(ttft_ms, prewarm=False):
        some = record.build_record(record.RecordInput(id="f", ts=T0, api="openai.chat", model=None, stream=True, status=200,
                                                      upstream="u", marks={}, tokens_expected=True, tls_expected=True,
                                                      reused_connection=None, rtt_ms=None))
        return dataclasses.replace(some, ttft_ms=ttft_ms, prewarm=prewarm)

    assert addon.is_slow(rec(100.0))
    assert not addon.is_slow(rec(99.0))
    assert not addon.is_slow(rec(None))
    assert not addon.is_slow(rec(5000.0, prewarm=True))
    f, _ = make_flow(stream=False)
    f.response.timestamp_start = f.response.timestamp_end = T0 + 0.05
    f.server_conn.timestamp_start = None  # no upstream connection phases
    addon.response(f)
    assert f.comment.startswith("ok · ttft ") and not f.marked


def test_second_request_on_the_connection_is_reused_and_uses_the_remembered_rtt(addon):
    f1, _ = make_flow(stream=False)
    addon.response(f1)
    f2, _ = make_flow(stream=False)
    f2.server_conn = f1.server_conn
    f2.response.timestamp_start, f2.response.timestamp_end = T0 + 0.25, T0 + 0.26
    addon.response(f2)
    r1, r2 = records(addon)
    assert r1["reused_connection"] is False and r2["reused_connection"] is True
    assert "upstream_tls" not in r2["phases"] and "upstream_connect" not in r2["marks"]
    assert r2["rtt_ms"] == pytest.approx(200.0)
    # The far upstream's round trip is named, not a slow upstream.
    assert r2["verdict"] == phases.UPSTREAM_NETWORK


def test_one_slow_handshake_does_not_raise_the_round_trip_estimate(addon):
    f1, _ = make_flow(stream=False)
    addon.response(f1)  # a 200 ms TLS 1.3 handshake
    f2, _ = make_flow(stream=False)
    conn = f2.server_conn
    conn.timestamp_tls_setup = conn.timestamp_tcp_setup + 0.900  # e.g. the event loop was busy
    addon.response(f2)
    r1, r2 = records(addon)
    assert r1["rtt_ms"] == pytest.approx(200.0) and r2["rtt_ms"] == pytest.approx(200.0)


def test_disconnected_connection_is_forgotten(addon):
    f1, _ = make_flow(stream=False)
    addon.response(f1)
    addon.server_disconnected(server_hooks.ServerConnectionHookData(server=f1.server_conn, client=f1.client_conn))
    assert addon.used_connections == set()


def test_client_abort_mid_stream_is_recorded_once(addon):
    f, st = make_flow()
    st.watcher = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
    st.watcher.feed(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', T0 + 0.6)
    f.response.timestamp_end = None
    f.error = tflow.terr("Client disconnected.")
    f.error.timestamp = T0 + 0.9
    addon.error(f)
    addon.response(f)
    (rec,) = records(addon)
    assert rec["client_aborted"] is True
    assert rec["verdict"] == "client aborted in stream"
    assert rec["marks"]["end"] == pytest.approx(900.0)


def test_a_providers_429_reads_upstream_refused_rate_limited_in_upstream_wait(addon):
    f, _ = make_flow(stream=False, status=429)
    f.response.headers["content-type"] = "application/json"
    addon.response(f)
    (rec,) = records(addon)
    assert rec["error"] == "HTTP 429" and rec["error_phase"] == "upstream_wait"
    assert rec["verdict"] == "upstream refused: rate limited (429)"
    assert "upstream wait " in rec["verdict_detail"]  # where its time went


def test_non_streamed_usage_from_the_body(addon):
    f, _ = make_flow(stream=False)
    f.response.headers["content-type"] = "application/json"
    f.response.content = orjson.dumps({"usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})
    addon.response(f)
    (rec,) = records(addon)
    assert rec["usage"]["input_tokens"] == 12 and rec["usage"]["output_tokens"] == 3


def test_records_hold_no_header_values(addon):
    f, _ = make_flow(stream=False)
    f.request.headers["authorization"] = "Bearer sk-secret-123"
    f.request.headers["x-api-key"] = "sk-ant-secret-456"
    addon.response(f)
    raw = orjson.dumps(records(addon))
    assert b"secret" not in raw


def test_out_of_scope_flows_are_left_alone(addon):
    f = tflow.tflow(resp=True)
    addon.request(f)
    addon.responseheaders(f)
    addon.response(f)
    assert "server-timing" not in f.response.headers
    assert timing.METADATA_KEY not in f.metadata


def test_summary_command(addon):
    f, _ = make_flow(stream=False)
    addon.response(f)
    other = tflow.tflow(resp=True)
    text = addon.summary([f, other])
    first, second = text.splitlines()
    assert first.endswith(" · gpt-x 200 → api.example.com") and first.startswith("response download 1.5 s · ttft ")
    assert "no timing record" in second


def test_the_upstreams_own_request_id_and_processing_time_are_recorded(addon):
    f, st = make_flow(stream=False)
    f.response.headers["x-request-id"] = "req_0123abc"
    f.response.headers["openai-processing-ms"] = "270"
    addon.response(f)
    g, _ = make_flow(stream=False, new_connection=False)
    g.response.headers["request-id"] = "req_anthropic_1"  # Anthropic's spelling
    g.response.headers["openai-processing-ms"] = "not a number"
    addon.response(g)
    first, second = records(addon)
    assert (first["upstream_request_id"], first["upstream_processing_ms"]) == ("req_0123abc", 270.0)
    assert (second["upstream_request_id"], second["upstream_processing_ms"]) == ("req_anthropic_1", None)


def test_records_reach_every_timing_record_hook_once(tmp_path):
    class Sink:
        def __init__(self):
            self.got = []

        def timing_record(self, record, flow):
            self.got.append((record.id, flow))

    t, sink = timing.Timing(), Sink()
    with taddons.context(t, sink) as tctx:
        tctx.configure(t, relay_timing_log="")
        f, _ = make_flow()
        t.response(f)
        t.error(f)
        assert sink.got == [(f.id, f)]


def test_a_websocket_handshake_gets_no_server_timing_header(addon):
    f, st = make_flow(stream=False, status=101)
    f.request.method = "GET"
    f.response.headers.update({"upgrade": "websocket", "connection": "Upgrade"})
    st.transport = "websocket"
    addon.responseheaders(f)
    assert "server-timing" not in f.response.headers
    addon.response(f)
    (rec,) = records(addon)
    assert (rec["transport"], rec["turn"], rec["status"], rec["ttft_ms"]) == ("websocket", 0, 101, None)


def test_the_upstream_headers_read_in_one_pass_are_what_headers_get_gives():
    heads = [
        [],
        [(b"X-Request-Id", b"req_1"), (b"content-type", b"text/event-stream")],
        [(b"request-id", b"a"), (b"REQUEST-ID", b"b"), (b"openai-processing-ms", b"12.5")],  # folded: "a, b"
        [(b"x-request-id", b""), (b"request-id", b"anthropic"), (b"Openai-Processing-Ms", b"x")],
        [(b"x-request-id", b"\xff\xfe"), (b"x-requestid", b"no")],  # not UTF-8; a name that only looks alike
    ]
    for fields in heads:
        response = http.Response.make(200, b"", fields)
        expected = {n: v for n in (*timing.UPSTREAM_REQUEST_ID_HEADERS, timing.PROCESSING_MS_HEADER)
                    if (v := response.headers.get(n)) is not None}
        assert timing.upstream_headers(response) == expected, fields
    assert timing.upstream_headers(None) == {}


def test_a_record_waits_for_the_self_watchs_final_figures_and_goes_before_the_next_request(addon):

    async def main():
        f, st = make_flow()
        answers = iter([0.01, None])  # not acknowledged yet; then final
        st.settle = lambda: next(answers)
        st.links = {"client_retransmits": 0}
        addon.response(f)
        assert f.metadata.get(timing.METADATA_KEY) is None and f in addon.settling  # waits
        st.links["client_retransmits"] = 2  # what the self-watch learned meanwhile
        await asyncio.sleep(0.05)
        assert f.metadata[timing.METADATA_KEY]["client_retransmits"] == 2 and not addon.settling
        # The connection's next request ends the wait at once: its record goes first.
        g, gst = make_flow()
        gst.settle = lambda: 10.0
        addon.response(g)
        assert g in addon.settling
        nxt, _ = make_flow()
        nxt.client_conn = g.client_conn
        gst.settle = None  # the self-watch's requestheaders (before timing's) made g's figures final
        addon.requestheaders(nxt)
        assert g.metadata[timing.METADATA_KEY] and not addon.settling and not addon.settling_on
        # At shutdown whatever still waits is recorded.
        h, hst = make_flow()
        hst.settle = lambda: 10.0
        addon.response(h)
        addon.done()
        assert h.metadata[timing.METADATA_KEY] and not addon.settling

    asyncio.run(main())


def test_a_record_an_observer_is_not_ready_for_waits_and_its_answer_does_not():
    # The attempt groups' read of the store may end after a quick answer: the answer goes on
    # at once (its end is sent after the response hook), its record once the read ended.
    published = []

    class Observer:
        def __init__(self) -> None:
            self.ready: asyncio.Future | None = None

        def pending(self, flow):
            return self.ready

        def observe(self, rec, flow):
            return record.Learned(attempt_group="first", attempt=2)

    class Sink:
        def timing_record(self, rec, flow):
            published.append(rec)

    async def main() -> None:
        observer = Observer()
        observer.ready = asyncio.get_running_loop().create_future()
        t = timing.Timing(observers=(observer,))
        with taddons.context(t, scope.Scope(), Sink()) as tctx:
            tctx.configure(t, relay_timing_log="")
            f, _ = make_flow(new_connection=False)
            assert t.response(f) is None  # the hook returns at once: the answer's end is not held
            await asyncio.sleep(0)
            assert published == [] and f in t.settling
            observer.ready.set_result(None)
            for _ in range(3):
                await asyncio.sleep(0)
            (rec,) = published
            assert rec.attempt == 2 and not t.settling
            # A stop while a record waits records it at once, and only once.
            g, _ = make_flow(new_connection=False)
            observer.ready = asyncio.get_running_loop().create_future()
            t.response(g)
            t.done()
            await asyncio.sleep(0)
            assert len(published) == 2 and not t.settling

    asyncio.run(main())


def test_observers_say_what_they_learned_and_every_sink_gets_one_frozen_record_judged_once(tmp_path):
    seen = []

    class Observer:
        def __init__(self, learned):
            self.learned = learned

        def pending(self, flow):
            return None

        def observe(self, rec, flow):
            seen.append((rec.verdict, state.get(flow).request_json))
            return self.learned

    class Sink:
        def timing_record(self, rec, flow):
            seen.append(rec)

    expectation = phases.Expectation(own_ms=50.0, tolerance_ms=20.0, prompt_ms=10.0, uncached_tokens=1000,
                                     cached_tokens=0, ms_per_1k=10.0, learned_from=9)
    t = timing.Timing(observers=(Observer(record.Learned(expectation=expectation)),
                                 Observer(record.Learned(attempt_group="first", attempt=2))))
    with taddons.context(t, scope.Scope(), Sink()) as tctx:
        tctx.configure(t, relay_timing_log="")
        f, st = make_flow(new_connection=False)
        st.request_json = {"model": "gpt-x", "messages": []}
        st.watcher = w = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
        for i, chunk in enumerate(sse_samples.openai_chat_stream(["Hel", "lo"])):
            w.feed(chunk, T0 + 0.6 + i * 0.01)
        t.response(f)
    # Each observer saw the measured record (not judged yet) while the parsed body was still there.
    assert seen[:2] == [(phases.UNKNOWN, {"model": "gpt-x", "messages": []})] * 2
    (published,) = seen[2:]
    # Judged once with both observers' parts: the prediction (its verdict against it) and the group.
    assert published.verdict == phases.UPSTREAM_QUEUEING and published.expected_ttft_ms is not None
    assert (published.attempt_group, published.attempt) == ("first", 2)
    assert f.metadata[timing.METADATA_KEY] == published.as_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        published.verdict = "ok"  # type: ignore[misc]
    # Nothing reads the parsed body after the record: it is not kept with the flow.
    assert st.request_json is None
