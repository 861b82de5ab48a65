"""Why is the first token slow? Probe timings (+ the relay's records) → findings → a verdict (pure).

Probes come in four kinds: `direct` (to the upstream) or `relayed` (through the
relay), each with a `tiny` or a `long` prompt, sent as a streamed HTTP request or,
with the `websocket` transport, as one `response.create` turn on a new Responses
WebSocket (as Codex opens one per session). A probe's marks are ms since it
began (`PROBE_MARKS`, the curl `-w` vocabulary plus the first token); its phases
are the slices between consecutive marks (`PROBE_PHASES`). On a WebSocket, `sent`
is the upgrade request, `head` its `101`, and `message` the turn sent after it. A
relayed probe whose request id shows up in the relay's timing log is *joined* with
that record, which splits the relay's side of the wait (`RelaySplit`).

Findings, each in ms of the client's wait for the first token (medians over repeats):

    network to the relay      relayed ttft − what the relay's record accounts for
                              (without a record: the connection setup to the relay only)
    relay→upstream network    the relay's upstream connect + TLS + one round trip
    relay overhead            relayed ttft − direct ttft − network to the relay
                              − (relay→upstream network − direct network to the upstream)
    context length            what the prompt's length costs the user's own requests: the long −
                              tiny wait for the first token as a rate ("every 8.0k tokens of history
                              add 804 ms", ms per 1k tokens), weighed at the user's prompt size
                              (`PromptSize`: --prompt-tokens, --body-file, or their requests in the
                              relay's log); without that size it is said as a rate, and is no verdict
    upstream queueing/instability  the largest spread of the wait within a kind, the single
                              lowest and highest try left out (one outlier is not instability)
    upstream's own wait       the upstream's wait for a tiny prompt, minus one round trip
    mid-stream stall          the longest silence between chunks after a first token, any probe
    WebSocket handshake       upgrade request → `101`, the wait a client pays before its first
                              turn (a relayed one includes the relay's upstream connect and TLS)
    unreachable / failing     every probe of a path failed: the verdict, whatever else; on a
                              WebSocket, every handshake or turn failing past the TCP connect is
                              "WebSocket transport failing" (clients retry, then fall back to HTTP)

A finding is *significant* from its threshold (`THRESHOLDS_MS`) on; the verdict is
the first fatal finding, else the significant finding that costs the most. The verdict
answers for the user's traffic, not for the probes: the link is the tiny probe's (what
every request pays), and the long probe's size is diagnose's choice, so the context is
weighed at the user's own prompt size or not at all.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..observe import prefill
from ..report import summary
from ..timing import phases

PROBE_MARKS = ("dns", "tcp", "tunnel", "tls", "sent", "head", "message", "first_token", "end")
"""dns lookup done, TCP up, proxy tunnel up (CONNECT), TLS up, request written,
first response byte (curl's starttransfer; on a WebSocket: the 101), the WebSocket
turn's message written (WebSocket only), first token, end of the answer."""

PROBE_STEPS = (
    ("dns", "dns"),
    ("tcp", "tcp"),
    ("tunnel", "tunnel"),
    ("tls", "tls"),
    ("send", "sent"),
    ("wait", "head"),
    ("message", "message"),
    ("head_to_first_token", "first_token"),
)
"""(phase, the mark that ends it): each phase runs from the previous mark present."""

PROBE_PHASES = tuple(name for name, _ in PROBE_STEPS) + ("ttft", "total")
SETUP_MARKS = ("tcp", "tunnel", "tls")
PATHS = ("direct", "relayed")
PROMPTS = ("tiny", "long")
KINDS = tuple(f"{path} {prompt}" for path in PATHS for prompt in PROMPTS)

NETWORK_TO_RELAY = "network to the relay"
RELAY_UPSTREAM_NETWORK = "relay→upstream network"
RELAY_OVERHEAD = "relay overhead"
RELAY_PATH = "relay and relay→upstream network (unsplit)"
CONTEXT_LENGTH = "context length"
UPSTREAM_INSTABILITY = "upstream queueing/instability"
UPSTREAM_OWN_WAIT = "upstream's own wait"
DIRECT_NETWORK = "network to the upstream"
UPSTREAM_UNREACHABLE = "upstream unreachable"
UPSTREAM_ERRORS = "upstream answers with errors"
RELAY_UNREACHABLE = "relay unreachable"
RELAY_FAILING = "relay failing"
NO_DIRECT_PATH = "no direct path to the upstream"
SOME_PROBES_FAILED = "some probes failed"
WEBSOCKET_FAILING = "WebSocket transport failing"
WEBSOCKET_HANDSHAKE = "WebSocket handshake"
MID_STREAM_STALL = "mid-stream stall"
TRANSPORTS = ("http", "websocket")
NETWORK_PHASES = ("dns", "tcp", "tunnel", "tls")

THRESHOLDS_MS = {
    NETWORK_TO_RELAY: 100.0,
    RELAY_UPSTREAM_NETWORK: 100.0,
    RELAY_OVERHEAD: 50.0,  # streaming mitmproxy adds a few ms; tens of ms mean trouble
    RELAY_PATH: 100.0,
    CONTEXT_LENGTH: 100.0,
    UPSTREAM_INSTABILITY: 200.0,
    UPSTREAM_OWN_WAIT: 800.0,  # providers' usual tiny-prompt wait is a few hundred ms
    DIRECT_NETWORK: 100.0,
    WEBSOCKET_HANDSHAKE: 300.0,  # a round trip or two; Codex waits this before every session's first turn
    MID_STREAM_STALL: 1000.0,  # an answer that stops for a second or more, once it has begun
}
INSTABILITY_RELATIVE = 0.5
"""A spread is instability only if it is also at least this fraction of the kind's median."""
MIN_REPEATS_FOR_SPREAD = 5
"""Tries a kind needs before its spread means anything: the extremes are left out of it."""
GATEWAY_ERRORS = (502, 503, 504)

ADVICE = {
    NETWORK_TO_RELAY: "Run the client close to the relay (same region or LAN), drop extra proxies/VPNs "
    "in between, and keep client connections alive (reuse one HTTP client) so setup is paid once.",
    RELAY_UPSTREAM_NETWORK: "The relay host is far from the upstream: move the relay near the upstream's "
    "region. Let clients keep their connection to the relay alive: mitmproxy reuses an upstream "
    "connection per client connection, which saves the connect and TLS handshake on every request.",
    RELAY_OVERHEAD: "The relay itself adds time: check its CPU (mitmproxy runs on one core; bursts of new "
    "connections queue), that it runs with streaming on (scripts/relay, not bare mitmdump), and the "
    "`relay` phase in ttft-relay report over real traffic.",
    RELAY_PATH: "Something between the relay and the upstream adds this: pass --relay-log with the "
    "relay's timing log to split relay overhead from the relay's network to the upstream.",
    CONTEXT_LENGTH: "Prompt length drives the first-token time: trim history (relay_trim, "
    "relay_trim_max_tokens), keep a stable prefix so the provider's prompt cache hits, summarise old "
    "turns. ttft-relay report fits the same ms per 1k tokens over real traffic.",
    UPSTREAM_INSTABILITY: "The same request waits very differently from one try to the next: queueing or "
    "load at the provider. Try another region/deployment or a tier with capacity guarantees, and use "
    "client timeouts with a retry.",
    UPSTREAM_OWN_WAIT: "Nothing on the path is slow: the provider takes this long even for a tiny prompt. "
    "Try a faster model or another region, and check the provider's status page.",
    DIRECT_NETWORK: "This machine is far from the upstream: keep connections alive so the handshakes are "
    "paid once, or run the client (or a relay) in a region near the upstream.",
    UPSTREAM_UNREACHABLE: "Check the upstream URL, DNS and firewall from this machine and from the relay "
    "host (the relay's log names the phase that failed), and the provider's status page.",
    UPSTREAM_ERRORS: "The upstream is reachable but refuses the probes: check the key, the model name "
    "(--model), the quota, and the error message above.",
    RELAY_UNREACHABLE: "Check that the relay runs and listens where --relay points (scripts/relay), and "
    "that no firewall is in the way.",
    RELAY_FAILING: "The relay is reachable but its requests fail: read the errors above and the relay's "
    "console; for the proxy mode, --ca must name the mitmproxy CA.",
    NO_DIRECT_PATH: "Comparisons with the direct path are skipped; the relay is your only way out.",
    SOME_PROBES_FAILED: "Intermittent failures: run again with --repeat 10, and look at errors in "
    "ttft-relay report.",
    WEBSOCKET_FAILING: "Clients retry a failing WebSocket and then fall back to HTTP (Codex: 5 reconnects, "
    "seconds lost per session, turns the upstream may bill twice). Check that every proxy on the path "
    "passes `Upgrade: websocket` and the 101 through untouched (an old relay chunk-framed it), or turn the "
    "client's WebSocket transport off until it is fixed.",
    MID_STREAM_STALL: "The answer stopped for this long after it had begun: the provider paused generating (load, "
    "reasoning it does not stream), or something on the path held the stream back (a buffering proxy, antivirus, a "
    "lossy link). If only relayed probes stall, look at the relay's records of them (their `stream stall` verdicts); "
    "if direct ones do too, it is the provider.",
    WEBSOCKET_HANDSHAKE: "Every new WebSocket waits this long before its first turn: keep sessions (and "
    "their socket) open, and if the relayed handshake is much slower than the direct one, look at the "
    "relay's upstream connect and TLS (ttft-relay report, `websocket` handshake records).",
}


@dataclass
class ProbeResult:
    """One probe as measured: which kind, its marks (ms since it began), and how it ended."""

    path: str
    prompt: str
    request_id: str
    prompt_tokens: int
    body_bytes: int
    marks: dict[str, float] = field(default_factory=dict)
    status: int | None = None
    tls_version: str | None = None
    error: str | None = None
    error_phase: str | None = None
    transport: str = "http"
    stall_ms: float | None = None
    """The longest silence between two chunks after the first token (None: fewer than two chunks after it)."""

    @property
    def kind(self) -> str:
        return f"{self.path} {self.prompt}"

    @property
    def ok(self) -> bool:
        return self.error is None and "first_token" in self.marks

    def phases(self) -> dict[str, float]:
        """Durations in ms: each step from the previous mark present, plus ttft and total."""
        out, previous = {}, 0.0
        for name, mark in PROBE_STEPS:
            if mark in self.marks:
                out[name] = round(self.marks[mark] - previous, 3)
                previous = self.marks[mark]
        if "first_token" in self.marks:
            out["ttft"] = self.marks["first_token"]
        if "end" in self.marks:
            out["total"] = self.marks["end"]
        return out

    @property
    def setup_ms(self) -> float:
        """DNS, TCP, tunnel and TLS: everything before the request could be sent."""
        return max((self.marks[m] for m in SETUP_MARKS if m in self.marks), default=0.0)

    @property
    def wait_ms(self) -> float:
        """Connection ready → first token: the request's upload, a round trip, the answer's wait
        (on a WebSocket from the turn's message: the handshake is a finding of its own)."""
        return self.marks["first_token"] - self.marks.get("message", self.setup_ms)

    @property
    def turn_ttft_ms(self) -> float:
        """What the relay's record of the probe covers up to the first token: the whole
        request, or on a WebSocket the turn from its message on (the handshake has its own)."""
        return self.marks["first_token"] - (self.marks["message"] if self.transport == "websocket" else 0.0)

    @property
    def handshake_ms(self) -> float | None:
        """WebSocket: upgrade request written → 101."""
        m = self.marks
        return m["head"] - m["sent"] if self.transport == "websocket" and "head" in m and "sent" in m else None

    @property
    def rtt_ms(self) -> float | None:
        """One round trip to the server this probe connected to, from its handshakes."""
        m = self.marks
        relative = {"upstream_connect_start": m.get("dns"), "upstream_tcp": m.get("tcp"), "upstream_tls": m.get("tls")}
        return phases.handshake_rtt_ms({k: v for k, v in relative.items() if v is not None}, self.tls_version)

    @property
    def network_ms(self) -> float:
        """Setup plus the round trip every request pays: what the network costs this probe."""
        return self.setup_ms + (self.rtt_ms or 0.0)


@dataclass(frozen=True)
class RelaySplit:
    """The relay's side of one relayed probe, from its timing record (`phases.contributions`)."""

    relay: float
    upstream_connect: float
    upstream_tls: float
    upstream_rtt: float
    upstream_own: float

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> RelaySplit:
        c = phases.contributions(rec.get("phases") or {}, rtt_ms=rec.get("rtt_ms"))
        return cls(
            relay=c[phases.RELAY],
            upstream_connect=c[phases.UPSTREAM_CONNECT],
            upstream_tls=c[phases.UPSTREAM_TLS],
            upstream_rtt=c[phases.UPSTREAM_NETWORK],
            upstream_own=c[phases.UPSTREAM_WAIT],
        )

    @property
    def upstream_network(self) -> float:
        return self.upstream_connect + self.upstream_tls + self.upstream_rtt

    @property
    def accounted(self) -> float:
        """The part of the first-token wait the relay saw from its side (client upload excluded)."""
        return self.relay + self.upstream_network + self.upstream_own


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    n: int
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        """None without values."""
        ordered = sorted(values)
        return cls.of_sorted(ordered) if ordered else None

    @classmethod
    def of_sorted(cls, values: Sequence[float]) -> Spread:
        """Of at least one value, in ascending order."""
        return cls(len(values), round(statistics.median(values), 1), round(values[0], 1), round(values[-1], 1))

    @property
    def spread(self) -> float:
        return round(self.high - self.low, 1)


@dataclass
class Finding:
    """One thing the diagnosis found: what it costs the first token, the numbers, what to do."""

    cause: str
    ms: float
    detail: str
    significant: bool
    fatal: bool = False
    numbers: dict[str, float | None] = field(default_factory=dict)
    weighed: bool = True
    """False: what this costs the user's own requests is not known (`ms` is the probes' figure, a
    size diagnose chose), so it is reported but is never the verdict."""

    @property
    def advice(self) -> str:
        return ADVICE.get(self.cause, "")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "advice": self.advice}


def measured(cause: str, ms: float, detail: str, threshold: float | None = None, **numbers: float | None) -> Finding:
    """A finding whose significance comes from its threshold."""
    limit = THRESHOLDS_MS[cause] if threshold is None else threshold
    return Finding(cause, round(ms, 1), detail, ms >= limit, numbers={k: _round(v) for k, v in numbers.items()})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


@dataclass(frozen=True)
class PromptSize:
    """How long the user's own prompts are, in the tokens the provider has to read (those it
    reads from its prompt cache left out): the size the context's cost is weighed at."""

    tokens: float
    source: str
    """Where the size comes from, in words for the report."""


def prompt_size_of_traffic(records: Iterable[Mapping[str, Any]], upstreams: Iterable[str] = ()) -> PromptSize | None:
    """The median prompt of the user's own requests in the relay's log (the caller leaves the
    probes out), of the probed upstreams when known: uncached tokens as the upstream reported
    them, else as the relay counted them. WebSocket handshakes, prewarm turns and requests of
    unknown size have no say; None when no request is left."""
    wanted = set(upstreams)
    prompts = [prompt for rec in records
               if summary.counts_as_first_token(rec) and (not wanted or rec.get("upstream") in wanted)
               and (prompt := prefill.prompt_of(rec.get("usage"), rec.get("prompt_tokens"))) is not None]
    if not prompts:
        return None
    uncached, cached = statistics.median(u for u, _ in prompts), statistics.median(c for _, c in prompts)
    left_out = f"; {_tokens(cached)} more read from the provider's cache left out" if cached else ""
    requests = f"{len(prompts)} requests" if len(prompts) > 1 else "1 request"
    return PromptSize(uncached, f"the median of your {requests} in the relay's log{left_out}")


class Evidence:
    """The probes, the relay records joined to them by request id, and medians over both;
    and the user's own prompt size when known (`PromptSize`)."""

    def __init__(self, probes: list[ProbeResult], records: Mapping[str, Mapping[str, Any]] | None = None,
                 prompt_size: PromptSize | None = None) -> None:
        self.probes = probes
        self.records = {p.request_id: records[p.request_id] for p in probes if records and p.request_id in records}
        self.prompt_size = prompt_size

    def of(self, kind: str) -> list[ProbeResult]:
        return [p for p in self.probes if p.kind == kind]

    def ok(self, kind: str) -> list[ProbeResult]:
        return [p for p in self.of(kind) if p.ok]

    def path_probes(self, path: str) -> list[ProbeResult]:
        return [p for p in self.probes if p.path == path]

    def median(self, kind: str, metric: Callable[[ProbeResult], float | None]) -> float | None:
        values = [v for p in self.ok(kind) if (v := metric(p)) is not None]
        return statistics.median(values) if values else None

    def median_measured(self, kind: str, metric: Callable[[ProbeResult], float]) -> float:
        """The median of what every probe measures, for a kind with a successful probe (`first_kind`)."""
        return statistics.median(metric(p) for p in self.ok(kind))

    def split(self, probe: ProbeResult) -> RelaySplit | None:
        rec = self.records.get(probe.request_id)
        return RelaySplit.from_record(rec) if rec and rec.get("phases") else None

    def first_kind(self, *kinds: str) -> str | None:
        """The first of `kinds` with a successful probe."""
        return next((k for k in kinds if self.ok(k)), None)

    def joined(self, kind: str) -> list[tuple[ProbeResult, RelaySplit]]:
        return [(p, s) for p in self.ok(kind) if (s := self.split(p)) is not None]


def table(ev: Evidence) -> dict[str, dict[str, Spread]]:
    """Per probe kind (with any success), per phase: median and range over its successful probes."""
    out: dict[str, dict[str, Spread]] = {}
    for kind in KINDS:
        probes = ev.ok(kind)
        if not probes:
            continue
        rows = {name: Spread.of(p.phases()[name] for p in probes if name in p.phases()) for name in PROBE_PHASES}
        out[kind] = {name: s for name, s in rows.items() if s is not None}
    return out


def relay_table(ev: Evidence) -> dict[str, dict[str, Spread]]:
    """Per relayed kind: the relay's side of the wait, from the joined records."""
    out = {}
    for kind in ("relayed tiny", "relayed long"):
        splits = [s for _, s in ev.joined(kind)]
        if splits:
            out[kind] = {
                name: Spread.of_sorted(sorted(getattr(s, name) for s in splits))
                for name in ("relay", "upstream_connect", "upstream_tls", "upstream_rtt", "upstream_own")
            }
    return out


# --- findings --------------------------------------------------------------------------


def _errors(probes: list[ProbeResult]) -> str:
    """The distinct errors of failed probes, most common first: "error (in phase) k/n"."""
    failed = Counter((p.error, p.error_phase) for p in probes if not p.ok)
    return "; ".join(f"{error or 'no token'} (in {phase}) {k}/{len(probes)}" for (error, phase), k in failed.most_common())


def reachability(ev: Evidence) -> list[Finding]:
    """Fatal findings when every probe of a path failed; a note when only some did."""
    direct, relayed = ev.path_probes("direct"), ev.path_probes("relayed")
    direct_down = bool(direct) and not any(p.ok for p in direct)
    relay_down = bool(relayed) and not any(p.ok for p in relayed)
    relay_refused = relay_down and all(p.error_phase in ("dns", "tcp") for p in relayed)
    # A relay answering 502/503/504 to everything could not get an answer from the upstream either.
    relay_gateway_errors = relay_down and all(p.status in GATEWAY_ERRORS for p in relayed)
    direct_answers = direct_down and all(p.status is not None for p in direct)
    # A record without a verdict (not the relay's, or cut short) has nothing to say.
    relay_says = sorted({v for rec in ev.records.values() if rec.get("error") and isinstance(v := rec.get("verdict"), str)})
    relay_note = f"; the relay's records say: {', '.join(relay_says)}" if relay_says else ""
    out = []
    if relay_refused:
        out.append(Finding(RELAY_UNREACHABLE, 0.0, f"via relay: {_errors(relayed)}", True, fatal=True))
    elif (direct_down or not direct) and (relay_down or not relayed):
        cause = UPSTREAM_ERRORS if direct_answers else UPSTREAM_UNREACHABLE
        if not direct and not relay_gateway_errors:
            cause = RELAY_FAILING
        paths = [f"direct: {_errors(direct)}"] if direct else []
        paths += [f"via relay: {_errors(relayed)}{relay_note}"] if relayed else []
        out.append(Finding(cause, 0.0, "; ".join(paths), True, fatal=True))
    elif relay_down:
        out.append(Finding(RELAY_FAILING, 0.0, f"via relay: {_errors(relayed)}{relay_note}", True, fatal=True))
    elif direct_down:
        out.append(Finding(NO_DIRECT_PATH, 0.0, f"direct: {_errors(direct)}", False))
    partial = [p for p in (direct if not direct_down else []) + (relayed if not relay_down else []) if not p.ok]
    if partial:
        detail = "; ".join(f"{path}: {_errors(ev.path_probes(path))}" for path in PATHS
                           if any(p.path == path for p in partial))
        out.append(Finding(SOME_PROBES_FAILED, 0.0, detail, True))
    return out


def websocket_failing(ev: Evidence) -> list[Finding]:
    """Fatal when every WebSocket probe of a path got past the TCP connect and still failed:
    the upgrade refused or hung, or the socket broke before the turn completed."""
    out = []
    for path in PATHS:
        probes = [p for p in ev.path_probes(path) if p.transport == "websocket"]
        if not probes or any(p.ok for p in probes) or any(p.error_phase in NETWORK_PHASES for p in probes):
            continue
        cost = statistics.median(p.marks.get("end", 0.0) for p in probes)
        where = "the handshake" if all(p.error_phase in ("send", "wait") for p in probes) else "the handshake or turn"
        out.append(Finding(WEBSOCKET_FAILING, round(cost, 1),
                           f"{path}: every WebSocket failed in {where}, after {cost:.0f} ms (median): {_errors(probes)}",
                           True, fatal=True, numbers={"cost_ms": round(cost, 1)}))
    return out


def websocket_handshake(ev: Evidence) -> Finding | None:
    """The wait for the 101, through the relay if probed (else direct), beside the direct one."""
    medians = {path: statistics.median(v) for path in PATHS
               if (v := [h for p in ev.path_probes(path) if p.ok and (h := p.handshake_ms) is not None])}
    if not medians:
        return None
    path = "relayed" if "relayed" in medians else "direct"
    ms = medians[path]
    compare = f" (direct: {medians['direct']:.0f} ms)" if path == "relayed" and "direct" in medians else ""
    return measured(WEBSOCKET_HANDSHAKE, ms, f"upgrade request → 101 took {ms:.0f} ms {path}{compare}",
                    relayed_ms=medians.get("relayed"), direct_ms=medians.get("direct"))


def network_to_relay(ev: Evidence) -> Finding | None:
    """The client↔relay hop: the relayed probe's ttft minus what the relay accounts for."""
    kind = ev.first_kind("relayed tiny", "relayed long")
    if kind is None:
        return None
    setup = ev.median_measured(kind, lambda p: p.setup_ms)
    joined = ev.joined(kind)
    if not joined:
        return measured(NETWORK_TO_RELAY, setup, f"connection setup to the relay {setup:.0f} ms ({kind}; "
                        "setup only: pass --relay-log for the full figure)", setup_ms=setup)
    ms = statistics.median(p.turn_ttft_ms - s.accounted for p, s in joined)
    ttft = ev.median_measured(kind, lambda p: p.turn_ttft_ms)
    return measured(
        NETWORK_TO_RELAY, ms,
        f"{ms:.0f} ms of the {ttft:.0f} ms first token ({kind}) passed between this machine and the relay "
        f"(connection setup {setup:.0f} ms, the rest carrying request and answer)",
        setup_ms=setup, ttft_ms=ttft,
    )


def direct_network(ev: Evidence) -> float | None:
    kind = ev.first_kind("direct tiny", "direct long")
    return ev.median(kind, lambda p: p.network_ms) if kind else None


def relay_upstream_network(ev: Evidence) -> Finding | None:
    """The relay's own network to the upstream: connect, TLS, one round trip (its records)."""
    splits = [s for kind in ("relayed tiny", "relayed long") for _, s in ev.joined(kind)]
    if not splits:
        return None
    part = {name: statistics.median(getattr(s, name) for s in splits)
            for name in ("upstream_connect", "upstream_tls", "upstream_rtt", "upstream_network")}
    mine = direct_network(ev)
    compare = f"; from this machine directly: {mine:.0f} ms" if mine is not None else ""
    return measured(
        RELAY_UPSTREAM_NETWORK, part["upstream_network"],
        f"relay→upstream connect {part['upstream_connect']:.0f} ms + TLS {part['upstream_tls']:.0f} ms "
        f"+ round trip {part['upstream_rtt']:.0f} ms = {part['upstream_network']:.0f} ms per new connection{compare}",
        connect_ms=part["upstream_connect"], tls_ms=part["upstream_tls"], rtt_ms=part["upstream_rtt"],
        direct_network_ms=mine,
    )


def relay_overhead(ev: Evidence, to_relay: Finding | None, to_upstream: Finding | None) -> Finding | None:
    """What the relay adds beyond the networks: relayed − direct, minus the network difference."""
    relayed_kind = ev.first_kind("relayed tiny", "relayed long")
    if relayed_kind is None:
        return None
    direct_kind = relayed_kind.replace("relayed", "direct")
    relayed_ttft = ev.median_measured(relayed_kind, lambda p: p.marks["first_token"])
    direct_ttft = ev.median(direct_kind, lambda p: p.marks["first_token"])
    own = statistics.median(s.relay for _, s in ev.joined(relayed_kind)) if ev.joined(relayed_kind) else None
    if direct_ttft is None:
        if own is None:
            return None
        return measured(RELAY_OVERHEAD, own, f"the relay's own phase {own:.0f} ms (no direct probe to compare)",
                        relay_phase_ms=own)
    extra = relayed_ttft - direct_ttft
    to_relay_ms = to_relay.ms if to_relay else 0.0
    if to_upstream is None:
        ms = extra - to_relay_ms
        return measured(RELAY_PATH, ms, f"relayed {relayed_ttft:.0f} ms − direct {direct_ttft:.0f} ms − setup to "
                        f"the relay {to_relay_ms:.0f} ms = {ms:.0f} ms ({relayed_kind})", extra_ms=extra)
    network_difference = to_upstream.ms - (direct_network(ev) or 0.0)
    ms = extra - to_relay_ms - network_difference
    own_text = f"; the relay's own phase {own:.0f} ms" if own is not None else ""
    return measured(
        RELAY_OVERHEAD, ms,
        f"relayed {relayed_ttft:.0f} ms − direct {direct_ttft:.0f} ms − network to the relay {to_relay_ms:.0f} ms "
        f"− network difference {network_difference:.0f} ms = {ms:.0f} ms{own_text}",
        extra_ms=extra, network_difference_ms=network_difference, relay_phase_ms=own,
    )


def context_length(ev: Evidence) -> Finding | None:
    """What the prompt's length costs the first token. The long probe's extra wait over the
    tiny one is a rate ("every 8.0k tokens of history add 804 ms", ms per 1k prompt tokens);
    weighed at the user's own prompt size (`Evidence.prompt_size`) it is what their requests
    pay, the finding's cost. Without that size the rate is said, unweighed: the long probe's
    size is diagnose's choice, and a far link would lose the verdict to it.

    With the relay's records of both relayed kinds, the rate is the upstream's own wait in
    them: a probe's wait also holds the upload of its body, and over a far link to the relay
    a long body takes round trips more (TCP's slow start), which is the link's, not the
    context's; it is said apart. Else the probes' own waits, direct ones first."""
    joined_tiny, joined_long = ev.joined("relayed tiny"), ev.joined("relayed long")
    link_extra = None
    if joined_tiny and joined_long:
        def own(joined: list[tuple[ProbeResult, RelaySplit]]) -> tuple[float, float]:
            return (statistics.median(s.upstream_own for _, s in joined),
                    statistics.median(p.prompt_tokens for p, _ in joined))

        def to_relay(joined: list[tuple[ProbeResult, RelaySplit]]) -> float:
            return statistics.median(p.turn_ttft_ms - s.accounted for p, s in joined)

        (tiny_wait, tiny_tokens), (long_wait, long_tokens) = own(joined_tiny), own(joined_long)
        link_extra = to_relay(joined_long) - to_relay(joined_tiny)
        waits = (f"the upstream waits {long_wait:.0f} ms for the long probe's first token, {tiny_wait:.0f} ms for the "
                 f"tiny one's (the relay's records)")
    else:
        path = next((path for path in PATHS if ev.ok(f"{path} tiny") and ev.ok(f"{path} long")), None)
        if path is None:
            return None
        tiny, long = f"{path} tiny", f"{path} long"
        tiny_wait, long_wait = (ev.median_measured(tiny, lambda p: p.wait_ms),
                                ev.median_measured(long, lambda p: p.wait_ms))
        tiny_tokens, long_tokens = (ev.median_measured(tiny, lambda p: p.prompt_tokens),
                                    ev.median_measured(long, lambda p: p.prompt_tokens))
        waits = f"the {path} long probe waits {long_wait:.0f} ms for its first token, the tiny one {tiny_wait:.0f} ms"
    tokens = long_tokens - tiny_tokens
    extra = long_wait - tiny_wait
    per_1k = extra / (tokens / 1000) if tokens > 0 else None
    rate = _rate(tokens, extra)
    measures = waits + (f", ≈ {per_1k:.0f} ms per 1k prompt tokens" if per_1k is not None else "")
    if link_extra is not None:
        measures += f"; its way to the relay took {link_extra:.0f} ms more (the link's, not counted here)"
    numbers = {"ms_per_1k_tokens": per_1k, "extra_tokens": tokens, "tiny_wait_ms": tiny_wait,
               "long_wait_ms": long_wait, "probe_extra_ms": extra, "link_extra_ms": link_extra}
    size = ev.prompt_size
    if size is None or per_1k is None:
        finding = measured(CONTEXT_LENGTH, extra, f"{rate} ({measures}); not weighed: your prompts' size is unknown "
                           "(--prompt-tokens N, or --relay-log with your own requests in it)", **numbers)
        finding.significant, finding.weighed = False, False
        return finding
    ms = per_1k * max(0.0, size.tokens - tiny_tokens) / 1000
    return measured(
        CONTEXT_LENGTH, ms,
        f"your prompts ({_tokens(size.tokens)} tokens: {size.source}) wait ≈ {ms:.0f} ms longer for their first "
        f"token than a tiny one: {rate} ({measures})",
        prompt_tokens=size.tokens, **numbers,
    )


def _rate(tokens: float, extra_ms: float) -> str:
    """The long probe's result in words: what its extra tokens add to the first token."""
    if extra_ms > 0 and tokens > 0:
        return f"every {_tokens(tokens)} tokens of history add {_duration(extra_ms)}"
    return f"a prompt {_tokens(tokens)} tokens longer adds nothing measurable ({extra_ms:+.0f} ms)"


def _tokens(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def _duration(ms: float) -> str:
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def upstream_instability(ev: Evidence) -> Finding | None:
    """The largest spread of the wait for the first token among repeats of one kind,
    without its single lowest and highest try: a lone spike (a lost packet, a busy
    moment on this machine) is reported, but is not instability."""
    spreads = {}
    for kind in KINDS:
        waits = sorted(p.wait_ms for p in ev.ok(kind))
        if len(waits) >= MIN_REPEATS_FOR_SPREAD:
            spreads[kind] = (Spread.of_sorted(waits[1:-1]), Spread.of_sorted(waits))
    if not spreads:
        return None
    kind, (middle, whole) = max(spreads.items(), key=lambda item: item[1][0].spread)
    finding = measured(
        UPSTREAM_INSTABILITY, middle.spread,
        f"{kind}: the wait for the first token ranged {middle.low:.0f}–{middle.high:.0f} ms without the extremes "
        f"({whole.low:.0f}–{whole.high:.0f} ms with them; median {whole.median:.0f} ms, {whole.n} tries)",
        median_ms=whole.median, low_ms=whole.low, high_ms=whole.high,
    )
    finding.significant = finding.significant and middle.spread >= INSTABILITY_RELATIVE * whole.median
    return finding


def upstream_own_wait(ev: Evidence) -> Finding | None:
    """The upstream's wait for a tiny prompt, one round trip removed."""
    direct = ev.ok("direct tiny")
    if direct:
        ms = max(0.0, statistics.median(p.marks["first_token"] - p.marks["sent"] - (p.rtt_ms or 0.0) for p in direct))
        where = "direct tiny"
    elif joined := ev.joined("relayed tiny"):
        ms = statistics.median(s.upstream_own for _, s in joined)
        where = "relayed tiny, the relay's record"
    else:
        return None
    return measured(UPSTREAM_OWN_WAIT, ms, f"{ms:.0f} ms from request to first token beyond the round trip ({where})")


def mid_stream_stall(ev: Evidence) -> Finding | None:
    """The longest silence after a first token, over every probe that got one, and per path."""
    stalled = [p for p in ev.probes if p.ok and p.stall_ms is not None]
    if not stalled:
        return None
    worst = max(stalled, key=lambda p: p.stall_ms or 0.0)
    per_path = {path: max((p.stall_ms or 0.0 for p in stalled if p.path == path), default=None) for path in PATHS}
    paths = "; ".join(f"{path} probes at most {ms:.0f} ms" for path, ms in per_path.items() if ms is not None)
    ms = worst.stall_ms or 0.0
    return measured(MID_STREAM_STALL, ms, f"{worst.kind}: {ms:.0f} ms of silence after the first token ({paths})",
                    direct_ms=per_path["direct"], relayed_ms=per_path["relayed"])


def direct_network_finding(ev: Evidence) -> Finding | None:
    """This machine's own network to the upstream; a finding only when no relay is probed."""
    mine, kind = direct_network(ev), ev.first_kind("direct tiny", "direct long")
    if mine is None or kind is None or ev.path_probes("relayed"):
        return None
    setup, rtt = ev.median_measured(kind, lambda p: p.setup_ms), ev.median(kind, lambda p: p.rtt_ms)
    return measured(DIRECT_NETWORK, mine, f"connection setup {setup:.0f} ms + round trip {rtt or 0:.0f} ms",
                    setup_ms=setup, rtt_ms=rtt)


@dataclass
class Diagnosis:
    """All findings, and the one that answers the question."""

    findings: list[Finding]

    @property
    def verdict(self) -> Finding | None:
        fatal = [f for f in self.findings if f.fatal]
        if fatal:
            return fatal[0]
        significant = [f for f in self.findings if f.significant and f.ms > 0]
        return max(significant, key=lambda f: f.ms) if significant else None

    @property
    def failed(self) -> bool:
        return any(f.fatal for f in self.findings)

    @property
    def unweighed_context(self) -> Finding | None:
        """The context's rate when it could not be weighed at the user's prompts and is large
        enough that it might matter to them: said beside the verdict, never as it."""
        return next((f for f in self.findings if f.cause == CONTEXT_LENGTH and not f.weighed
                     and f.ms >= THRESHOLDS_MS[CONTEXT_LENGTH]), None)


def diagnose(ev: Evidence) -> Diagnosis:
    """Every finding the probes (and the relay's records joined to them) support."""
    findings = websocket_failing(ev) + reachability(ev)  # the first fatal finding is the verdict
    to_relay = network_to_relay(ev)
    to_upstream = relay_upstream_network(ev)
    findings += [
        f for f in (
            to_relay,
            to_upstream,
            relay_overhead(ev, to_relay, to_upstream),
            context_length(ev),
            upstream_instability(ev),
            upstream_own_wait(ev),
            direct_network_finding(ev),
            websocket_handshake(ev),
            mid_stream_stall(ev),
        ) if f is not None
    ]
    return Diagnosis(findings)


# --- output ----------------------------------------------------------------------------


def _cell(s: Spread | None) -> str:
    return "-" if s is None else f"{s.median:.0f} ({s.low:.0f}–{s.high:.0f})"


def render_table(rows: Mapping[str, Mapping[str, Spread]], names: Iterable[str], title: str) -> list[str]:
    """A text table: one row per phase, one column per kind, "median (low–high)" in ms."""
    kinds = list(rows)
    names = [n for n in names if any(n in rows[k] for k in kinds)]
    if not kinds:
        return []
    width = max(len(_cell(rows[k].get(n))) for k in kinds for n in names) if names else 8
    width = max(width, *(len(k) for k in kinds))
    lines = [f"{title:<22}" + "".join(f"{k:>{width + 2}}" for k in kinds)]
    lines += [f"  {n:<20}" + "".join(f"{_cell(rows[k].get(n)):>{width + 2}}" for k in kinds) for n in names]
    return lines


STEP_TITLES = {
    # phase: (column title, the mark it ends in as curl -w / httpstat name it); WebSocket titles after "/"
    "dns": ("DNS Lookup", "namelookup"),
    "tcp": ("TCP Connection", "connect"),
    "tunnel": ("Proxy Tunnel", "tunnel"),
    "tls": ("TLS Handshake", "appconnect"),
    "send": ("Request Sent/Upgrade Sent", "pretransfer"),
    "wait": ("Server Wait/Wait for 101", "starttransfer/upgraded"),
    "message": ("Turn Sent", "turn sent"),
    "head_to_first_token": ("First Token", "first token"),
}
BAR_CHARS = {"dns": ".", "tcp": "-", "tunnel": "=", "tls": "~", "send": ">", "wait": "w", "message": "m",
             "head_to_first_token": "f"}
BAR_WIDTH = 60


def _titled(text: str, websocket: bool) -> str:
    http_text, _, ws_text = text.partition("/")
    return ws_text if websocket and ws_text else http_text


def httpstat(steps: list[tuple[str, float]], websocket: bool = False) -> list[str]:
    """httpstat's terminal waterfall for one probe kind: a column per step with its
    duration, then the running total at the end of each step, staircase-wise."""
    cells = [(_titled(STEP_TITLES[name][0], websocket), f"{ms:.0f} ms") for name, ms in steps]
    widths = [max(len(title), len(value)) + 4 for title, value in cells]
    lines = [" " + "".join(title.center(w) + " " for (title, _), w in zip(cells, widths)).rstrip(),
             "[" + "|".join(value.center(w) for (_, value), w in zip(cells, widths)) + "]"]
    ends = [sum(widths[: i + 1]) + i + 1 for i in range(len(widths))]  # column of each "|" (and the "]")
    lines.append("".join("|" if c in ends else " " for c in range(ends[-1] + 1)))
    total = 0.0
    for i, (name, ms) in enumerate(steps):
        total += ms
        text = f"{_titled(STEP_TITLES[name][1], websocket)}:{total:.0f} ms"
        start = max(0, ends[i] - len(text) + 1)
        row = [" "] * (ends[-1] + 1)
        for c in ends[i + 1 :]:
            row[c] = "|"
        row[start : start + len(text)] = text
        lines.append("".join(row).rstrip())
    return lines


def render_waterfall(ev: Evidence) -> list[str]:
    """Per probe kind, the httpstat waterfall of its median phases; then every kind as a bar on one axis."""
    rows = table(ev)
    if not rows:
        return []
    steps = {kind: [(name, rows[kind][name].median) for name, _ in PROBE_STEPS if name in rows[kind]] for kind in rows}
    lines = []
    for kind, kind_steps in steps.items():
        websocket = any(p.transport == "websocket" for p in ev.of(kind))
        lines += [f"{kind}{' (WebSocket)' if websocket else ''}: median of {rows[kind]['ttft'].n} probes", "",
                  *("  " + line for line in httpstat(kind_steps, websocket)), ""]
    longest = max(sum(ms for _, ms in kind_steps) for kind_steps in steps.values()) or 1.0
    per_char = longest / BAR_WIDTH
    lines.append(f"to the first token on one axis (sums of medians; one character ≈ {per_char:.0f} ms):")
    for kind, kind_steps in steps.items():
        bar, at = "", 0.0
        for name, ms in kind_steps:
            at += ms
            bar += BAR_CHARS[name] * (round(at / per_char) - len(bar))
        lines.append(f"  {kind:<14} |{bar:<{BAR_WIDTH}}| {at:.0f} ms")
    used = {name for kind_steps in steps.values() for name, _ in kind_steps}
    lines.append("  key: " + "  ".join(f"{BAR_CHARS[name]} {name}" for name, _ in PROBE_STEPS if name in used))
    return lines


def render(ev: Evidence, diagnosis: Diagnosis) -> str:
    """The whole human report: probe table, waterfalls, the relay's view, findings, verdict."""
    counts = ", ".join(f"{k} {len(ev.ok(k))}/{len(ev.of(k))}" for k in KINDS if ev.of(k))
    lines = [f"probes ok: {counts}; relay records joined: {len(ev.records)}", ""]
    lines += render_table(table(ev), PROBE_PHASES, "ms, median (min–max)")
    if waterfall := render_waterfall(ev):
        lines += ["", *waterfall]
    relay_rows = relay_table(ev)
    if relay_rows:
        lines += [""] + render_table(relay_rows, next(iter(relay_rows.values())).keys(), "the relay's side")
    lines += ["", "findings:"]
    for f in diagnosis.findings:
        flag = "!!" if f.fatal else "! " if f.significant else "  "
        size = f" {f.ms:.0f} ms —" if f.weighed and not f.fatal else ""
        lines.append(f" {flag} {f.cause}:{size} {f.detail}")
    lines.append("")
    v = diagnosis.verdict
    if v is None:
        lines.append("verdict: nothing stands out — every finding is below its threshold.")
    else:
        size = "" if v.fatal else f" ({v.ms:.0f} ms)"
        lines += [f"verdict: {v.cause}{size}", f"  what to do: {v.advice}"]
    if not (v and v.fatal) and (context := diagnosis.unweighed_context):
        rate = _rate(context.numbers["extra_tokens"] or 0.0, context.ms)
        lines.append(f"  not weighed: {rate} — pass --prompt-tokens N (your requests' usual prompt size) "
                     "to weigh the context against the rest")
    return "\n".join(lines)


def as_json(ev: Evidence, diagnosis: Diagnosis) -> dict[str, Any]:
    """The same report for machines."""
    v = diagnosis.verdict
    return {
        "probes": [asdict(p) | {"phases": p.phases()} for p in ev.probes],
        "table": {k: {n: asdict(s) for n, s in rows.items()} for k, rows in table(ev).items()},
        "relay_table": {k: {n: asdict(s) for n, s in rows.items()} for k, rows in relay_table(ev).items()},
        "relay_records_joined": len(ev.records),
        "prompt_size": asdict(ev.prompt_size) if ev.prompt_size else None,
        "findings": [f.as_dict() for f in diagnosis.findings],
        "verdict": v.as_dict() if v else None,
    }
