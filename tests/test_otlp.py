"""OpenTelemetry traces from records (ttft_relay/observe/otlp.py: pure) and their exporter thread
(ttft_relay/observe/traces.py) against a real HTTP listener on loopback; the real trace store
is in tests/test_traces_e2e.py.

The protobuf bodies are read back with a small wire-format reader written here from the
protobuf encoding rules, so that the field numbers the encoder uses are checked against
opentelemetry-proto's, which tests/test_traces_e2e.py's Phoenix decodes for real."""

from __future__ import annotations

import http.server
import struct
import threading
import time
from typing import Any

import pytest

from ttft_relay.observe import otlp, traces
from ttft_relay.timing import record
from ttft_relay.workers import free_port

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


# --- a protobuf wire-format reader -----------------------------------------------------------------


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def fields(data: bytes) -> dict[int, list[Any]]:
    """{field number: [values]}: varints as ints, fixed64/32 as ints, length-delimited as bytes."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = struct.unpack_from("<Q", data, i)[0], i + 8
        elif wire == 5:
            value, i = struct.unpack_from("<I", data, i)[0], i + 4
        elif wire == 2:
            n, i = _varint(data, i)
            value, i = data[i:i + n], i + n
        else:
            raise AssertionError(f"wire type {wire}")
        out.setdefault(number, []).append(value)
    return out


def any_value(data: bytes) -> Any:
    f = fields(data)
    if 1 in f:
        return f[1][0].decode()
    if 2 in f:
        return bool(f[2][0])
    if 3 in f:
        n = f[3][0]
        return n - (1 << 64) if n >= 1 << 63 else n
    if 4 in f:
        return struct.unpack("<d", struct.pack("<Q", f[4][0]))[0]
    raise AssertionError(f"AnyValue {f}")


def attributes(kvs: list[bytes]) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        f = fields(kv)
        out[f[1][0].decode()] = any_value(f[2][0])
    return out


def decode(body: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An ExportTraceServiceRequest → (resource attributes, spans as dicts)."""
    resource_spans = fields(fields(body)[1][0])
    resource = attributes(fields(resource_spans[1][0]).get(1, []))
    scope_spans = fields(resource_spans[2][0])
    spans = []
    for raw in scope_spans.get(2, []):
        f = fields(raw)
        spans.append({
            "trace_id": f[1][0].hex(), "span_id": f[2][0].hex(),
            "tracestate": f[3][0].decode() if 3 in f else "",
            "parent_id": f[4][0].hex() if 4 in f else None, "name": f[5][0].decode(), "kind": f[6][0],
            "start": f[7][0], "end": f[8][0], "attributes": attributes(f.get(9, [])),
            "events": [{"time": e[1][0], "name": e[2][0].decode(), "attributes": attributes(e.get(3, []))}
                       for e in map(fields, f.get(11, []))],
            "links": [(lk[1][0].hex(), lk[2][0].hex()) for lk in map(fields, f.get(13, []))],
            "status": fields(f[15][0]) if 15 in f else None, "flags": f.get(16, [0])[0],
        })
    return resource, spans


# --- trace context ---------------------------------------------------------------------------------


def test_a_valid_traceparent_is_read_and_an_invalid_one_ignored():
    got = otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "vendor=x")
    assert got == otlp.Incoming(bytes.fromhex(CLIENT_TRACE), bytes.fromhex(CLIENT_SPAN), True, "vendor=x")
    assert not otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00").sampled
    # A later version: its first four fields are read, whatever follows.
    assert otlp.parse_traceparent(f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-whatever") is not None
    for bad in (None, "", "garbage", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-extra", f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{CLIENT_TRACE}-{'0' * 16}-01",
                f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01", f"00-{CLIENT_TRACE[:-1]}-{CLIENT_SPAN}-01"):
        assert otlp.parse_traceparent(bad) is None, bad


def test_a_client_trace_is_continued_and_passed_on_with_our_tracestate_first():
    incoming = otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "ttft-relay=1, vendor=x")
    trace = otlp.start(incoming)
    assert trace.trace_id.hex() == CLIENT_TRACE and trace.parent_id.hex() == CLIENT_SPAN
    assert trace.from_relay and trace.tracestate == "ttft-relay=1,vendor=x"
    assert otlp.traceparent(trace) == f"00-{CLIENT_TRACE}-{trace.upstream_id.hex()}-01"
    new = otlp.start(None)
    assert new.parent_id is None and not new.from_relay and new.sampled and new.tracestate == "ttft-relay=1"
    assert len({new.trace_id, otlp.start(None).trace_id}) == 2 and len(new.trace_id) == 16


def test_two_chained_relays_derive_the_same_turn_trace_and_link_it():
    near_handshake = otlp.start(None)
    # The far relay received what the near one passed upstream.
    passed = otlp.parse_traceparent(otlp.traceparent(near_handshake), near_handshake.tracestate)
    far_handshake = otlp.start(passed)
    for n in (1, 2):
        near, far = otlp.turn(near_handshake, n), otlp.turn(far_handshake, n)
        assert near.trace_id == far.trace_id != near_handshake.trace_id
        assert near.parent_id is None and far.parent_id == near.upstream_id  # far's root under near's upstream span
        assert far.link == (near_handshake.trace_id, far_handshake.root_id)
    assert otlp.turn(near_handshake, 1).trace_id != otlp.turn(near_handshake, 2).trace_id
    # A traced client that is not a ttft-relay: its turns are traces of their own, linked.
    traced = otlp.start(otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
    assert otlp.turn(traced, 1).parent_id is None


# --- spans -------------------------------------------------------------------------------------------


MARKS = {"request_body": 2.0, "forwarded": 3.0, "upstream_connect_start": 3.5, "upstream_tcp": 10.0,
         "upstream_tls": 20.0, "response_head": 120.0, "first_byte": 121.0, "first_event": 121.5,
         "first_token": 170.0, "last_token": 900.0, "longest_gap": 500.0, "end": 905.0}


def built(**overrides: Any) -> record.Record:
    args: dict[str, Any] = dict(
        id="f1", ts=1_700_000_000.0, api="openai.chat", model="gpt-4o", stream=True, status=200,
        upstream="api.openai.com", marks=MARKS, tokens_expected=True, tls_expected=True, reused_connection=False,
        rtt_ms=10.0, max_gap_ms=300.0, chunks=50, bytes=4000, token_events=40,
        usage={"input_tokens": 1200, "output_tokens": 40, "cached_tokens": 1000, "reasoning_tokens": 7},
        trim={"trimmed": True, "tokens_before": 5000, "tokens_after": 1200, "dropped_units": 3, "reason": "x"},
        request_id="rid-1")
    args.update(overrides)
    return record.build_record(record.RecordInput(**args))


def test_a_record_becomes_a_root_a_span_per_phase_and_an_upstream_span():
    rec = built()
    trace = otlp.start(otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
    spans = otlp.spans(rec.as_dict(), trace, semconv=("chat", "openai"), server_port=443, method="POST")
    root, *children = spans
    assert (root.name, root.kind, root.parent_id, root.span_id) == ("chat gpt-4o", otlp.SERVER, trace.parent_id,
                                                                    trace.root_id)
    by_name = {s.name: s for s in children}
    assert all(s.parent_id == trace.root_id for s in children)
    assert by_name["upstream api.openai.com"].kind == otlp.CLIENT
    assert by_name["upstream api.openai.com"].span_id == trace.upstream_id
    # Phase spans: the record's durations, end to end from the wait's start up to the first token.
    critical = [s for s in children if s.name in rec.phases and s.name != "stream"]
    assert [s.name for s in critical] == [p for p in rec.phases if p not in ("stream", "ttft", "total")]
    for span in critical + [by_name["stream"]]:
        assert (span.end_ns - span.start_ns) / 1e6 == pytest.approx(rec.phases[span.name], abs=1e-6)
    for before, after in zip(critical, critical[1:]):
        assert before.end_ns == after.start_ns
    assert critical[0].start_ns == root.start_ns
    assert critical[-1].end_ns == root.start_ns + round(rec.ttft_ms * 1e6)
    assert (root.end_ns - root.start_ns) / 1e6 == pytest.approx(rec.phases["total"], abs=1e-6)
    origin = round(rec.ts * 1e9)
    events = {name: at for name, at, _ in root.events}
    assert events["first_token"] == origin + round(MARKS["first_token"] * 1e6)
    assert events["longest_gap"] == origin + round(MARKS["longest_gap"] * 1e6)
    a = root.attributes
    assert a["gen_ai.provider.name"] == "openai" and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "gpt-4o" and a["gen_ai.request.stream"] is True
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (1200, 40)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 1000 and a["gen_ai.usage.reasoning.output_tokens"] == 7
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx((MARKS["first_byte"] - (
        MARKS["first_token"] - rec.ttft_ms)) / 1000)
    assert (a["server.address"], a["server.port"], a["http.request.method"]) == ("api.openai.com", 443, "POST")
    assert a["ttft_relay.verdict"] == rec.verdict and a["ttft_relay.ttft_ms"] == rec.ttft_ms
    assert a["ttft_relay.trimmed"] is True and a["ttft_relay.trim.tokens_before"] == 5000
    assert a["ttft_relay.id"] == "f1" and a["ttft_relay.request_id"] == "rid-1"
    assert "ttft_relay.trim.reason" not in a and "error.type" not in a and root.error is None


def test_expected_ttft_is_exported_when_the_record_has_it():
    data = built().as_dict()
    assert "ttft_relay.expected_ttft_ms" not in otlp.spans(data, otlp.start(None))[0].attributes
    data["expected_ttft_ms"] = 812.5
    assert otlp.spans(data, otlp.start(None))[0].attributes["ttft_relay.expected_ttft_ms"] == 812.5


def test_a_failed_request_has_an_error_status_on_its_root_and_its_phase():
    marks = {"request_body": 1.0, "forwarded": 2.0, "upstream_connect_start": 2.5, "end": 3000.0}
    rec = built(marks=marks, error="connect timeout", status=None, max_gap_ms=None, trim=None, usage=None)
    root, *children = otlp.spans(rec.as_dict(), otlp.start(None))
    assert root.error == "connect timeout" and root.attributes["error.type"] == rec.error_phase
    assert root.attributes["ttft_relay.trimmed"] is False
    failed = [s for s in children if s.error]
    assert [s.name for s in failed] == [rec.error_phase]


def test_the_export_body_is_otlp_protobuf():
    rec = built()
    trace = otlp.start(otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "vendor=x"))
    spans = otlp.spans(rec.as_dict(), trace, semconv=("chat", "openai"), server_port=443, method="POST")
    body = otlp.export_request({"service.name": "relay-a", "process.pid": 42}, ("ttft_relay", "0.2.0"),
                               [otlp.encode_span(s, trace) for s in spans])
    resource, got = decode(body)
    assert resource == {"service.name": "relay-a", "process.pid": 42}
    assert len(got) == len(spans)
    root = got[0]
    assert root["trace_id"] == CLIENT_TRACE and root["parent_id"] == CLIENT_SPAN and root["kind"] == otlp.SERVER
    assert root["tracestate"] == "ttft-relay=1,vendor=x" and root["flags"] == 0x301  # sampled, remote parent
    assert root["attributes"] == spans[0].attributes
    assert root["end"] - root["start"] == round(rec.phases["total"] * 1e6)
    assert [e["name"] for e in root["events"]] == ["first_byte", "first_event", "first_token", "longest_gap"]
    assert root["events"][-1]["attributes"] == {"ttft_relay.gap_ms": 300.0}
    assert {s["parent_id"] for s in got[1:]} == {trace.root_id.hex()} and got[1]["flags"] == 0x101
    for span, mine in zip(got, spans):
        assert (span["name"], span["span_id"], span["start"], span["end"]) == (
            mine.name, mine.span_id.hex(), mine.start_ns, mine.end_ns)


def test_a_turn_links_to_its_handshake_and_negative_and_large_numbers_encode():
    handshake = otlp.start(None)
    turn = otlp.turn(handshake, 3)
    rec = built(transport=record.WEBSOCKET, turn=3).as_dict()
    rec["chunks"] = -5  # no record has one, but an int64 must survive
    rec["bytes"] = 1 << 40
    _, got = decode(otlp.export_request({}, ("s", "v"), [otlp.encode_span(s, turn) for s in otlp.spans(rec, turn)]))
    assert got[0]["links"] == [(handshake.trace_id.hex(), handshake.root_id.hex())]
    assert got[0]["attributes"]["ttft_relay.chunks"] == -5 and got[0]["attributes"]["ttft_relay.bytes"] == 1 << 40
    assert got[0]["parent_id"] is None and got[0]["attributes"]["ttft_relay.turn"] == 3


# --- settings from the option and the environment --------------------------------------------------


def test_the_endpoint_comes_from_the_option_then_the_standard_variables():
    assert traces.settings("", {}) is None
    assert traces.settings("http://collector:4318", {}).endpoint == "http://collector:4318/v1/traces"
    assert traces.settings("http://phoenix:6006/v1/traces", {}).endpoint == "http://phoenix:6006/v1/traces"
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.example:4318/"}
    assert traces.settings("", base).endpoint == "https://otel.example:4318/v1/traces"
    assert traces.settings("", base).source == "OTEL_EXPORTER_OTLP_ENDPOINT"
    signal = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/custom"}
    assert traces.settings("", signal).endpoint == "http://t:1/custom"  # as it is, per the specification
    assert traces.settings("http://opt:1", signal).endpoint == "http://opt:1/v1/traces"
    assert traces.settings("", {**base, "OTEL_SDK_DISABLED": "true"}) is None
    assert traces.settings("", {**base, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert traces.settings("", {**base, "OTEL_TRACES_EXPORTER": "console,otlp"}) is not None
    with pytest.raises(ValueError, match="relay_otlp_endpoint"):
        traces.settings("collector:4318", {})


def test_headers_timeout_compression_and_protocol_follow_the_sdk_variables():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
           "OTEL_EXPORTER_OTLP_HEADERS": "x-honeycomb-team=secret%20key,broken,  api-key = a=b ",
           "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2500", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    s = traces.settings("", env)
    assert s.headers == {"x-honeycomb-team": "secret key", "api-key": "a=b"}
    assert s.timeout_s == 2.5 and s.gzip
    assert any("grpc" in w for w in s.warnings) and any("ignored" in w for w in s.warnings)
    assert not any("secret" in w or "broken" in w for w in s.warnings)  # a header's text is never said


def test_the_resource_names_the_service():
    res = traces.resource({"OTEL_SERVICE_NAME": "edge-relay", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"})
    assert res["service.name"] == "edge-relay" and res["deployment.environment"] == "prod"
    assert traces.resource({})["service.name"] == "ttft-relay"


# --- the exporter thread -----------------------------------------------------------------------------


class Collector(http.server.ThreadingHTTPServer):
    """A real HTTP listener that takes OTLP POSTs (or answers `status`) and keeps the bodies."""

    def __init__(self, status: int = 200) -> None:
        self.bodies: list[tuple[dict[str, str], bytes]] = []
        self.status = status
        self.changed = threading.Condition()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with collector.changed:
                    collector.bodies.append((dict(self.headers), body))
                    collector.changed.notify_all()
                self.send_response(collector.status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def wait(self, n: int, timeout: float = 10) -> list[tuple[dict[str, str], bytes]]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.bodies) >= n, timeout)
        return self.bodies

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def queued(n: int) -> list[traces.Queued]:
    return [traces.Queued(built(id=f"f{i}"), otlp.start(None), 1_700_000_000.0, 443, "POST", ("chat", "openai")) for i in range(n)]


def test_the_exporter_batches_records_to_the_collector_with_its_headers():
    collector = Collector()
    drops: list[tuple[str, int]] = []
    exporter = traces.Exporter(traces.Settings(collector.url, headers={"authorization": "Bearer k"}),
                               {"service.name": "t"}, lambda reason, n: drops.append((reason, n)))
    try:
        for item in queued(3):
            exporter.put(item)
        (headers, body), = collector.wait(1)
        assert headers["Content-Type"] == "application/x-protobuf" and headers["authorization"] == "Bearer k"
        _, spans = decode(body)
        assert sorted(s["attributes"]["ttft_relay.id"] for s in spans if s["kind"] == otlp.SERVER) == ["f0", "f1", "f2"]
    finally:
        exporter.close()
        collector.close()
    assert exporter.exported == 3 and not drops


def test_gzip_when_asked():
    collector = Collector()
    exporter = traces.Exporter(traces.Settings(collector.url, gzip=True), {})
    try:
        exporter.put(queued(1)[0])
        (headers, body), = collector.wait(1)
    finally:
        exporter.close()
        collector.close()
    import gzip
    assert headers["Content-Encoding"] == "gzip" and decode(gzip.decompress(body))[1]


def test_a_collector_that_is_down_costs_dropped_records_not_time(monkeypatch):
    monkeypatch.setattr(traces, "RETRIES", (0.01,))
    drops: list[tuple[str, int]] = []
    exporter = traces.Exporter(traces.Settings(f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=1),
                               {}, lambda reason, n: drops.append((reason, n)))
    try:
        items = queued(5)
        started = time.perf_counter()
        for item in items:
            exporter.put(item)
        put_s = time.perf_counter() - started
        deadline = time.time() + 10
        while sum(n for _, n in drops) < 5 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        exporter.close()
    assert drops and {reason for reason, _ in drops} == {traces.DROP_EXPORT_FAILED} and sum(n for _, n in drops) == 5
    assert put_s < 0.5  # appending is all a request pays; generous against a loaded machine


def test_a_full_queue_drops_and_counts(monkeypatch):
    monkeypatch.setattr(traces, "QUEUE_MAX", 2)
    monkeypatch.setattr(traces, "SCHEDULE_S", 60.0)  # the thread stays asleep: nothing leaves the queue
    drops: list[tuple[str, int]] = []
    exporter = traces.Exporter(traces.Settings(f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=0.2),
                               {}, lambda reason, n: drops.append((reason, n)))
    try:
        for item in queued(5):
            exporter.put(item)
        assert drops == [(traces.DROP_QUEUE_FULL, 1)] * 3 and len(exporter.queue) == 2
    finally:
        exporter.close()


def test_a_collector_that_refuses_is_not_retried():
    collector = Collector(status=400)
    drops: list[tuple[str, int]] = []
    exporter = traces.Exporter(traces.Settings(collector.url), {}, lambda reason, n: drops.append((reason, n)))
    try:
        exporter.put(queued(1)[0])
        collector.wait(1)
        time.sleep(0.3)  # a retry would come after RETRIES[0] = 1 s; the close below ends the thread
    finally:
        exporter.close()
        collector.close()
    assert len(collector.bodies) == 1 and drops == [(traces.DROP_REJECTED, 1)]


def test_bench_streams_measures_the_exporter_beside_the_relay():
    """`scripts/bench streams --otlp` (docs/telemetry.md's figures) runs: both exporting setups carry
    their streams without failure and the collector got the traces."""
    import re
    import subprocess
    import sys

    from ttft_relay.testing.harness import REPO

    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.streams", "--rates", "25", "--seconds", "0.2", "--rounds", "1",
         "--events", "20", "--gap-ms", "5", "--setups", "direct,relay-1", "--otlp"],  # as tests/test_bench_streams.py's
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("highest rate sustained")[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\s+25 (\S+) .*$", table, re.M)}
    assert set(rows) == {"direct", "relay-1", "otlp", "otlp-down"}, out.stdout
    for name in ("otlp", "otlp-down"):
        assert re.search(r"ms\s+0\s+5\s", rows[name]), rows[name]  # no failures, 5 streams
    exports = re.search(r"collector took exports (\d+)", out.stdout)
    assert exports and int(exports.group(1)) >= 1, out.stdout


# --- a hostile collector ---------------------------------------------------------------------------


class RawCollector:
    """A collector on loopback that answers each POST with `answer(sock)`: whatever bytes, at
    whatever pace, a real socket can send. Counts what it managed to send."""

    def __init__(self, answer) -> None:
        import socket

        self.answer = answer
        self.sent = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.stopping = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/traces"

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        with conn:
            try:
                conn.recv(1 << 20)  # the POST (small: one record)
                for data in self.answer(self):
                    conn.sendall(data)
                    self.sent += len(data)
            except OSError:
                pass  # the exporter cut it

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


def endless_chunked(collector: RawCollector):
    yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    while not collector.stopping.is_set():
        yield chunk


def dripping(collector: RawCollector):
    yield b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
    while not collector.stopping.is_set():
        time.sleep(0.05)  # the hostile collector's pace: a byte well within any per-read timeout
        yield b"x"


@pytest.mark.parametrize("answer", [endless_chunked, dripping])
def test_a_collector_reply_is_read_a_few_kib_deep_within_one_deadline(answer):
    """Today an endless 200 drove the relay to 4.8 GB in 45 s, and a drip held the thread for ever:
    the POST now ends at its deadline, having read at most REPLY_MAX of the body."""
    collector = RawCollector(answer)
    exporter = traces.Exporter(traces.Settings(collector.url, timeout_s=1.0), {})
    try:
        started = time.monotonic()
        status, _ = exporter._post(b"x", {}, 1.0)
        took = time.monotonic() - started
    finally:
        exporter.close()
        collector.close()
    assert status == 200  # the head was read: the collector took the spans
    assert took < 3.0, took  # one deadline (1 s), not one per read
    assert exporter._conn is None  # its unread rest goes with the connection


def test_a_collector_text_is_quoted_on_one_escaped_line(caplog):
    forged = b'{"id":"x"}\n2026-01-01 00:00:00 200 gpt-4o ttft 10 ms (forged)'

    def refusing(collector: RawCollector):
        yield (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % len(forged)) + forged

    collector = RawCollector(refusing)
    exporter = traces.Exporter(traces.Settings(collector.url, timeout_s=2.0), {})
    try:
        status, problem = exporter._post(b"x", {}, 2.0)
    finally:
        exporter.close()
        collector.close()
    assert status == 500 and "\n" not in problem and "\\n2026-01-01" in problem
    exporter._fail(problem, traces.DROP_REJECTED, 1)
    (line,) = [r.getMessage() for r in caplog.records if "OTLP export" in r.getMessage()]
    assert "\n" not in line and "(forged)" in line


def test_the_queue_is_bounded_in_bytes_and_long_names_are_cut(monkeypatch):
    """A hanging collector and 200 KB model names: +500 MB in 60 s. The names are cut before
    they are queued, and the queue's bytes are bounded besides its records."""
    monkeypatch.setattr(traces, "SCHEDULE_S", 60.0)  # the thread stays asleep: nothing leaves the queue
    monkeypatch.setattr(traces, "QUEUE_BYTES_MAX", 64 * 1024)
    drops: list[tuple[str, int]] = []
    exporter = traces.Exporter(traces.Settings(f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=0.2),
                               {}, lambda reason, n: drops.append((reason, n)))
    name = "m" * 200_000
    try:
        for i in range(100):
            exporter.put(traces.Queued(built(id=f"f{i}", model=name, request_id="r" * 100), otlp.start(None),
                                       1_700_000_000.0, 443, "POST", ("chat", "openai")))
        kept = list(exporter.queue)
        assert 0 < len(kept) < 100 and exporter.queued_bytes <= 64 * 1024
        assert sum(n for _, n in drops) == 100 - len(kept)
        assert all(len(item.rec.model or "") <= traces.FIELD_MAX for item in kept)
        assert kept[0].rec.model.endswith("(200000 characters)")
        spans_of = otlp.spans(kept[0].rec.as_dict(), kept[0].trace)
        assert max(len(s.name) for s in spans_of) < 300
    finally:
        exporter.close()


def test_a_client_tracestate_is_cut_to_the_w3c_limits():
    huge = ",".join([f"v{i}=" + "x" * 20 for i in range(100)] + ["big=" + "y" * 1000])
    state = otlp.start(otlp.parse_traceparent(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", huge)).tracestate
    assert state.startswith("ttft-relay=1,v0=") and len(state) <= otlp.TRACESTATE_MAX and "big=" not in state
    assert state.count(",") < otlp.TRACESTATE_MAX_ENTRIES


# --- which upstreams get the trace context -----------------------------------------------------------


def test_trace_context_goes_by_default_only_to_upstreams_on_a_private_network():
    default = traces.Propagation.parse(traces.DEFAULT_PROPAGATE)
    assert default.to("127.0.0.1", 8080) and default.to("10.0.0.7", 443) and default.to("localhost", 1)
    assert default.to("::1", 1) and default.to("192.168.1.2", 443) and default.to("fd00::1", 443)
    assert not default.to("api.openai.com", 443) and not default.to("api.anthropic.com", 443)
    assert not default.to("8.8.8.8", 443)  # a public address
    assert not default.to("relay.internal.example.com", 443)  # a name is not resolved: named by the operator


@pytest.mark.parametrize("value, to, not_to", [
    ("true", ["api.openai.com", "127.0.0.1"], []),  # the old boolean: everywhere, as before
    ("false", [], ["127.0.0.1", "api.openai.com"]),
    ("all", ["api.openai.com"], []),
    ("off", [], ["127.0.0.1"]),
    ("relay-b.example:8080", ["relay-b.example"], ["127.0.0.1", "api.openai.com"]),
    ("private, relay-b.example", ["relay-b.example", "127.0.0.1"], ["api.openai.com"]),
])
def test_the_propagate_option_names_the_hops(value, to, not_to):
    p = traces.Propagation.parse(value)
    assert all(p.to(host, 8080) for host in to) and not any(p.to(host, 8080) for host in not_to)


def test_the_propagate_option_refuses_all_or_off_in_a_list():
    with pytest.raises(ValueError):
        traces.Propagation.parse("all,relay-b.example")


def test_a_records_model_is_cut():
    rec = built(model="m" * 200_000)
    assert len(rec.model or "") <= record.MODEL_MAX and (rec.model or "").endswith("(200000 characters)")
    assert built().model == "gpt-4o"
