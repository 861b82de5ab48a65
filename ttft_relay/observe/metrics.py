"""Metrics: the timing records as Prometheus histograms, for dashboards that exist already.

One scrape endpoint (`relay_metrics_listen`, loopback by default) serves, per finished
LLM call (each timing record):

    gen_ai_server_time_to_first_token_seconds    successful calls: request head → first token
    gen_ai_server_time_per_output_token_seconds  successful calls: (total - ttft) / (output tokens - 1)
    gen_ai_client_operation_duration_seconds     every call: request head → end (error_type label)
    gen_ai_client_token_usage                    tokens the upstream reported, gen_ai_token_type=input|output
    ttft_relay_<phase>_seconds                   the relay's phases: upstream_connect, upstream_tls,
                                                 upstream_upload (the request's upload beyond its first
                                                 flight: the link's), upstream_wait, head_to_first_token
                                                 (the prefill of an upstream that sends its head at once),
                                                 client_upload, relay, relay_queue
    ttft_relay_expected_time_to_first_token_seconds  successful calls whose prompt's first token the relay
                                                 has learned to predict: that prediction (observe/prefill.py)
    ttft_relay_trimmed_tokens_total              prompt tokens the trimmer removed
    ttft_relay_upstream_member_time_to_first_token_seconds  an upstream group's member's own first
                                                 tokens (`ttft_relay/route/`): successful calls it
                                                 answered without a failover before it; by group, member
    ttft_relay_upstream_choices_total            requests a group sent to a member first, by group,
                                                 member and reason (record.ROUTE_REASONS)
    ttft_relay_upstream_failovers_total          members left before the answer's head, by group,
                                                 from_member and cause (record.FAILOVER_CAUSES)
    ttft_relay_upstream_duplicated_prompt_tokens_total  the prompt tokens of those abandoned attempts
                                                 (sent again to the next member), same labels; a
                                                 hedge's losing attempt: cause "hedge"
    ttft_relay_upstream_hedges_total             requests a group hedged (sent to the next member as
                                                 well), by group, from_member and won (first, second)
    ttft_relay_upstream_late_heads_waited_total  late heads a group waited for, no other member
                                                 expected sooner (`route.not_hedged`, `not_given_up`):
                                                 by group, member and instead_of (hedge, slow_head)
    ttft_relay_event_loop_lag_seconds            the relay's event-loop lag, sampled continuously
                                                 (selfwatch): how late ready work runs
    ttft_relay_gc_pause_seconds                  each garbage collection of the relay's process, by
                                                 generation (0-2): a pause every live stream waits for
    ttft_relay_accept_queue_connections          connections waiting to be accepted, per listener
    ttft_relay_requests_in_flight                requests begun and not yet recorded (what a worker
                                                 killed now would take with it, unrecorded)
    ttft_relay_otlp_dropped_records_total        records whose trace was not exported (observe/traces.py),
                                                 by reason: queue_full, export_failed, rejected
    ttft_relay_learned_context_window_tokens     each window learned from a provider's refusal
                                                 (trim/windows.py), read from the store at each scrape:
                                                 server_address, gen_ai_request_model, limit (max_input
                                                 or window), confirmed (yes, or no: for the key with
                                                 digest learned_from only), learned_from;
                                                 at most windows.MAX_ENTRIES series
    ttft_relay_learned_entries                   what the store beside the timing log holds (store.py),
    ttft_relay_learned_newest_timestamp_seconds  per kind (window, plan, first-token, attempt: the
                                                 open attempt groups): how many, and when the newest
                                                 was learned

Names and bucket boundaries are the OpenTelemetry GenAI semantic conventions'
(gen-ai-metrics.md), mapped to Prometheus (dots → underscores, unit suffix).
Labels: gen_ai_operation_name, gen_ai_provider_name (from the API shape),
gen_ai_request_model, server_address (upstream host), api, status_class (2xx, 4xx,
5xx, or "none" when no response came). At most `relay_metrics_max_series` (100) label
combinations have series of their own, the least recently used going first, and junk
(made-up models, closed ports, paths that are no API, models an upstream that answers 200
to anything "proves" beyond its quota) never pushing out a model in real use
(`series.SeriesBound`); what has no room is counted with model and host "other"; model
and host labels are cut to LABEL_MAX characters. Each combination is at most ~230 samples (every instrument, every bucket).
The upstream groups' instruments are outside that bound and need none: their group and
member labels are the operator's (`relay_upstream_groups`), never a client's, their reason
and cause a handful of words each, and they have no model label (a member's first tokens
by model are the GenAI histogram's, server_address its host[:port]): 14 counter series and
one histogram per member.

The addon takes each record from timing's `timing_record` hook (once per record, HTTP
flows and WebSocket turns alike). Under `ttft-relay run --workers N` (environment variable
`TTFT_RELAY_WORKER` set) each worker records into prometheus-client's multiprocess
directory (`PROMETHEUS_MULTIPROC_DIR`), with series that can go (`multiproc`), and the
supervisor serves the one endpoint. The endpoint (`serve`) answers `GET /metrics` only,
from one thread, and closes a connection that sends no request within
`SCRAPE_HEAD_TIMEOUT_S` (10 s) or once it is answered; of `SCRAPE_CONNECTIONS` (64) waiting
for their request, a new one closes the oldest.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from .. import state, store
from ..prefork import WORKER_ENV  # set in each worker: record, but leave serving to the supervisor
from ..apis.api import Api
from ..text import cut_text
from ..timing import phases, record
from ..trim import plans, windows
from . import attempts, multiproc, series, verdicts

logger = logging.getLogger(__name__)

LISTEN_FIX = ("To serve them, give the metrics another port (--set relay_metrics_listen=127.0.0.1:9465) "
              "or turn them off (--set relay_metrics_listen=).")
"""What a taken metrics port's warning says to do (9464 is also OpenTelemetry's exporter's
default: a second relay, or a collector, on the same machine takes it)."""
DEFAULT_LISTEN = "127.0.0.1:9464"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
OTHER = series.OTHER
DEFAULT_MAX_SERIES = 100
LABEL_MAX = 256
"""A client-given label value (a model name, a host) is cut to this: a 200 KB name would be in
every sample of its series and every scrape."""

# Explicit bucket boundaries of the semantic conventions.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

RELAY_PHASES = ("upstream_connect", "upstream_tls", "upstream_upload", "upstream_wait", "head_to_first_token",
                "client_upload", "relay", "relay_queue")
ALWAYS_OBSERVED = ("relay_queue",)
"""Phases observed as 0 for the calls that did not have them: relay_queue exists only for
requests whose bytes the kernel held, and a series born with its first queued call would
have that call missed by rate() (which counts increases after a series' first sample)."""
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LABELS = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "server_address", "api",
          "status_class")


def status_class(status: int | None) -> str:
    return f"{status // 100}xx" if status else "none"


IN_FLIGHT = "ttft_relay_requests_in_flight"


class RelayMetrics:
    """The relay's instruments in one registry, and how a timing record feeds them (pure)."""

    def __init__(self, registry: CollectorRegistry, max_series: int = DEFAULT_MAX_SERIES) -> None:
        if (directory := os.environ.get(MULTIPROC_ENV)) is not None:
            multiproc.install(directory)  # before the first instrument: its values must be forgettable
        self.registry = registry
        self.series = series.SeriesBound(max_series)
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                              "Time to first token of successful LLM calls, from the request head reaching the relay.",
                              LABELS, registry=registry, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                              "Time per output token after the first, of successful LLM calls.",
                              LABELS, registry=registry, buckets=TPOT_BUCKETS)
        self.duration = Histogram("gen_ai_client_operation_duration_seconds",
                                  "LLM call duration through the relay, request head to end; error_type names the "
                                  "phase a failed call failed in.",
                                  (*LABELS, "error_type"), registry=registry, buckets=DURATION_BUCKETS)
        self.tokens = Histogram("gen_ai_client_token_usage", "Tokens per LLM call, as reported by the upstream.",
                                (*LABELS, "gen_ai_token_type"), registry=registry, buckets=TOKEN_BUCKETS)
        self.phases = {
            name: Histogram(f"ttft_relay_{name}_seconds", f"The relay's {name} phase (see ttft_relay/timing/phases.py).",
                            LABELS, registry=registry, buckets=TTFT_BUCKETS)
            for name in RELAY_PHASES
        }
        self.expected_ttft = Histogram("ttft_relay_expected_time_to_first_token_seconds",
                                       "The first token each successful call's prompt predicts (learned per upstream "
                                       "and model; calls before it is learned are not counted).",
                                       LABELS, registry=registry, buckets=TTFT_BUCKETS)
        self.trimmed = Counter("ttft_relay_trimmed_tokens", "Prompt tokens removed by trimming.",
                               LABELS, registry=registry)
        self.loop_lag = Histogram("ttft_relay_event_loop_lag_seconds",
                                  "How late the relay's event loop ran a timer due every 50 ms: work waiting "
                                  "for the relay itself.", registry=registry, buckets=LAG_BUCKETS)
        self.member_ttft = Histogram("ttft_relay_upstream_member_time_to_first_token_seconds",
                                     "Time to first token of an upstream group's member: successful calls it "
                                     "answered with no failover before it.", ("group", "member"),
                                     registry=registry, buckets=TTFT_BUCKETS)
        self.choices = Counter("ttft_relay_upstream_choices", "Requests an upstream group sent to a member first, "
                               "by why (" + ", ".join(record.ROUTE_REASONS) + ").",
                               ("group", "member", "reason"), registry=registry)
        self.failovers = Counter("ttft_relay_upstream_failovers", "Members an upstream group left before the "
                                 "answer's head, by cause (" + ", ".join(record.FAILOVER_CAUSES) + ").",
                                 ("group", "from_member", "cause"), registry=registry)
        self.duplicated = Counter("ttft_relay_upstream_duplicated_prompt_tokens", "Prompt tokens of the attempts "
                                  "an upstream group abandoned and sent again to the next member, by cause: a slow "
                                  "head's were sent and processed, a refused connect's never left the relay.",
                                  ("group", "from_member", "cause"), registry=registry)
        self.hedges = Counter("ttft_relay_upstream_hedges", "Requests an upstream group hedged: sent to the next "
                              "member as well when the chosen one had no head by its bound; by which head came "
                              "first (won: first, second). Both prompts paid: duplicated_prompt_tokens, cause hedge.",
                              ("group", "from_member", "won"), registry=registry)
        self.waited = Counter("ttft_relay_upstream_late_heads_waited", "Late heads an upstream group waited for "
                              "because no other member was expected to give the first token sooner than the late "
                              "one's remaining wait; by what was not done (instead_of: " +
                              ", ".join(record.WAITED_INSTEAD_OF.values()) + ").",
                              ("group", "member", "instead_of"), registry=registry)
        self.gc_pause = Histogram("ttft_relay_gc_pause_seconds",
                                  "Each garbage collection of the relay's process, by generation: a pause "
                                  "every thread and every live stream waits for.", ("generation",),
                                  registry=registry, buckets=GC_BUCKETS)
        self._children: dict[tuple, Any] = {}
        """Each instrument's child per label values, as `labels()` gives it (which checks
        and converts its arguments and takes a lock on every call)."""
        self._route_members: set[tuple[str, str]] = set()
        """The (group, member) pairs whose route counters exist."""
        self._of_series: dict[series.Labels, list[tuple[Any, tuple[str, ...]]]] = {}
        """The (instrument, label values) children of each label combination: what goes with it."""
        self.accept_queue = Gauge("ttft_relay_accept_queue_connections",
                                  "Connections the kernel holds for a listener until the relay accepts them.",
                                  # The workers share each listener's queue: each reads the same one.
                                  ("listener",), registry=registry, multiprocess_mode="livemax")
        self.in_flight = Gauge(IN_FLIGHT, "Requests the relay has begun and not yet recorded.", registry=registry,
                               multiprocess_mode="livesum")
        self.otlp_dropped = Counter("ttft_relay_otlp_dropped_records", "Records whose OpenTelemetry trace was not "
                                    "exported: queue_full, export_failed (no answer), rejected.", ("reason",),
                                    registry=registry)

    def observe_load(self, lag_s: float, accept_queues: Mapping[str, int] | None,
                     gc_pauses: Sequence[tuple[int, float]] = ()) -> None:
        """One sample of the self-watch: the loop's lag, now and then the accept queues, and
        the garbage collections since the last sample."""
        self.loop_lag.observe(lag_s)
        for generation, pause in gc_pauses:
            self._child(self.gc_pause, str(generation)).observe(pause)
        for listener, waiting in (accept_queues or {}).items():
            self.accept_queue.labels(listener).set(waiting)

    def _child(self, metric: Any, *values: str) -> Any:
        try:
            return self._children[metric, values]
        except KeyError:
            child = self._children[metric, values] = metric.labels(*values)
            self._of_series.setdefault(values[:len(LABELS)], []).append((metric, values))
            return child

    def _evict(self, labels: series.Labels) -> None:
        """A label combination's series go (`series.SeriesBound` needs its room)."""
        for metric, values in self._of_series.pop(labels, ()):
            del self._children[metric, values]
            with warnings.catch_warnings():  # prometheus-client's multiprocess warning: `multiproc` forgets it
                warnings.simplefilter("ignore", UserWarning)
                metric.remove(*values)

    def observe(self, rec: record.Record, api: Api) -> None:
        """Count a record of a request to `api` (the flow's: the record keeps only its name)."""
        operation, provider = api.semconv
        success = rec.status is not None and 200 <= rec.status < 300 and not rec.error
        labels = self.series.admit((operation, provider, cut_text(rec.model or OTHER, LABEL_MAX),
                                    cut_text(rec.upstream or OTHER, LABEL_MAX), rec.api, status_class(rec.status)),
                                   success, self._evict)
        phases = rec.phases
        failed = bool(rec.error or rec.client_aborted)
        self._child(self.duration, *labels, rec.error_phase or ("client_aborted" if failed else "")).observe(
            phases.get("total", 0.0) / 1000)
        for name in RELAY_PHASES:
            if (ms := phases.get(name, 0.0 if name in ALWAYS_OBSERVED else None)) is not None:
                self._child(self.phases[name], *labels).observe(ms / 1000)
        usage = rec.usage or {}
        for kind in ("input", "output"):
            if (n := usage.get(f"{kind}_tokens")) is not None:
                self._child(self.tokens, *labels, kind).observe(n)
        trimmed = self._child(self.trimmed, *labels)  # at 0 from the first call: rate() sees the first trim
        if (trim := rec.trim) and (before := trim.get("tokens_before")) and (after := trim.get("tokens_after")):
            if before > after:
                trimmed.inc(before - after)
        if failed or (rec.status or 0) >= 400 or (ttft := rec.ttft_ms) is None:
            return
        self._child(self.ttft, *labels).observe(ttft / 1000)
        expected = self._child(self.expected_ttft, *labels)  # from the first call on, as `trimmed`
        if rec.expected_ttft_ms is not None:
            expected.observe(rec.expected_ttft_ms / 1000)
        out = usage.get("output_tokens")
        if out and out > 1 and (total := phases.get("total")) is not None:
            self._child(self.tpot, *labels).observe((total - ttft) / 1000 / (out - 1))

    def _route_series(self, group: str, member: str) -> None:
        """A group's member's counters, each at 0 from the group's first record (as `trimmed`:
        rate() sees the first failover)."""
        if (group, member) in self._route_members:
            return
        self._route_members.add((group, member))
        for reason in record.ROUTE_REASONS:
            self._child(self.choices, group, member, reason)
        for cause in record.FAILOVER_CAUSES:
            self._child(self.failovers, group, member, cause)
            self._child(self.duplicated, group, member, cause)
        self._child(self.duplicated, group, member, record.HEDGE)
        for won in record.HEDGE_WINNERS:
            self._child(self.hedges, group, member, won)
        for instead_of in record.WAITED_INSTEAD_OF.values():
            self._child(self.waited, group, member, instead_of)

    def observe_route(self, rec: record.Record) -> None:
        """Count an upstream group's choice, failovers and their prompt tokens, and its member's
        first token (a record with `route`: one per request, a WebSocket's turns have none)."""
        route = rec.route
        if not route:
            return
        group = cut_text(str(route.get("group") or OTHER), LABEL_MAX)
        for member in route.get("expected_ms") or ():
            self._route_series(group, str(member))
        failed = route.get("failed_over") or ()
        hedged = route.get("hedged") or {}
        chosen = failed[0].get("upstream") if failed else hedged.get("from") or route.get("upstream")
        self._child(self.choices, group, str(chosen), str(route.get("reason") or OTHER)).inc()
        prompt = rec.prompt_tokens or (rec.usage or {}).get("input_tokens") or 0
        for attempt in failed:
            left = (group, str(attempt.get("upstream")), str(attempt.get("cause") or OTHER))
            self._child(self.failovers, *left).inc()
            self._child(self.duplicated, *left).inc(prompt)
        if hedged.get("won"):
            first, won = str(hedged.get("from")), "second" if hedged["won"] == hedged.get("upstream") else "first"
            self._child(self.hedges, group, first, won).inc()
            self._child(self.duplicated, group, first, record.HEDGE).inc(prompt)
        for field, instead_of in record.WAITED_INSTEAD_OF.items():
            if route.get(field):  # the late head is the first chosen member's (the bound is only its)
                self._child(self.waited, group, str(chosen), instead_of).inc()
        if (not phases.waited_for_another(route) and rec.ttft_ms is not None and rec.status is not None
                and 200 <= rec.status < 300 and not rec.error and not rec.client_aborted):
            self._child(self.member_ttft, group, str(route.get("upstream"))).observe(rec.ttft_ms / 1000)


LEARNED_WINDOWS = "ttft_relay_learned_context_window_tokens"
LEARNED_ENTRIES = "ttft_relay_learned_entries"
LEARNED_NEWEST = "ttft_relay_learned_newest_timestamp_seconds"


class LearnedCollector:
    """What the relay processes on one timing log learned (the store beside it: `ttft_relay.store`),
    as gauges read at each scrape: in the scrape server's thread, never the event loop."""

    def __init__(self, timing_log: str | Path) -> None:
        self.store = store.SharedStore(Path(timing_log).with_name(store.FILE_NAME),
                                       [windows.KIND, plans.KIND, verdicts.KIND, attempts.KIND], read_only=True)
        self.windows = windows.LearnedWindows(self.store)

    def _families(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(LEARNED_WINDOWS, "A context window learned from a provider's refusal, in the "
                              "provider's tokens (the operator's relay_context_windows wins over it).",
                              labels=("server_address", "gen_ai_request_model", "limit", "confirmed",
                                      "learned_from")),
            GaugeMetricFamily(LEARNED_ENTRIES, "What the relay learned and keeps, per kind: window (context "
                              "windows), plan (conversations' cuts), first-token (first-token lines), attempt "
                              "(open attempt groups: failed requests a retry may still join).",
                              labels=("kind",)),
            GaugeMetricFamily(LEARNED_NEWEST, "When the newest entry of a kind was learned (Unix time).",
                              labels=("kind",)),
        ]

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> list[GaugeMetricFamily]:
        self.store.refresh()
        learned_windows, entries, newest = self._families()
        for learned in self.windows.entries():
            learned_windows.add_metric([learned.upstream, learned.model,
                                        "max_input" if learned.max_input else "window",
                                        "yes" if learned.confirmed else "no", learned.key], learned.limit)
        for kind in (windows.KIND_NAME, plans.KIND_NAME, verdicts.KIND_NAME, attempts.KIND_NAME):
            held = self.store.entries.entries(kind)
            entries.add_metric([kind], len(held))
            if held:
                newest.add_metric([kind], max(entry.ts for entry in held))
        return [learned_windows, entries, newest]


def watch_learned(registry: CollectorRegistry, timing_log: str | Path | None) -> LearnedCollector | None:
    """Serve what the processes logging to `timing_log` learned from `registry`."""
    if not timing_log:
        return None
    collector = LearnedCollector(timing_log)
    registry.register(collector)
    return collector


def in_flight_of(pid: int, path: str | Path) -> int:
    """The requests the worker `pid` had begun and not recorded, as its live gauges in the
    multiprocess directory `path` last said (0 where it never said)."""
    live = Path(path) / f"gauge_livesum_{pid}.db"
    if not live.exists():
        return 0
    return round(sum(sample.value for family in multiprocess.MultiProcessCollector.merge([str(live)])
                     if family.name == IN_FLIGHT for sample in family.samples))


def forget_process(pid: int, path: str | Path) -> None:
    """A worker gone: its live gauges (in flight, accept queues) leave the sums, which would
    otherwise hold its last values for ever (prometheus-client's `mark_process_dead`);
    its counters and histograms stay, as what it did."""
    multiprocess.mark_process_dead(pid, str(path))


def multiprocess_registry(path: str | Path) -> CollectorRegistry:
    """A registry that reads what every process wrote into the multiprocess directory (the
    series they still keep: `multiproc`)."""
    return multiproc.registry(path)


def parse_listen(listen: str) -> tuple[str, int]:
    """"host:port" (IPv6 as "[::1]:port") → (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


SCRAPE_PATH = "/metrics"
SCRAPE_HEAD_TIMEOUT_S = 10.0
"""A scrape connection must send its request within this; it is closed once answered."""
SCRAPE_CONNECTIONS = 64
"""Connections the endpoint lets wait for their request at once; a new one closes the oldest
(1000 idle ones held a thread each, ~500 threads, for as long as they liked)."""


def serve(listen: str, registry: CollectorRegistry) -> tuple[tuple[str, int], ScrapeServer]:
    """Serve `registry` at http://listen/metrics from a thread of its own; returns the
    (host, port) bound and the server (`shutdown()`, `server_close()`). Raises OSError when it
    cannot listen."""
    host, port = parse_listen(listen)
    server = ScrapeServer(host, port, registry)
    return server.server_address, server


class ScrapeServer:
    """`GET /metrics` answered with `registry`'s exposition (OpenMetrics or text, gzip when
    asked), everything else 404 or 405, each connection closed once answered or after
    SCRAPE_HEAD_TIMEOUT_S without a request, at most SCRAPE_CONNECTIONS of them waiting: one
    thread and an asyncio loop, however many connections (prometheus-client's server holds a
    thread per connection, without a timeout)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.waiting: dict[asyncio.StreamWriter, None] = {}
        """Connections that have not sent their request yet, oldest first."""
        self.loop = asyncio.new_event_loop()
        self.server_address: tuple[str, int] = (host, port)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(host, port), name="ttft-relay-metrics", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self, host: str, port: int) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(asyncio.start_server(self._handle, host, port, backlog=SCRAPE_CONNECTIONS))
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self.server_address = server.sockets[0].getsockname()[:2]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            if pending := asyncio.all_tasks(loop):
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def shutdown(self) -> None:
        """Stop serving, and close the listener and every connection."""
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    def server_close(self) -> None:
        """Closed by `shutdown` already (as `socketserver`'s pair of calls)."""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.waiting) >= SCRAPE_CONNECTIONS:
            # Full of connections that sent nothing: the oldest makes room, so a scrape, which
            # sends its request at once, is served whatever idles here.
            oldest = next(iter(self.waiting))
            del self.waiting[oldest]
            oldest.close()
        self.waiting[writer] = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SCRAPE_HEAD_TIMEOUT_S)
            self.waiting.pop(writer, None)
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), SCRAPE_HEAD_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self.waiting.pop(writer, None)
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.rpartition(" ")[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if target.split("?", 1)[0] != SCRAPE_PATH:
            return _response(404, "text/plain", b"not found: the metrics are at /metrics\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "text/plain", b"GET only\n")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self.registry)
        encoding = None
        if "gzip" in headers.get("accept-encoding", ""):
            body, encoding = gzip.compress(body, compresslevel=1), "gzip"
        return _response(200, content_type, body if method == "GET" else b"", encoding, len(body))


def _response(status: int, content_type: str, body: bytes, encoding: str | None = None,
              length: int | None = None) -> bytes:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[status]
    head = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
            f"Content-Length: {len(body) if length is None else length}", "Connection: close"]
    if encoding:
        head.append(f"Content-Encoding: {encoding}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Metrics:
    """Turns each finished timing record into Prometheus metrics and serves them; counts
    the requests in flight, from their head to their record."""

    def __init__(self) -> None:
        self.metrics: RelayMetrics | None = None
        self.server: ScrapeServer | None = None
        self.listen = ""
        self.learned: LearnedCollector | None = None
        self.counted: weakref.WeakKeyDictionary[http.HTTPFlow, Gauge] = weakref.WeakKeyDictionary()
        """The flows in the in-flight gauge, each with the gauge it went into (the registry
        may be new by the time it is recorded)."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_metrics_listen",
            str,
            DEFAULT_LISTEN,
            "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port, logged); "
            "empty: no metrics.",
        )
        loader.add_option(
            "relay_metrics_max_series",
            int,
            DEFAULT_MAX_SERIES,
            "Label combinations (model, host, API, status class) with series of their own; beyond, the "
            "least recently used go, never one whose model has had a success for junk, and calls without "
            "room count under model and host \"other\".",
        )

    def configure(self, updated: set[str]) -> None:
        if not updated & {"relay_metrics_listen", "relay_metrics_max_series", "relay_timing_log"}:
            return
        listen = ctx.options.relay_metrics_listen
        if listen:
            try:
                parse_listen(listen)
            except ValueError as e:
                raise exceptions.OptionsError(f"relay_metrics_listen: {e}") from e
        if "relay_metrics_max_series" in updated or self.metrics is None:
            # A registry of its own: instruments are per instance, not process globals.
            self.metrics = RelayMetrics(CollectorRegistry(), ctx.options.relay_metrics_max_series)
            self.learned = None
        if "relay_timing_log" in updated or self.learned is None:
            if self.learned is not None:
                self.metrics.registry.unregister(self.learned)
            self.learned = watch_learned(self.metrics.registry, getattr(ctx.options, "relay_timing_log", ""))
        if listen != self.listen or "relay_metrics_max_series" in updated:
            self._stop_server()
            self.listen = listen
            if listen and WORKER_ENV not in os.environ:
                self._start_server(self.metrics.registry)

    def _start_server(self, registry: CollectorRegistry) -> None:
        try:
            (host, port), self.server = serve(self.listen, registry)
        except OSError as e:
            # Not fatal: the relay's job is relaying. (An error at start-up would stop mitmdump.)
            logger.warning("metrics endpoint not started on %s: %s; the relay runs without it. %s",
                           self.listen, e.strerror or e, LISTEN_FIX)
            return
        logger.info("metrics at http://%s:%s/metrics", host, port)

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def done(self) -> None:
        self._stop_server()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self.listen and self.metrics is not None and state.get(flow) is not None:  # timed: it will be recorded
            self.metrics.in_flight.inc()
            self.counted[flow] = self.metrics.in_flight

    def timing_record(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        if (gauge := self.counted.pop(flow, None)) is not None:  # its first record (a socket's turns come later)
            gauge.dec()
        if self.listen and self.metrics is not None and (st := state.get(flow)) is not None:
            self.metrics.observe(rec, st.api)
            self.metrics.observe_route(rec)

    def otlp_dropped(self, reason: str, records: int) -> None:
        """`observe.traces.Traces`' callback (from its exporter thread too: counters take a lock)."""
        if self.listen and self.metrics is not None:
            self.metrics.otlp_dropped.labels(reason).inc(records)

    def load_sample(self, lag_s: float, accept_queues: Mapping[str, int] | None,
                    gc_pauses: Sequence[tuple[int, float]]) -> None:
        """`selfwatch.SelfWatch.subscribe`'s callback."""
        if self.listen and self.metrics is not None:
            self.metrics.observe_load(lag_s, accept_queues, gc_pauses)
