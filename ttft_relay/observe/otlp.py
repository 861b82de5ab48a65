"""A timing record as an OpenTelemetry trace, encoded as OTLP protobuf; W3C trace context (pure).

One record (an HTTP request or a WebSocket turn) becomes the relay's part of one trace:

    {operation} {model}      SERVER   the client's wait at this relay: from the start of its wait
                                      to the end; GenAI semantic-convention attributes beside the
                                      relay's own (`ttft_relay.*`); events first_byte, first_event,
                                      first_token, longest_gap
      relay_queue ... head_to_first_token / response_body
                             INTERNAL one span per critical-path phase present in the record, laid
                                      end to end from the start of the wait, in timeline order
                                      (their durations are the record's; relay_queue, which may be
                                      several moments, is drawn first as their sum)
      stream                 INTERNAL first → last token
      upstream {host}        CLIENT   forwarded (or the connect, when earlier) → end: the exchange
                                      with the upstream; its id is the parent the relay passes
                                      upstream in `traceparent`, so the next hop's spans (another
                                      ttft-relay's) nest under it

Trace context (https://www.w3.org/TR/trace-context/): a valid `traceparent` from the client
is continued (its trace id, its span as the root's parent, its sampled flag); otherwise the
relay starts a trace. A WebSocket turn has no headers of its own: each turn is a trace whose
ids are derived from its socket's handshake context and the turn number, so that a
ttft-relay behind this one (which got the handshake's context, marked in `tracestate`)
derives the same trace and finds its parent: two chained relays give one trace per turn.

Nothing here reads a body, a header value other than the trace context, or a key: the
spans carry what the record carries. The protobuf encoding is written by hand (the OTLP
messages used are small and stable: opentelemetry-proto's trace/v1 and common/v1), so the
relay needs no protobuf runtime and builds no SDK span objects.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..timing import phases

TRACESTATE_KEY = "ttft-relay"
"""Our `tracestate` entry: the context came from a ttft-relay, which derives turn traces."""
TRACESTATE_MAX_ENTRIES = 32
TRACESTATE_ENTRY_MAX = 128
TRACESTATE_MAX = 512
"""W3C trace context's limits for what is passed on: an entry longer than TRACESTATE_ENTRY_MAX
characters goes first, and the list stops before TRACESTATE_MAX (a client's `tracestate` of
any size would otherwise be in every span the relay queues and sends)."""

SERVER, CLIENT, INTERNAL = 2, 3, 1
"""Span kinds (opentelemetry.proto.trace.v1.Span.SpanKind)."""
STATUS_ERROR = 2

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


# --- trace context -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Incoming:
    """A valid trace context a client sent."""

    trace_id: bytes
    span_id: bytes
    sampled: bool
    tracestate: str


def parse_traceparent(traceparent: str | None, tracestate: str | None = None) -> Incoming | None:
    """The context of a `traceparent` header (W3C trace context, version 00 and the
    later versions' first four fields), or None when it is absent or invalid (then the
    relay starts a trace, as the specification asks)."""
    if not traceparent:
        return None
    m = _TRACEPARENT.match(traceparent.strip())
    if m is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = bytes.fromhex(trace_hex), bytes.fromhex(span_hex)
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return Incoming(trace_id, span_id, bool(int(flags_hex, 16) & 1), (tracestate or "").strip())


@dataclass(frozen=True, slots=True)
class Trace:
    """The ids of the relay's part of one trace: fixed when the request head arrives, so that
    the context passed upstream names the span the record later becomes."""

    trace_id: bytes
    root_id: bytes
    upstream_id: bytes
    """The CLIENT span's id: the parent the next hop is given."""
    parent_id: bytes | None
    """The client's span (None: the relay started the trace)."""
    sampled: bool
    tracestate: str
    """What goes upstream in `tracestate`: ours first, then the client's other entries."""
    from_relay: bool
    """The client is a ttft-relay (its `tracestate` says so): turn traces are derived alike."""
    link: tuple[bytes, bytes] | None = None
    """A span this one follows from (a turn: its socket's handshake)."""


def _tracestate(incoming: str) -> str:
    entries = [e.strip() for e in incoming.split(",") if e.strip()]
    kept = [e for e in entries if e.partition("=")[0].strip() != TRACESTATE_KEY and len(e) <= TRACESTATE_ENTRY_MAX]
    out = [f"{TRACESTATE_KEY}=1"]
    for entry in kept[:TRACESTATE_MAX_ENTRIES - 1]:
        if sum(map(len, out)) + len(out) + len(entry) > TRACESTATE_MAX:
            break
        out.append(entry)
    return ",".join(out)


def start(incoming: Incoming | None, random: Any = os.urandom) -> Trace:
    """The trace of a request whose head carried `incoming` (None: a new trace)."""
    state = incoming.tracestate if incoming is not None else ""
    return Trace(
        trace_id=incoming.trace_id if incoming is not None else _nonzero(random, 16),
        root_id=_nonzero(random, 8),
        upstream_id=_nonzero(random, 8),
        parent_id=incoming.span_id if incoming is not None else None,
        sampled=incoming.sampled if incoming is not None else True,
        tracestate=_tracestate(state),
        from_relay=any(e.partition("=")[0].strip() == TRACESTATE_KEY for e in state.split(",")),
    )


def turn(handshake: Trace, number: int, random: Any = os.urandom) -> Trace:
    """The trace of WebSocket turn `number` on a socket whose handshake had `handshake`.

    Its trace id and the id of its CLIENT span are derived from the handshake's, which the
    next hop received as its own handshake's context; a relay whose client was a ttft-relay
    derives its root's parent the same way, so both relays' turn spans meet in one trace.
    Otherwise the turn's root has no parent; it links to the handshake's span."""
    n = number.to_bytes(8, "big")
    return Trace(
        trace_id=_derived(16, handshake.trace_id, n),
        root_id=_nonzero(random, 8),
        upstream_id=_derived(8, handshake.trace_id, handshake.upstream_id, n),
        parent_id=(_derived(8, handshake.trace_id, handshake.parent_id, n)
                   if handshake.from_relay and handshake.parent_id is not None else None),
        sampled=handshake.sampled,
        tracestate=handshake.tracestate,
        from_relay=handshake.from_relay,
        link=(handshake.trace_id, handshake.root_id),
    )


def traceparent(trace: Trace) -> str:
    """The `traceparent` passed upstream: this trace, the CLIENT span as the parent."""
    return f"00-{trace.trace_id.hex()}-{trace.upstream_id.hex()}-{'01' if trace.sampled else '00'}"


def _nonzero(random: Any, size: int) -> bytes:
    while (value := random(size)) == bytes(size):
        pass
    return value


def _derived(size: int, *parts: bytes) -> bytes:
    value = hashlib.blake2b(b"".join(parts), digest_size=size, person=b"ttft-relay-turn").digest()
    return value if any(value) else b"\x01" * size


# --- spans from a record -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    span_id: bytes
    parent_id: bytes | None
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    events: tuple[tuple[str, int, Mapping[str, Any]], ...] = ()
    error: str | None = None
    """Set: the span's status is ERROR with this message."""


USAGE_ATTRIBUTES = {
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cached_tokens": "gen_ai.usage.cache_read.input_tokens",
    "cache_creation_tokens": "gen_ai.usage.cache_creation.input_tokens",
    "reasoning_tokens": "gen_ai.usage.reasoning.output_tokens",
}
"""The record's usage keys and their GenAI semantic-convention attributes."""
RECORD_ATTRIBUTES = ("id", "request_id", "api", "transport", "turn", "prewarm", "verdict", "ttft_ms",
                     "expected_ttft_ms", "rtt_ms", "max_gap_ms", "chunks", "bytes", "output_tokens_per_s",
                     "prompt_tokens", "reused_connection", "upstream_request_id", "upstream_processing_ms",
                     "error", "error_phase", "client_aborted", "loop_lag_ms", "gc_pause_ms", "client_rtt_ms",
                     "client_retransmits", "upstream_tcp_rtt_ms", "upstream_retransmits")
"""Record keys exported as `ttft_relay.<key>` on the root span, when known (an absent key, as
`expected_ttft_ms` in a record written before the relay learned it, is left out)."""
EVENT_MARKS = ("first_byte", "first_event", "first_token")
STREAM_PHASES = ("stream",)


def _ns(origin_ns: int, ms: float) -> int:
    return origin_ns + round(ms * 1e6)


def wait_start_ms(marks: Mapping[str, float], p: Mapping[str, float]) -> float:
    """Where the client's wait began, in the record's ms (`phases.compute`'s start, which the
    record keeps only through its durations: total ends at `end`, ttft at the first token)."""
    if "total" in p and "end" in marks:
        return marks["end"] - p["total"]
    if "ttft" in p:
        first = marks.get("first_token", marks.get("end"))
        if first is not None:
            return first - p["ttft"]
    return min(0.0, *marks.values()) if marks else 0.0


def spans(rec: Mapping[str, Any], trace: Trace, *, origin_s: float | None = None,
          semconv: tuple[str, str] = ("chat", "other"), server_port: int | None = None,
          method: str | None = None) -> list[Span]:
    """The spans of one record (its `as_dict()` form), root first.

    `origin_s`: the Unix time the record's marks count from (its `ts` when None);
    `semconv`: the API's (gen_ai.operation.name, gen_ai.provider.name)."""
    marks: Mapping[str, float] = rec.get("marks") or {}
    p: Mapping[str, float] = rec.get("phases") or {}
    origin = round((rec["ts"] if origin_s is None else origin_s) * 1e9)
    start = wait_start_ms(marks, p)
    end = marks["end"] if "end" in marks else max([start, *marks.values()])
    operation, provider = semconv
    model = rec.get("model")
    failed = bool(rec.get("error") or rec.get("client_aborted"))

    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": provider,
        "gen_ai.request.stream": bool(rec.get("stream")),
    }
    if model:
        attributes["gen_ai.request.model"] = model
    for key, name in USAGE_ATTRIBUTES.items():
        if isinstance(n := (rec.get("usage") or {}).get(key), int):
            attributes[name] = n
    if rec.get("stream") and (first_byte := marks.get("first_byte")) is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = round((first_byte - start) / 1000, 6)
    host, port = split_host(rec.get("upstream") or "", server_port)
    attributes["server.address"] = host
    if port is not None:
        attributes["server.port"] = port
    if method:
        attributes["http.request.method"] = method
    if rec.get("status") is not None:
        attributes["http.response.status_code"] = rec["status"]
    if failed:
        attributes["error.type"] = rec.get("error_phase") or ("client_aborted" if rec.get("client_aborted") else "error")
    for key in RECORD_ATTRIBUTES:
        if (value := rec.get(key)) is not None:
            attributes[f"ttft_relay.{key}"] = value
    trim = rec.get("trim") or {}
    attributes["ttft_relay.trimmed"] = bool(trim.get("trimmed"))
    for key in ("tokens_before", "tokens_after", "dropped_units"):
        if isinstance(trim.get(key), int):
            attributes[f"ttft_relay.trim.{key}"] = trim[key]

    events: list[tuple[str, int, Mapping[str, Any]]] = [
        (name, _ns(origin, marks[name]), {}) for name in EVENT_MARKS if name in marks]
    if (gap := rec.get("max_gap_ms")) and (gap_began := marks.get("longest_gap")) is not None:
        events.append(("longest_gap", _ns(origin, gap_began), {"ttft_relay.gap_ms": gap}))
    events.sort(key=lambda e: e[1])

    root = Span(trace.root_id, trace.parent_id, f"{operation} {model}" if model else operation, SERVER,
                _ns(origin, start), _ns(origin, end), attributes, tuple(events),
                error=rec.get("error") or ("client aborted" if rec.get("client_aborted") else None))
    out = [root]
    cursor = start
    for name in phases.CRITICAL_PHASES:
        if (ms := p.get(name)) is not None:
            out.append(_phase(trace, name, origin, cursor, ms, rec))
            cursor += ms
    if (ms := p.get("stream")) is not None:
        out.append(_phase(trace, "stream", origin, marks.get("first_token", cursor), ms, rec))
    error_phase = rec.get("error_phase")
    if failed and isinstance(error_phase, str) and error_phase in phases.PHASE_WORDS and error_phase not in p:
        # The phase it failed in never completed, so the record has no duration for it: its
        # span runs from where the completed ones end to the failure.
        out.append(_phase(trace, error_phase, origin, cursor, max(0.0, end - cursor), rec))
    if "forwarded" in marks:
        # From the request leaving, or from the connect when it came first (mitmproxy connects
        # eagerly in reverse mode): the next hop's wait starts with that connection.
        sent = min(marks["forwarded"], marks.get("upstream_connect_start", marks["forwarded"]))
        upstream_attrs: dict[str, Any] = {"server.address": host}
        if port is not None:
            upstream_attrs["server.port"] = port
        if rec.get("status") is not None:
            upstream_attrs["http.response.status_code"] = rec["status"]
        if rec.get("reused_connection") is not None:
            upstream_attrs["ttft_relay.reused_connection"] = rec["reused_connection"]
        out.append(Span(trace.upstream_id, trace.root_id, f"upstream {rec.get('upstream')}", CLIENT,
                        _ns(origin, sent), _ns(origin, max(end, sent)), upstream_attrs))
    return out


def _phase(trace: Trace, name: str, origin: int, at: float, ms: float, rec: Mapping[str, Any]) -> Span:
    span_id = _derived(8, trace.root_id, name.encode())
    failed = rec.get("error_phase") == name and bool(rec.get("error") or rec.get("client_aborted"))
    return Span(span_id, trace.root_id, name, INTERNAL, _ns(origin, at), _ns(origin, at + ms),
                {"ttft_relay.phase": name, "ttft_relay.duration_ms": round(ms, 3)},
                error=(rec.get("error") or "client aborted") if failed else None)


def split_host(upstream: str, port: int | None) -> tuple[str, int | None]:
    """The record's "host[:port]" as (host, port); `port` (the request's) wins when known."""
    host, sep, tail = upstream.rpartition(":")
    if sep and tail.isdigit() and not host.endswith(":"):  # not an IPv6 address without a port
        return host.strip("[]"), port or int(tail)
    return upstream.strip("[]"), port


# --- OTLP protobuf ----------------------------------------------------------------------------------
# Field numbers: opentelemetry/proto/{collector/trace,trace,common,resource}/v1/*.proto


def _varint_slow(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64: negative numbers as their two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [_varint_slow(n) for n in range(1 << 14)]
"""Every varint of one or two bytes: lengths, tags and most counts are among them."""


def _varint(n: int) -> bytes:
    return _SMALL[n] if 0 <= n < 16384 else _varint_slow(n)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field; `tag` is (field number << 3) | 2, below 128."""
    n = len(payload)
    return _SMALL[tag] + (_SMALL[n] if n < 16384 else _varint_slow(n)) + payload


def _text(tag: int, value: str) -> bytes:
    return _field(tag, value.encode("utf-8", "replace"))


_KEYS: dict[str, bytes] = {}
_TRUE, _FALSE = b"\x12\x02\x10\x01", b"\x12\x02\x10\x00"
"""The value fields (KeyValue.value) of true and false."""


def _value_field(value: Any) -> bytes:
    """KeyValue's `value` field (an AnyValue) for a str, bool, int or float."""
    if value is True:
        return _TRUE
    if value is False:
        return _FALSE
    if isinstance(value, int):
        return _field(0x12, b"\x18" + _varint(value))
    if isinstance(value, float):
        return b"\x12\x09\x21" + struct.pack("<d", value)
    return _field(0x12, _text(0x0A, str(value)))


def _attributes(tag: int, attributes: Mapping[str, Any]) -> bytes:
    out = []
    for key, value in attributes.items():
        if (k := _KEYS.get(key)) is None:
            k = _KEYS[key] = _text(0x0A, key)
        out.append(_field(tag, k + _value_field(value)))
    return b"".join(out)


def _fixed64(tag: int, value: int) -> bytes:
    return _SMALL[tag] + struct.pack("<Q", max(0, value))


def encode_span(span: Span, trace: Trace) -> bytes:
    """One `Span` message of trace `trace`."""
    parts = [_field(0x0A, trace.trace_id), _field(0x12, span.span_id)]
    if trace.tracestate:
        parts.append(_text(0x1A, trace.tracestate))
    if span.parent_id is not None:
        parts.append(_field(0x22, span.parent_id))
    parts += [_text(0x2A, span.name), b"\x30" + _SMALL[span.kind],
              _fixed64(0x39, span.start_ns), _fixed64(0x41, max(span.start_ns, span.end_ns)),
              _attributes(0x4A, span.attributes)]
    for name, at, attrs in span.events:
        parts.append(_field(0x5A, _fixed64(0x09, at) + _text(0x12, name) + _attributes(0x1A, attrs)))
    if span.span_id == trace.root_id and trace.link is not None:
        link_trace, link_span = trace.link
        parts.append(_field(0x6A, _field(0x0A, link_trace) + _field(0x12, link_span)))
    if span.error is not None:
        parts.append(_field(0x7A, _text(0x12, span.error) + b"\x18" + _SMALL[STATUS_ERROR]))
    # flags: the trace flags (sampled), and whether the parent is remote (the client's span).
    remote = 0x300 if span.parent_id is not None and span.parent_id == trace.parent_id else 0x100
    parts.append(b"\x85\x01" + struct.pack("<I", (1 if trace.sampled else 0) | remote))
    return b"".join(parts)


def export_request(resource: Mapping[str, Any], scope: tuple[str, str], spans: Iterable[bytes]) -> bytes:
    """An `ExportTraceServiceRequest` body: one resource, one instrumentation scope, `spans`
    (each an encoded `Span`, `encode_span`)."""
    name, version = scope
    scope_msg = _text(0x0A, name) + _text(0x12, version)
    scope_spans = _field(0x0A, scope_msg) + b"".join(_field(0x12, s) for s in spans)
    resource_spans = _field(0x0A, _attributes(0x0A, resource)) + _field(0x12, scope_spans)
    return _field(0x0A, resource_spans)
