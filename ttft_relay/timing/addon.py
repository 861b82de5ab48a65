"""Timing: where each LLM call's time went, one record per flow (or WebSocket turn).

The addon collects marks on the flow's timeline from mitmproxy's timestamps, its
own `request` hook and the stream watcher, and when the flow ends (`response`,
or `error` for failures and client aborts) turns them into one record
(a frozen `record.Record`, judged once: see `Timing.publish`), shown as the flow's comment in
mitmweb (slow flows marked) and kept as plain data (`Record.as_dict()`) in
`flow.metadata["ttft_relay"]`, which survives saving flows. A `Server-Timing` header tells the client the phases known when
the head leaves.

Every record — an HTTP flow's, a WebSocket handshake's, each WebSocket turn's
(`ttft_relay/stream/websocket.py`) — leaves through `Timing.publish`: measured
(`record.measure`), shown to the observers Timing was made with (`Observer`,
`ttft_relay/observe/`: the verdicts, the attempt groups), each of which says what it
learned across records (`record.Learned`), judged once with all of it (`record.judged`),
and the frozen record is appended to `relay_timing_log`, logged as a console line, and
handed to every addon that implements the `timing_record(record, flow)` hook (metrics,
traces, the ledger).

Ordering: the `request` hook marks `forwarded`, the moment the request leaves
the relay's hands, so this addon must come after every addon that works on the
request (trim) in relay.py's list.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson
from mitmproxy import command, connection, ctx, exceptions, flow, hooks, http
from mitmproxy.proxy import mode_specs, server_hooks
from mitmproxy.utils import human

from .. import dial, state, tls_resumption
from ..apis.api import Api
from ..flows import carries_body, upstream_name
from ..patches import error_texts
from ..patches.speed import splice, upstream_pool
from . import logrotation, phases, record

logger = logging.getLogger(__name__)


class Observer(Protocol):
    """An addon that watches many records (`ttft_relay/observe/`) and says what it learned
    across them that a record's verdict or fields take: the expected first token, a prompt
    cache miss, the attempt group. Shown each record before it is judged; what it returns
    is judged with what the others returned (their parts do not overlap)."""

    def observe(self, rec: record.Record, flow: http.HTTPFlow) -> record.Learned: ...

    def pending(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """What the observer still waits for before it can observe the flow's record (a read
        of what other processes learned, started while the request ran), or None: ready."""


@dataclass
class TimingRecordHook(hooks.Hook):
    """A timing record is finished (`record.Record`); `flow` the HTTP flow it describes,
    or the WebSocket flow a turn ran on. Each record is published exactly once."""

    record: record.Record
    flow: http.HTTPFlow


_CHECKOUT = Path(__file__).resolve().parent.parent.parent
DEFAULT_LOG = (_CHECKOUT if (_CHECKOUT / "mitm.conf").exists() else Path.cwd()) / "logs" / "timing.jsonl"
"""In a checkout its logs/ folder; for an installed package logs/ in the working directory."""
METADATA_KEY = "ttft_relay"
SLOW_MARKER = ":warning:"
"""mitmweb shows a mark as an emoji from its table; ⚠ (U+26A0) has a text form that
ordinary fonts (DejaVu, Liberation's fallbacks) draw, where 🐢 needs an emoji font."""
OBSERVERS_WAIT_S = 0.5
"""The longest a record waits for its observers (`Observer.pending`): a store that slow to read
is a sick disk, and the record goes out without what it would have said."""
SHUTDOWN_ERROR = phases.RELAY_SHUTTING_DOWN
"""The error of a flow the relay ended because it stops (`faults.Shutdown`)."""
RTT_SAMPLES = 16
"""Handshakes per upstream whose round trips are remembered; the estimate is their minimum."""


class Timing:
    def __init__(self, observers: Sequence[Observer] = ()) -> None:
        self.observers = tuple(observers)
        """Shown every record before it is judged (`Observer`)."""
        self.writer: record.RecordWriter | None = None
        self.slow_ms = 0
        self.console = True
        self.console_lines = record.ConsoleLines(logger)
        self.server_timing = True
        self.rtt_samples: dict[str, deque[float]] = {}
        """Recent handshake round trips per upstream, learned from new connections, used for all.
        Their minimum is the estimate: a handshake can only take longer than the path's
        round trip (a busy event loop, a slow server), never shorter, as TCP's own
        min-RTT filter assumes."""
        self.used_connections: set[str] = set()
        """Ids of open upstream connections that already carried a request."""
        self.in_flight: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
        """In-scope flows without a record yet: at `done` each gets one."""
        self.settling: dict[http.HTTPFlow, tuple[asyncio.TimerHandle | asyncio.Future, dict[str, float]]] = {}
        """Finished flows whose record waits for the self-watch's link figures (`FlowState.settle`)
        or for an observer (`Observer.pending`), with the timer that asks again or the task that
        waits, and their marks."""
        self.settling_on: dict[str, http.HTTPFlow] = {}
        """Per client connection id, its flow whose record waits so."""
        self.served_clients: set[str] = set()
        """Ids of open client connections whose first request has been seen."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_timing_log",
            str,
            str(DEFAULT_LOG),
            "Append one JSON timing record per LLM call to this file (created if "
            "missing); empty to keep no log. Setting it again (SIGHUP does) reopens the file.",
        )
        loader.add_option(
            "relay_timing_log_max_size",
            str,
            "0",
            "Rotate the timing log before it grows past this size (e.g. 100m, 1g); 0: never by size.",
        )
        loader.add_option(
            "relay_timing_log_rotate_every",
            str,
            "",
            "Rotate the timing log at each UTC boundary of this period (e.g. 1d: midnight UTC, 6h); "
            "empty: never by time.",
        )
        loader.add_option(
            "relay_timing_log_keep",
            int,
            30,
            "Rotated timing logs (gzip-compressed) kept, oldest deleted first; 0 keeps all.",
        )
        loader.add_option(
            "relay_slow_ms",
            int,
            3000,
            "Mark flows in mitmweb whose time to first token is at least this many ms; 0 marks none.",
        )
        loader.add_option(
            "relay_timing_console", bool, True, "Log a one-line timing summary per LLM call."
        )
        loader.add_option(
            "relay_server_timing",
            bool,
            True,
            "Add a Server-Timing header with the relay's phases to responses.",
        )

    def configure(self, updated: set[str]) -> None:
        if updated & self.LOG_OPTIONS:
            self._configure_log()
        if "relay_slow_ms" in updated:
            self.slow_ms = ctx.options.relay_slow_ms
        if "relay_timing_console" in updated:
            self.console = ctx.options.relay_timing_console
        if "relay_server_timing" in updated:
            self.server_timing = ctx.options.relay_server_timing

    LOG_OPTIONS = {"relay_timing_log", "relay_timing_log_max_size", "relay_timing_log_rotate_every",
                   "relay_timing_log_keep"}

    def _configure_log(self) -> None:
        opts = ctx.options
        try:
            rotation = logrotation.Rotation(human.parse_size(opts.relay_timing_log_max_size) or 0,
                                            logrotation.parse_duration(opts.relay_timing_log_rotate_every),
                                            opts.relay_timing_log_keep)
        except ValueError as e:
            raise exceptions.OptionsError(f"timing log rotation: {e}") from e
        path = opts.relay_timing_log
        writer = self.writer
        if writer is not None and path and Path(path) == writer.path and rotation == writer.rotation:
            writer.reopen()  # the same log named again: logrotate may have renamed it
            return
        self._close_writer()
        if path:
            try:
                self.writer = record.RecordWriter(path, rotation)
            except OSError as e:  # one line, not a traceback (at start mitmproxy then exits)
                where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
                raise exceptions.OptionsError(f"relay_timing_log: cannot write {path}: {e.strerror or e}{where}") from None

    def done(self) -> None:
        # mitmproxy runs `done` before it cancels the connections, whose flows would
        # only then reach `error`: record them now, while the writer is open.
        # `faults.Shutdown` (earlier in the chain) has ended what it could end cleanly.
        for live in list(self.in_flight):
            if (st := state.get(live)) is not None:
                st.record_error(SHUTDOWN_ERROR)  # in the phase it was in: its time went there
                state.mark(live, "end", time.time())
                self._finish(live)
        for waiting, (timer, marks) in list(self.settling.items()):
            timer.cancel()
            self._record(waiting, marks, settled=True)
        self.console_lines.flush()
        self._close_writer()

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        if (earlier := self.settling_on.pop(client.id, None)) is not None and earlier in self.settling:
            # The connection's next request: the self-watch made the earlier one's figures
            # final (it comes first); its record goes first too.
            timer, marks = self.settling[earlier]
            timer.cancel()
            self._record(earlier, marks, settled=True)
        if state.get(flow) is None:
            return
        self.in_flight.add(flow)
        if client.id not in self.served_clients:
            # The connection's first request: its set-up is before it (`phases.SETUP_PHASE`).
            self.served_clients.add(client.id)
            state.mark(flow, "client_connect", client.timestamp_start)
            if client.timestamp_tls_setup is not None:
                state.mark(flow, "client_tls", client.timestamp_tls_setup)

    def client_disconnected(self, client: connection.Client) -> None:
        self.served_clients.discard(client.id)
        self.settling_on.pop(client.id, None)

    def request(self, flow: http.HTTPFlow) -> None:
        state.mark(flow, "forwarded", time.time())

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or flow.response is None:
            return
        self._connection_marks(flow, st)
        if self.server_timing and carries_body(flow.request, flow.response):
            # Not on an upgrade or a bodiless answer: those pass exactly as received.
            marks = phases.relative_marks(self._marks(flow, st), flow.request.timestamp_start)
            value = phases.server_timing(phases.compute(marks, tokens_expected=False))
            if value:
                flow.response.headers["server-timing"] = value

    def response(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)  # a failed CONNECT that faults.FailedConnects took in

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.used_connections.discard(data.server.id)

    @command.command("relay.summary")
    def summary(self, flows: Sequence[flow.Flow]) -> str:
        """The timing summary of each selected flow, one line per flow."""
        lines = []
        for f in flows:
            rec = f.metadata.get(METADATA_KEY)
            lines.append(record.summary_line(rec) if rec else f"{f.id}: no timing record (in flight, or not an LLM call)")
        text = "\n".join(lines)
        logger.info(text)
        return text

    def _connection_marks(self, flow: http.HTTPFlow, st: state.FlowState) -> None:
        """Mark the upstream connect and handshake if this flow's request is the
        first the connection carried; learn the upstream's round trip from them.

        Read late (response head or error): mitmproxy replaces `flow.server_conn`
        when it picks the connection after the request hooks. With HTTP/2
        multiplexing the first flow to get its response head claims a new
        connection.
        """
        conn = flow.server_conn
        if conn.timestamp_start is None or "upstream_connect_start" in st.marks:
            return
        if conn.id in self.used_connections:
            return
        self.used_connections.add(conn.id)
        if conn.timestamp_start < flow.client_conn.timestamp_start:
            # Opened before this client connected (the upstream pool's): no connect of this
            # request's; its handshake still tells the upstream's round trip.
            own = {name: t for name, t in (("upstream_connect_start", conn.timestamp_start),
                                           ("upstream_tcp", conn.timestamp_tcp_setup),
                                           ("upstream_tls", conn.timestamp_tls_setup)) if t is not None}
            self._learn_rtt(flow, phases.relative_marks(own, conn.timestamp_start), conn.tls_version)
            return
        state.mark(flow, "upstream_connect_start", conn.timestamp_start)
        if conn.timestamp_tcp_setup is not None:
            state.mark(flow, "upstream_tcp", conn.timestamp_tcp_setup)
        if conn.timestamp_tls_setup is not None:
            state.mark(flow, "upstream_tls", conn.timestamp_tls_setup)
        self._learn_rtt(flow, phases.relative_marks(st.marks, flow.request.timestamp_start), conn.tls_version)

    def _learn_rtt(self, flow: http.HTTPFlow, marks: dict[str, float], tls_version: str | None) -> None:
        sample = phases.handshake_rtt_ms(marks, tls_version)
        if sample is not None:
            host = upstream_name(flow)
            self.rtt_samples.setdefault(host, deque(maxlen=RTT_SAMPLES)).append(sample)

    def _marks(self, flow: http.HTTPFlow, st: state.FlowState) -> dict[str, float]:
        """The flow's absolute marks so far: mitmproxy's timestamps, the relay's, the watcher's."""
        marks = dict(st.marks)
        if flow.request.timestamp_end is not None:
            marks.setdefault("request_body", flow.request.timestamp_end)
        if flow.response is not None:
            marks.setdefault("response_head", flow.response.timestamp_start)
        if (w := st.watcher) is not None:
            for name in ("first_byte", "longest_gap", "first_event", "first_token", "last_token"):
                if (t := getattr(w, name)) is not None:
                    marks.setdefault(name, t)
        return marks

    def _finish(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or st.recorded:
            return
        st.recorded = True
        self.in_flight.discard(flow)
        self._connection_marks(flow, st)
        marks = self._marks(flow, st)
        if flow.error is not None:
            marks.setdefault("end", flow.error.timestamp)
        elif flow.response is not None and flow.response.timestamp_end is not None:
            marks.setdefault("end", flow.response.timestamp_end)
        # An upgrade's record goes at once: its turns' records (which never wait) come after it.
        upgraded = flow.response is not None and flow.response.status_code == 101
        waits = [] if upgraded else [w for observer in self.observers if (w := observer.pending(flow)) is not None]
        if waits:
            # An observer still waits for what the record needs (a read of the store quicker
            # answers beat): the record waits, never the answer (its end is sent after this hook).
            self.settling[flow] = (asyncio.ensure_future(self._record_when_observed(flow, marks, waits)), marks)
            return
        self._record(flow, marks)

    async def _record_when_observed(self, flow: http.HTTPFlow, marks: dict[str, float],
                                    waits: list[Awaitable[None]]) -> None:
        """Record the flow once its observers are ready (`Observer.pending`), at most
        OBSERVERS_WAIT_S later. A stop meanwhile (`done`) cancels this and records it itself."""
        try:
            async with asyncio.timeout(OBSERVERS_WAIT_S):
                await asyncio.gather(*waits)
        except TimeoutError:
            logger.debug("flow %s recorded before its observers were ready", flow.id)
        self._record(flow, marks)

    def _record(self, flow: http.HTTPFlow, marks: dict[str, float], *, settled: bool = False) -> None:
        """Build and publish the flow's record once the self-watch's figures are final:
        until `FlowState.settle` says so, ask again after the time it names."""
        st = state.get(flow)
        assert st is not None  # _finish checked
        self.settling.pop(flow, None)
        if self.settling_on.get(flow.client_conn.id) is flow:
            del self.settling_on[flow.client_conn.id]
        if st.settle is not None and not settled:
            wait = st.settle()
            if wait is not None:
                try:
                    timer = asyncio.get_running_loop().call_later(wait, self._record, flow, marks)
                except RuntimeError:  # no event loop (a unit test): what is known now is final
                    pass
                else:
                    self.settling[flow] = (timer, marks)
                    self.settling_on[flow.client_conn.id] = flow
                    return
        st.settle = None
        rec = self._measure(flow, st, phases.relative_marks(marks, flow.request.timestamp_start))
        data = flow.metadata[METADATA_KEY] = self.publish(rec, flow)
        slow = self.is_slow(rec)
        flow.comment = record.comment(data, slow=slow)
        if slow:
            flow.marked = SLOW_MARKER

    def publish(self, measured: record.Record, flow: http.HTTPFlow) -> dict[str, Any]:
        """Judge a measured record (`record.measure`) once with what the observers learned,
        and send it to every sink: the log, the console, the `timing_record` hook. Returns
        its plain-data form (the JSON line's), for the flow's comment."""
        rec = record.judged(measured, self.learned(measured, flow))
        data = rec.as_dict()  # once: a dict serialises faster than the dataclass
        if self.writer is not None:
            self.writer.write(data)
        if self.console and logger.isEnabledFor(logging.INFO):
            self.console_lines.add(record.summary_line(data))
        ctx.master.addons.trigger(TimingRecordHook(rec, flow))
        return data

    def learned(self, rec: record.Record, flow: http.HTTPFlow) -> record.Learned:
        """What the observers say they learned of the record, all of it."""
        learned = record.NOTHING_LEARNED
        for observer in self.observers:
            try:
                learned = learned.merged(observer.observe(rec, flow))
            except Exception:  # as mitmproxy treats a failing hook: said, and the record still goes out
                logger.exception("%s failed to observe record %s", type(observer).__name__, rec.id)
        return learned

    def upstream_rtt_ms(self, upstream: str) -> float | None:
        """The round-trip estimate for an upstream ("host[:port]"), or None before any handshake."""
        samples = self.rtt_samples.get(upstream)
        return min(samples) if samples else None

    def is_slow(self, rec: record.Record) -> bool:
        """A first token at least `relay_slow_ms` late; a prewarm turn asks for no token."""
        return bool(self.slow_ms) and not rec.prewarm and (rec.ttft_ms or 0) >= self.slow_ms

    def _measure(self, flow: http.HTTPFlow, st: state.FlowState, marks: dict[str, float]) -> record.Record:
        # A CONNECT's response is the proxy's own, never the upstream's.
        response = flow.response if flow.request.method != "CONNECT" else None
        status = response.status_code if response is not None else None
        if (response is not None and flow.error is not None and not response.stream
                and flow.error.msg != error_texts.KILLED):  # killed: the relay answered it itself
            # The upstream's head was held for its body, which failed: the client got the relay's error.
            status = st.error_status or 502
        w = st.watcher
        client_aborted = False
        # What mitmproxy and the stream say, after what the relay recorded (`FlowState.record_error`).
        if flow.error is not None:
            gone = error_texts.client_gone(flow.error.msg)
            # A client that hangs up after the API's terminal event had the whole answer (Codex stops
            # reading at response.completed, before the body's end): neither an error nor an abort.
            if not (gone and w is not None and w.done):
                st.record_error(flow.error.msg)
                client_aborted = gone
        if w is not None and w.error:
            st.record_error(w.error)
        if status is not None and status >= 400:
            # The upstream (or the relay) answered with a failure instead of waiting on.
            st.record_error(f"HTTP {status}", phase="upstream_wait")
        upstream = upstream_name(flow)
        websocket = st.transport == record.WEBSOCKET
        head = upstream_headers(flow.response)
        return record.measure(record.RecordInput(
            id=flow.id,
            ts=flow.request.timestamp_start,
            api=st.api.name,
            model=st.model,
            stream=st.stream,
            status=status,
            upstream=upstream,
            marks=marks,
            tokens_expected=st.stream and w is not None,
            tls_expected=flow.request.scheme == "https",
            reused_connection=None if flow.server_conn.timestamp_start is None else "upstream_connect_start" not in marks,
            upstream_connection=upstream_pool.connection_id(flow.server_conn),
            upstream_dial=dialled.as_record() if "upstream_connect_start" in marks
            and (dialled := dial.of(flow.server_conn)) else None,
            upstream_tls_resumed=tls_resumption.resumed(flow.server_conn) if "upstream_tls" in marks else None,
            rtt_ms=self.upstream_rtt_ms(upstream),
            max_gap_ms=w.max_gap * 1000 if w is not None else None,
            chunks=w.chunks if w is not None else None,
            bytes=w.bytes if w is not None else None,
            token_events=w.token_events if w is not None else None,
            prompt_tokens=st.prompt_tokens,
            usage=w.usage if w is not None else body_usage(st.api, flow.response),
            error=st.error,
            error_phase=st.error_phase,
            client_aborted=client_aborted,
            trim=st.trim,
            route=st.route,
            request_id=flow.request.headers.get("x-request-id"),
            transport=st.transport,
            turn=0 if websocket else None,
            body_path=splice.body_path(flow) if flow.response is not None else None,
            upstream_request_id=upstream_request_id(head),
            upstream_processing_ms=upstream_processing_ms(head),
            links=st.links,
            client_setup_round_trips=client_setup_round_trips(flow) if "client_connect" in marks else None,
        ))


def client_setup_round_trips(flow: http.HTTPFlow) -> int:
    """The client's round trips in its connection's set-up after the TCP handshake: a CONNECT
    (an HTTPS request through the proxy listener), its TLS handshake with the relay (one round
    trip for TLS 1.3, two before)."""
    client = flow.client_conn
    trips = 0
    if client.tls_established:
        trips += 1 if client.tls_version in (None, "TLSv1.3") else 2
    if isinstance(client.proxy_mode, mode_specs.RegularMode) and flow.request.scheme == "https":
        trips += 1
    return trips


UPSTREAM_REQUEST_ID_HEADERS = ("x-request-id", "request-id")
"""OpenAI (and most OpenAI-compatible APIs), Anthropic."""
PROCESSING_MS_HEADER = "openai-processing-ms"
_UPSTREAM_HEADERS = {name.encode(): name for name in (*UPSTREAM_REQUEST_ID_HEADERS, PROCESSING_MS_HEADER)}


def upstream_headers(response: http.Response | None) -> dict[str, str]:
    """The response head's headers the record reads, as `headers.get` gives each (its
    values folded with ", "), in one pass over the raw fields: each `headers.get` is a
    pass of its own, costlier than the rest of what they are read for."""
    found: dict[str, list[bytes]] = {}
    for key, value in response.headers.fields if response is not None else ():
        if (name := _UPSTREAM_HEADERS.get(key.lower())) is not None:
            found.setdefault(name, []).append(value)
    return {name: ", ".join(v.decode("utf-8", "surrogateescape") for v in values) for name, values in found.items()}


def upstream_request_id(headers: dict[str, str]) -> str | None:
    """The upstream's own id for the request, from its response head (`upstream_headers`)."""
    return next((v for name in UPSTREAM_REQUEST_ID_HEADERS if (v := headers.get(name))), None)


def upstream_processing_ms(headers: dict[str, str]) -> float | None:
    """How long the upstream says it worked before its head (`openai-processing-ms`)."""
    value = headers.get(PROCESSING_MS_HEADER)
    try:
        ms = float(value) if value is not None else None
    except ValueError:
        return None
    return ms if ms is not None and 0 <= ms < 1e9 else None


def body_usage(api: Api, response: http.Response | None) -> dict[str, int] | None:
    """Usage from a response body that was not streamed (and so is at hand)."""
    if response is None or response.raw_content is None:
        return None
    if "json" not in response.headers.get("content-type", ""):
        return None
    try:
        body = orjson.loads(response.get_content(strict=False) or b"null")
    except orjson.JSONDecodeError:
        return None
    return api.reader.usage_from_body(body)
