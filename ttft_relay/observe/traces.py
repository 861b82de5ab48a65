"""Traces: every timing record as an OpenTelemetry trace, sent to a collector over OTLP/HTTP.

Off by default. On when `relay_otlp_endpoint` names an endpoint, or when the standard
variables every OpenTelemetry SDK honours are set (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, used
as it is, or `OTEL_EXPORTER_OTLP_ENDPOINT`, + `/v1/traces`); `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS`,
`…_TIMEOUT`, `…_COMPRESSION` (gzip), `…_CERTIFICATE`, `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES` apply either way; `OTEL_SDK_DISABLED=true` or an
`OTEL_TRACES_EXPORTER` without `otlp` turn the variables' endpoint off. Headers (a collector's
API key) come only from the environment, never from an option that /options or mitm.conf shows.

Per in-scope request the addon fixes the trace's ids when the head arrives (`requestheaders`):
the client's `traceparent` continued, or a new trace, and, to the upstreams
`relay_otlp_propagate` names (`Propagation`), the relay's `traceparent` / `tracestate` set on
the request it forwards, naming its upstream span as the parent, so that a ttft-relay behind
it (or any traced upstream) joins the same trace. By default those are the upstreams on
loopback or a private network (a chained relay, a collector's agent), never a provider on the
internet: its trace ids and the client's `tracestate` entries are nothing a third party needs.
When the record is published (timing's `timing_record` hook) it is queued, nothing more:
a thread turns the queued records into spans (`otlp.spans`), encodes them and POSTs them in
batches. The queue is bounded in records (QUEUE_MAX) and in bytes (QUEUE_BYTES_MAX, each
record's client-given strings cut to `FIELD_MAX` first: a model name of 200 KB costs what one
of 256 characters does); what does not fit, and what a collector does not take (down,
refusing, too slow), is dropped, counted (`ttft_relay_otlp_dropped_records_total`, by reason)
and logged once per episode. An unreachable collector changes nothing else.

The collector is not trusted either: of its reply the exporter reads the head and at most
REPLY_MAX bytes of the body, all within the POST's one deadline (a watchdog shuts the socket
when it passes; a socket timeout alone is per read, and a collector that drips, or answers
200 with an endless chunked body, would hold the thread or fill memory for ever), and a
reply it did not read to the end costs the connection. What the log quotes of a reply is
cut and escaped onto one line (a newline in a 500's body would start a line of its own).
Each process (a worker of `--workers N`) exports its own spans.
"""

from __future__ import annotations

import copy
import gzip
import ipaddress
import logging
import os
import random
import socket
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import client as http_client
from importlib import metadata
from typing import Any
from urllib.parse import unquote, urlsplit

from mitmproxy import ctx, exceptions, http

from .. import state
from ..text import cut_text, printable
from ..timing import record
from . import otlp

logger = logging.getLogger(__name__)

QUEUE_MAX = 4096
"""Records waiting for the exporter thread; beyond, a record's spans are dropped (and counted)."""
QUEUE_BYTES_MAX = 16 * 1024 * 1024
"""... and their size (`Queued.size`) together: records of long names fill it before QUEUE_MAX."""
FIELD_MAX = 256
"""A record's client-given strings (model, upstream, request ids), cut to this before queueing."""
REPLY_MAX = 4096
"""Bytes of a collector's reply body read; the rest is left unread, with its connection."""
REPLY_QUOTED = 300
"""Characters of a collector's reply body the log quotes."""
BATCH_MAX = 256
"""Records per POST; a full batch wakes the thread before its schedule."""
SCHEDULE_S = 1.0
"""The thread sends what has queued at least this often."""
RETRIES = (1.0, 2.0)
"""Waits before the second and third try of a batch the collector could not take for now."""
RETRYABLE = {429, 502, 503, 504}
SHUTDOWN_S = 3.0
"""At a clean stop, how long the last batch may take."""
DEFAULT_TIMEOUT_S = 10.0
SCOPE_NAME = "ttft_relay"
DROP_QUEUE_FULL, DROP_EXPORT_FAILED, DROP_REJECTED = "queue_full", "export_failed", "rejected"

PROPAGATE_ALL, PROPAGATE_NONE, PROPAGATE_PRIVATE = "all", "off", "private"
DEFAULT_PROPAGATE = PROPAGATE_PRIVATE
_YES, _NO = {"true", "on", "yes", "1", PROPAGATE_ALL}, {"false", "off", "no", "0", "none", ""}


@dataclass(frozen=True)
class Propagation:
    """Which upstreams get the relay's trace context (`relay_otlp_propagate`, sans-IO): `all`,
    `off`, or a comma-separated list of hosts (`host` or `host:port`) and `private` (every
    upstream on loopback or a private network: an IP address there, `localhost`). The old
    boolean is read as `all` (true) and `off` (false)."""

    everywhere: bool = False
    private: bool = False
    hosts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, value: str) -> Propagation:
        words = [w.strip().lower() for w in value.split(",") if w.strip()]
        if len(words) <= 1 and (words[0] if words else "") in _YES | _NO:
            return cls(everywhere=(words[0] if words else "") in _YES)
        if any(w in _YES | _NO for w in words):
            raise ValueError(f"relay_otlp_propagate: 'all' and 'off' stand alone, got {value!r}")
        return cls(private=PROPAGATE_PRIVATE in words, hosts=frozenset(w for w in words if w != PROPAGATE_PRIVATE))

    def to(self, host: str, port: int) -> bool:
        """Whether the request to `host`:`port` gets the relay's trace context."""
        host = host.lower().strip("[]")
        if self.everywhere or host in self.hosts or f"{host}:{port}" in self.hosts:
            return True
        return self.private and is_private(host)


def is_private(host: str) -> bool:
    """`host` is on this machine or a private network by its own name: loopback, RFC 1918 /
    unique-local / link-local addresses, `localhost` (a name is not resolved: what it resolves
    to can change, and a provider's name never says private)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


_ids = random.Random()
"""Span and trace ids: randomness seeded from os.urandom, without a system call per id."""


@dataclass(frozen=True)
class Settings:
    """Where and how to export, from the option and the environment (`settings`)."""

    endpoint: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    gzip: bool = False
    ca_file: str | None = None
    source: str = "relay_otlp_endpoint"
    warnings: tuple[str, ...] = ()


def _env(env: Mapping[str, str], name: str) -> str:
    """A per-signal variable (OTEL_EXPORTER_OTLP_TRACES_X) before the general one (…_OTLP_X)."""
    return (env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}") or "").strip()


def settings(option: str, env: Mapping[str, str]) -> Settings | None:
    """The export settings, or None when exporting is off. Raises ValueError for an endpoint
    that is not an http(s) URL (the option's, or a variable's)."""
    option = option.strip()
    warnings: list[str] = []
    if option:
        endpoint, source = _with_path(option), "relay_otlp_endpoint"
    else:
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        if exporters and "otlp" not in {e.strip() for e in exporters.split(",")}:
            return None
        if signal := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
            endpoint, source = signal, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        elif base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
            endpoint, source = base.rstrip("/") + "/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT"
        else:
            return None
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{source}: expected an http:// or https:// URL, got {endpoint!r}")
    protocol = _env(env, "PROTOCOL")
    if protocol and protocol != "http/protobuf":
        warnings.append(f"OTLP protocol {protocol!r} is not supported: sending http/protobuf to {endpoint}")
    headers: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in _env(env, "HEADERS").split(","))):
        name, eq, value = item.partition("=")
        if eq and name.strip():
            headers[unquote(name.strip())] = unquote(value.strip())
        else:  # its value may be a secret: only its position is said
            warnings.append("an OTEL_EXPORTER_OTLP_HEADERS entry without 'name=' was ignored")
    try:
        timeout_s = float(_env(env, "TIMEOUT") or DEFAULT_TIMEOUT_S * 1000) / 1000
    except ValueError:
        warnings.append("OTEL_EXPORTER_OTLP_TIMEOUT is not a number of milliseconds: 10000 used")
        timeout_s = DEFAULT_TIMEOUT_S
    compression = _env(env, "COMPRESSION").lower()
    if compression not in ("", "none", "gzip"):
        warnings.append(f"OTLP compression {compression!r} is not supported: sending uncompressed")
    return Settings(endpoint, headers, timeout_s if timeout_s > 0 else DEFAULT_TIMEOUT_S, compression == "gzip",
                    _env(env, "CERTIFICATE") or None, source, tuple(warnings))


def _with_path(endpoint: str) -> str:
    """The option's endpoint: a collector's address alone gets OTLP's `/v1/traces`."""
    url = urlsplit(endpoint)
    return endpoint.rstrip("/") + "/v1/traces" if url.path in ("", "/") else endpoint


def resource(env: Mapping[str, str]) -> dict[str, Any]:
    """The resource attributes: `OTEL_RESOURCE_ATTRIBUTES`, then the service's name
    (`OTEL_SERVICE_NAME`, default ttft-relay), version, host and process."""
    attrs: dict[str, Any] = {}
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        name, eq, value = item.partition("=")
        if eq and name.strip():
            attrs[unquote(name.strip())] = unquote(value.strip())
    attrs["service.name"] = env.get("OTEL_SERVICE_NAME", "").strip() or attrs.get("service.name") or "ttft-relay"
    attrs.setdefault("service.version", _version())
    attrs.setdefault("host.name", os.uname().nodename)
    attrs["process.pid"] = os.getpid()
    attrs["telemetry.sdk.name"] = SCOPE_NAME
    attrs["telemetry.sdk.language"] = "python"
    return attrs


def _version() -> str:
    try:
        return metadata.version("ttft-relay")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(slots=True)
class Queued:
    """A published record and what its spans need besides it."""

    rec: record.Record
    trace: otlp.Trace
    origin_s: float
    port: int | None
    method: str | None
    semconv: tuple[str, str]
    """The API's (`Api.semconv`): the record keeps only its name."""

    @property
    def size(self) -> int:
        """What the record holds in memory and its spans on the wire, roughly: a fixed part for
        the numbers, the strings by their length."""
        rec = self.rec
        return 2048 + sum(len(text) for text in (rec.model, rec.upstream, rec.error, rec.request_id,
                                                  rec.upstream_request_id, self.trace.tracestate) if text)


CUT_FIELDS = ("model", "upstream", "request_id", "upstream_request_id")


def with_fields_cut(rec: record.Record) -> record.Record:
    """`rec`, or a copy of it whose client-given strings are cut to FIELD_MAX (a name of 200 KB
    in every span of every record would make the queue and each batch that size)."""
    long = [name for name in CUT_FIELDS if len(getattr(rec, name) or "") > FIELD_MAX]
    if not long:
        return rec
    cut = copy.copy(rec)
    for name in long:
        setattr(cut, name, cut_text(getattr(rec, name), FIELD_MAX))
    return cut


class Exporter:
    """The batching thread: `put` (event loop) only appends to a bounded deque."""

    def __init__(self, settings: Settings, resource: Mapping[str, Any],
                 on_dropped: Callable[[str, int], object] | None = None) -> None:
        self.settings = settings
        self.resource = dict(resource)
        self.on_dropped = on_dropped
        self.queue: deque[Queued] = deque()
        self.put_bytes = 0
        """Sizes of the records queued so far (written by `put` only) ..."""
        self.taken_bytes = 0
        """... and of those the thread took (written by the thread only): no lock between them."""
        self.exported = 0
        """Records the collector took (for tests and the log)."""
        self.dropped: dict[str, int] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._failing = False
        self._overflowing = False
        self._conn: http_client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, name="ttft-relay-otlp", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self.put_bytes - self.taken_bytes

    def put(self, item: Queued) -> None:
        item.rec = with_fields_cut(item.rec)
        size = item.size
        if len(self.queue) >= QUEUE_MAX or self.queued_bytes + size > QUEUE_BYTES_MAX:
            if not self._overflowing:
                self._overflowing = True
                logger.warning("OTLP export queue full (%d records, %d KiB): dropping traces until the collector "
                               "at %s catches up (counted in ttft_relay_otlp_dropped_records_total)",
                               len(self.queue), self.queued_bytes // 1024, self.settings.endpoint)
            self._drop(DROP_QUEUE_FULL, 1)
            return
        self.put_bytes += size
        self.queue.append(item)
        if len(self.queue) >= BATCH_MAX:
            self._wake.set()

    def close(self) -> None:
        """Send what is queued (one try, SHUTDOWN_S at most) and stop the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(SHUTDOWN_S + 1)

    def _drop(self, reason: str, n: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n
        if self.on_dropped is not None:
            self.on_dropped(reason, n)

    def _run(self) -> None:
        while True:
            self._wake.wait(SCHEDULE_S)
            self._wake.clear()
            stopping = self._stopping
            while self.queue:
                batch = [self.queue.popleft() for _ in range(min(BATCH_MAX, len(self.queue)))]
                self.taken_bytes += sum(item.size for item in batch)
                try:
                    body = self.encode(batch)
                except Exception:  # a bug here must cost spans, never the thread
                    logger.exception("OTLP: could not encode %d records", len(batch))
                    self._drop(DROP_REJECTED, len(batch))
                    continue
                self._send(body, len(batch), retry=not stopping)
            if stopping:
                self._close_connection()
                return

    def encode(self, batch: list[Queued]) -> bytes:
        encoded = []
        for item in batch:
            time.sleep(0)  # the GIL back to the event loop between records: a batch never holds it long
            rec = item.rec.as_dict()
            for span in otlp.spans(rec, item.trace, origin_s=item.origin_s, semconv=item.semconv,
                                   server_port=item.port, method=item.method):
                encoded.append(otlp.encode_span(span, item.trace))
        return otlp.export_request(self.resource, (SCOPE_NAME, self.resource.get("service.version", "")), encoded)

    def _send(self, body: bytes, records: int, retry: bool) -> None:
        s = self.settings
        headers = {**s.headers, "Content-Type": "application/x-protobuf"}
        if s.gzip:
            body = gzip.compress(body, 6)
            headers["Content-Encoding"] = "gzip"
        waits = RETRIES if retry else ()
        for attempt in range(len(waits) + 1):
            status, problem = self._post(body, headers, SHUTDOWN_S if self._stopping else s.timeout_s)
            if status is not None and 200 <= status < 300:
                self.exported += records
                if self._failing or self._overflowing:
                    logger.info("OTLP export to %s works again", s.endpoint)
                self._failing = self._overflowing = False
                return
            if status is not None and status not in RETRYABLE:
                self._fail(f"the collector refused the spans: {problem}", DROP_REJECTED, records)
                return
            if attempt < len(waits) and not self._stopping:
                time.sleep(waits[attempt])
        self._fail(problem or "no answer", DROP_EXPORT_FAILED, records)

    def _fail(self, problem: str, reason: str, records: int) -> None:
        if not self._failing:
            self._failing = True
            logger.warning("OTLP export to %s failed (%s): dropping traces until it works "
                           "(counted in ttft_relay_otlp_dropped_records_total)", self.settings.endpoint, problem)
        self._drop(reason, records)

    def _post(self, body: bytes, headers: dict[str, str], timeout: float) -> tuple[int | None, str]:
        """(status, what went wrong) of one POST, all of it within `timeout`; status None: no answer."""
        url = urlsplit(self.settings.endpoint)
        host = url.hostname or ""  # `settings` checked there is one
        watchdog: threading.Timer | None = None
        try:
            if self._conn is None:
                if url.scheme == "https":
                    context = ssl.create_default_context(cafile=self.settings.ca_file)
                    self._conn = http_client.HTTPSConnection(host, url.port, timeout=timeout, context=context)
                else:
                    self._conn = http_client.HTTPConnection(host, url.port, timeout=timeout)
            conn = self._conn
            conn.timeout = timeout
            if conn.sock is None:
                conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(timeout)
            watchdog = threading.Timer(timeout, _shut, (conn.sock,))
            watchdog.daemon = True
            watchdog.start()
            conn.request("POST", url.path + (f"?{url.query}" if url.query else ""), body, headers)
            response = conn.getresponse()
            reply = response.read(REPLY_MAX)
            if not response.isclosed() or response.will_close or not watchdog.is_alive():
                # More than REPLY_MAX (a collector may send without end), or cut by the watchdog:
                # the rest stays unread, and the connection goes with it.
                self._close_connection()
            detail = cut_text(reply.decode("utf-8", "replace").strip(), REPLY_QUOTED)
            return response.status, f"HTTP {response.status}" + (f" {detail!r}" if detail else "")  # one line
        except (OSError, http_client.HTTPException, ValueError) as e:
            self._close_connection()
            problem = "no answer within the timeout" if watchdog is not None and not watchdog.is_alive() else str(e)
            return None, printable(cut_text(f"{type(e).__name__}: {problem}", REPLY_QUOTED))
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _shut(sock: socket.socket) -> None:
    """The watchdog's: a POST's deadline passed; whatever read or write waits on `sock` ends now."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already: the POST ended on its own


class Traces:
    """Every record as an OpenTelemetry trace over OTLP/HTTP, and W3C trace context passed on."""

    def __init__(self, on_dropped: Callable[[str, int], object] | None = None) -> None:
        self.on_dropped = on_dropped
        """Told of every drop (reason, records): the metrics addon's counter."""
        self.exporter: Exporter | None = None
        self.propagate = Propagation.parse(DEFAULT_PROPAGATE)
        self.traces: weakref.WeakKeyDictionary[http.HTTPFlow, otlp.Trace] = weakref.WeakKeyDictionary()

    def load(self, loader) -> None:
        loader.add_option(
            "relay_otlp_endpoint",
            str,
            "",
            "Send every record as an OpenTelemetry trace to this OTLP/HTTP endpoint (protobuf), e.g. "
            "http://127.0.0.1:4318 (/v1/traces is added to an address alone). Empty: the standard "
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables, else off. Headers "
            "(a collector's key) only from OTEL_EXPORTER_OTLP_HEADERS.",
        )
        loader.add_option(
            "relay_otlp_propagate",
            str,
            DEFAULT_PROPAGATE,
            "While exporting traces: the upstreams the trace is passed to in traceparent / tracestate, so that a "
            "next hop that traces (another ttft-relay) joins it: 'private' (upstreams on loopback or a private "
            "network, the default), a comma-separated list of hosts (host or host:port, 'private' among them if "
            "wanted), 'all', or 'off'; true and false mean all and off. Elsewhere the request's headers are left "
            "as the client sent them.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_otlp_propagate" in updated:
            try:
                self.propagate = Propagation.parse(ctx.options.relay_otlp_propagate)
            except ValueError as e:
                raise exceptions.OptionsError(str(e)) from None
        if "relay_otlp_endpoint" not in updated:
            return
        try:
            found = settings(ctx.options.relay_otlp_endpoint, os.environ)
        except ValueError as e:
            if ctx.options.relay_otlp_endpoint.strip():
                raise exceptions.OptionsError(str(e)) from None
            logger.error("OpenTelemetry traces off: %s", e)  # a variable: the relay runs without traces
            found = None
        self._stop()
        if found is None:
            return
        for warning in found.warnings:
            logger.warning("OpenTelemetry traces: %s", warning)
        self.exporter = Exporter(found, resource(os.environ), self.on_dropped)
        logger.info("OpenTelemetry traces to %s (from %s)", found.endpoint, found.source)

    def done(self) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.exporter is None or state.get(flow) is None:
            return
        headers = flow.request.headers
        trace = otlp.start(otlp.parse_traceparent(headers.get("traceparent"), headers.get("tracestate")),
                           _ids.randbytes)
        self.traces[flow] = trace
        if self.propagate.to(flow.request.host, flow.request.port):
            headers["traceparent"] = otlp.traceparent(trace)
            headers["tracestate"] = trace.tracestate

    def timing_record(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        if (exporter := self.exporter) is None or (st := state.get(flow)) is None:
            return
        trace = self.traces.get(flow)
        if trace is None:  # its head came before exporting began, or it never had one (a failed CONNECT)
            trace = self.traces[flow] = otlp.start(None, _ids.randbytes)
        if rec.turn:  # a WebSocket turn: its own trace, derived from the handshake's
            trace = otlp.turn(trace, rec.turn, _ids.randbytes)
        if not trace.sampled:
            return
        origin = rec.ts if rec.turn else flow.request.timestamp_start
        exporter.put(Queued(rec, trace, origin, flow.request.port, flow.request.method if not rec.turn else None,
                            st.api.semconv))
