"""Marks on a request's timeline → phases → a verdict in words (pure).

Marks are milliseconds relative to the moment the request head reached the
relay (`request.timestamp_start` = 0). They can be negative: the client's
connection was set up before its first request, the kernel may have held the
request's bytes before the relay read them, and with mitmproxy's default
`connection_strategy=eager`, reverse mode (and regular mode on CONNECT) opens the
upstream connection as soon as the client connects, reading the client's request
only once that connection is ready.

    client_syn              the client's TCP handshake began: its SYN reached the relay  } the first
                            (`selfwatch`: the handshake's duration, from TCP_INFO)        } request of
    client_tcp              ... and was done: the client's ACK reached the relay          } a client
    relay_serving           this relay process began to serve: only when the client's connection
                            waited in the kernel's queue for its start (selfwatch)
    client_connect          client connection accepted                                    } a client
    client_tls              client's TLS handshake with the relay done (TLS clients)      } connection
    client_arrived          the kernel had this request's bytes while the relay had not read
                            them (a busy event loop, or an early upstream connect): `selfwatch`
    request_body            last request body byte from the client
    body_arrived            the kernel had that last byte (selfwatch)
    forwarded               every request hook has run (trimming included)
    upstream_connect_start  upstream connect begins (includes the DNS lookup)    } only when
    upstream_tcp            TCP is up                                           } this request
    upstream_tls            upstream TLS handshake done (https upstreams only)  } opened it
    upstream_sent           the relay's kernel sent the request's last byte: only when that was
                            later than the relay wrote it (the connection's congestion window
                            was too small for the request: the upload's extra round trips; a
                            segment retransmitted), on an HTTP/1 connection or an HTTP/2 one
                            that carried no other stream meanwhile (selfwatch)
    upstream_resent         the relay's kernel last sent the request again: only when it was
                            retransmitted on the way, on an HTTP/1 connection or an HTTP/2 one
                            that carried no other stream until the head (selfwatch)
    head_arrived            the kernel had the response head (selfwatch)
    response_head           response head parsed
    first_byte              first response body chunk
    longest_gap             the longest silence between two response chunks began (it lasted
                            `max_gap_ms`): before the first token (prefill) or after it (a stall)
    first_event             first complete SSE event
    token_arrived           the kernel had the chunk of the first token (selfwatch)
    first_token             first visible output (text, reasoning, tool-call arguments)
    last_token              last visible output
    end                     response complete, or the error

The request's clock starts at its first byte: `client_arrived` when the kernel
held the request, else the head. Everything on its connection before that is
`connection_setup`, a phase of its own outside ttft: the TCP handshake, CONNECT,
the TLS handshake with the relay (and the upstream connect mitmproxy makes during
it), and any time the client let the connection idle before it wrote the request
(a client that opens a connection ahead of need). A kept-alive connection's later
requests have none.

Phases after the start are the request's *critical path*: the slices of the
client's wait that each hop is responsible for. They do not overlap, and for a
streamed answer

    relay_queue + client_upload + relay + upstream_connect + upstream_tls
        + upstream_upload + upstream_wait + head_to_first_token == ttft

Before the head was read the request's bytes were held: by an early upstream
connect (its connect and TLS handshake count where they overlap that time) or by
the busy relay (`relay_queue`). A lazy connect that overlapped the upload counts
only where it outlasted `forwarded`. A reused connection has no connect or TLS
phase. A request that failed or was cut before its first token (`unfinished`:
the phase it was in) has that phase run on to `end`, so its phases add up to
`total`: no wait falls outside them.

    connection_setup     client_syn (or client_connect) → the request's first byte: outside ttft
    relay_queue          bytes the kernel held because the relay did not read them yet:
                         the request before the head was read (client_arrived → head,
                         except an early connect it waited on), a body read late
                         (body_arrived → request_body), the first token read late
                         (token_arrived → first_token; the head, for an answer not
                         streamed as tokens). Only with the `*_arrived` marks; the other
                         phases then hold only time outside the relay
    client_upload        client's link: head → last body byte (its arrival)
    relay                last body byte → forwarded, plus forwarded → connect start
    upstream_connect     critical part of DNS + TCP connect
    upstream_tls         critical part of the upstream TLS handshake
    upstream_upload      max(forwarded, connection ready) → the request's last byte left the
                         relay's kernel (`upstream_sent`): the round trips the request's
                         upload took beyond its first flight, and its retransmissions
    upstream_wait        the request sent → response head: one network round trip plus
                         the upstream's queueing and prefill
    head_to_first_token  response head → first token (prefill, for upstreams that
                         send their head at once)
    response_body        response head → end, for an answer that was not streamed
    stream               first → last token
    ttft                 start → first token; for an answer not streamed as tokens,
                         start → end (time to the full response)
    total                start → end
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MARKS = (
    "client_syn",
    "client_tcp",
    "relay_serving",
    "client_connect",
    "client_tls",
    "client_arrived",
    "request_body",
    "body_arrived",
    "forwarded",
    "upstream_connect_start",
    "upstream_tcp",
    "upstream_tls",
    "upstream_sent",
    "upstream_resent",
    "head_arrived",
    "response_head",
    "first_byte",
    "longest_gap",
    "first_event",
    "token_arrived",
    "first_token",
    "last_token",
    "end",
)

CRITICAL_PHASES = (
    "relay_queue",
    "client_upload",
    "relay",
    "upstream_connect",
    "upstream_tls",
    "upstream_upload",
    "upstream_wait",
    "head_to_first_token",
    "response_body",
)
"""In timeline order; together they cover the client's wait up to `ttft`."""

SETUP_PHASE = "connection_setup"
"""Before the request's first byte: outside ttft and the critical path (see the docstring)."""

PHASES = (SETUP_PHASE,) + CRITICAL_PHASES + ("stream", "ttft", "total")

HEAD_TIME_PHASES = ("relay_queue", "client_upload", "relay", "upstream_connect", "upstream_tls", "upstream_upload",
                    "upstream_wait")
"""The phases complete when the response head leaves for the client (Server-Timing)."""

# Verdict words.
CLIENT_NETWORK = "client network (round trip)"
RELAY_SATURATED = "relay saturated"
RELAY_STARTING = "relay starting"
"""What the kernel held for a relay process that was not serving yet: a start or a restart, not load."""
CLIENT_UPLOAD = "client upload"
RELAY = "relay"
UPSTREAM_CONNECT = "upstream connect"
UPSTREAM_TLS = "upstream TLS"
UPSTREAM_NETWORK = "upstream network (round trip)"
UPSTREAM_LINK = (UPSTREAM_CONNECT, UPSTREAM_TLS, UPSTREAM_NETWORK)
"""One hop, judged as one: what the link to the upstream cost (`judge`, `link_words`)."""
UPSTREAM_WAIT = "upstream wait (prefill/queue)"
"""The upstream's own wait out of line with what its line's first requests took, before
enough was learned to tell its prefill from its queue; or, for an answer with no first
token to learn from (not streamed, a prompt of unknown size), its wait against nothing."""
UPSTREAM_QUEUEING = "upstream queueing"
UPSTREAM_ANSWER = "upstream wait"
"""A WebSocket handshake's or a prewarm's upstream wait: neither has a prefill to tell apart."""
RESPONSE_DOWNLOAD = "response download"
STREAM_STALL = "stream stall"
OK = "ok"
CONTEXT_LENGTH = "context length"
PROMPT_CACHE_MISS = "prompt cache miss"
UNKNOWN = "unknown"
RELAY_SHUTTING_DOWN = "relay shutting down"
"""A request the relay ended (or refused) because it stops: the error it records, and the verdict."""
UPSTREAM_REFUSED = "upstream refused"
UPSTREAM_FAILED = "upstream failed"
UPSTREAM_FAILED_OVER = "upstream failed over"
"""An upstream group's member failed before its answer's head and the next one answered
(`record.failover_detail`): what the client waited for is mostly the failure's."""
UPSTREAM_HEDGED = "upstream hedged"
"""An upstream group's member had no head by its bound and the request went to the next as
well (`record.hedge_detail`): which one answered first, and when."""


def waited_for_another(route: Mapping[str, Any] | None) -> bool:
    """Whether the answer's wait holds another attempt's: a member failed over from, or a
    hedge that won (its request went when the first member's had waited to its bound)."""
    hedged = (route or {}).get("hedged") or {}
    return bool((route or {}).get("failed_over")) or (hedged.get("won") is not None
                                                      and hedged.get("won") == hedged.get("upstream"))


REFUSED_BY_RELAY = "refused by relay"

STATUS_REASONS = {
    400: "bad request", 401: "key not accepted", 402: "payment required", 403: "forbidden", 404: "not found",
    408: "request timeout", 409: "conflict", 413: "request too large", 422: "invalid request",
    429: "rate limited", 500: "internal error", 502: "bad gateway", 503: "unavailable", 504: "gateway timeout",
    529: "overloaded",
}
"""A failure status in a refusal's words (`failure_words`): what the APIs mean by it."""
DECLINED_5XX = (503, 529)
"""Server errors that are a refusal (unavailable, overloaded: the provider declines the load), not a failure."""

PHASE_WORDS = {
    "relay_queue": "relay queue",
    "client_upload": CLIENT_UPLOAD,
    "relay": RELAY,
    "upstream_connect": UPSTREAM_CONNECT,
    "upstream_tls": UPSTREAM_TLS,
    "upstream_upload": "upstream upload",
    "upstream_wait": "upstream wait",
    "head_to_first_token": "head to first token",
    "response_body": "response body",
    "stream": "stream",
}

NEAR_TIE = 0.05
"""A later contributor must beat the leader by more than this fraction to win."""

NOISE_MS = 50.0
"""No hop is out of line by less than this: on loopback a kept client connection's smoothed
RTT reads 2.4–7 ms, a WebSocket handshake takes 3–15 ms, a loaded event loop runs tens of ms
late; none of that is a reason a person waited."""
SHARE = 0.25
"""Nor by less than this share of the wait: a far link that adds 150 ms to a 2 s prefill is
not why that first token was slow."""
CONTEXT_SHARE = 0.5
"""The prompt explains a wait (`context length`) when its predicted share is at least this."""
STALL_MIN_MS = 300.0
"""A silence mid-stream shorter than this is no stall, whatever the stream's pace."""
STALL_RATIO = 8.0
"""A silence is a stall only at this many times the stream's own gap between chunks: a
stream whose events come 10 ms apart has 10 ms gaps, and that is its cadence."""


ARRIVAL_MARKS = ("client_arrived", "body_arrived", "head_arrived", "token_arrived")
"""When the kernel had bytes the relay read later: `selfwatch`'s, from TCP_INFO."""


def relative_marks(absolute: Mapping[str, float | None], origin: float) -> dict[str, float]:
    """Absolute `time.time()` marks → ms since `origin`, in timeline order; None: not reached."""
    return {
        name: round((t - origin) * 1000, 3)
        for name in MARKS
        if (t := absolute.get(name)) is not None
    }


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def compute(marks: Mapping[str, float], *, tokens_expected: bool, unfinished: str | None = None) -> dict[str, float]:
    """Phase durations in ms from relative marks; a phase whose marks are missing
    (an error cut the request short, a reused connection) is absent.

    `tokens_expected`: the answer was streamed as events, so the time to first
    token is `first_token`; otherwise it is the time to the full response.
    `unfinished`: the critical phase the request failed or was cut in (`error_phase`),
    which then runs on to `end`.
    """
    m = marks
    body, fwd = m.get("request_body"), m.get("forwarded")
    # When the kernel had the body: the relay may have read it later (selfwatch).
    body_in = body if body is None or m.get("body_arrived") is None else min(body, m["body_arrived"])
    conn0, tcp, tls = m.get("upstream_connect_start"), m.get("upstream_tcp"), m.get("upstream_tls")
    head, first, last, end = m.get("response_head"), m.get("first_token"), m.get("last_token"), m.get("end")

    start = clock_start(m)
    p: dict[str, float] = {}
    setup_from = m.get("client_syn", m.get("client_connect"))
    if setup_from is not None:
        p[SETUP_PHASE] = max(0.0, start - setup_from)

    # Until the head was read the request's bytes were held: by an early upstream
    # connect where one ran (the request waited on it), else by the relay.
    # An early connect that never finished held them until it failed (the head was read after).
    pre_connect, pre_tls = 0.0, 0.0
    if conn0 is not None and conn0 < 0:
        pre_connect = _overlap(start, 0.0, conn0, tcp if tcp is not None else 0.0)
        pre_tls = _overlap(start, 0.0, tcp, tls) if tcp is not None and tls is not None else 0.0
    queue = -start - pre_connect - pre_tls

    if body is not None and body_in is not None:  # body_in is None exactly when body is
        queue += body - max(body_in, 0.0)
        p["client_upload"] = max(0.0, body_in)
    sent = None
    if body is not None and fwd is not None:
        relay = max(0.0, fwd - body)
        sent = fwd
        if conn0 is not None and tcp is not None:  # a new connection
            ready = tls if tls is not None else tcp
            sent = max(fwd, ready)
            connect = _overlap(fwd, sent, conn0, tcp)
            handshake = _overlap(fwd, sent, tcp, tls) if tls is not None else 0.0
            # Between the last request hook and the connect starting, the relay is busy.
            relay += (sent - fwd) - connect - handshake
            p["relay"] = relay
            p["upstream_connect"] = pre_connect + connect
            if tls is not None:
                p["upstream_tls"] = pre_tls + handshake
        else:
            p["relay"] = relay
    if pre_connect and "upstream_connect" not in p:
        p["upstream_connect"] = pre_connect  # a connect that failed (or a request that got no further)
    reached_first_token = False
    # The upstream's side ends when the kernel had its bytes; the relay read them later.
    head_in = head
    if head is not None and sent is not None and m.get("head_arrived") is not None:
        head_in = max(sent, min(head, m["head_arrived"]))
    if sent is not None and (kernel_sent := m.get("upstream_sent")) is not None:
        # The upstream waits for the request's last byte: the time its upload took after the
        # relay wrote it is the link's (a congestion window it did not fit in, a segment lost).
        upload_end = max(sent, kernel_sent if head_in is None else min(kernel_sent, head_in))
        p["upstream_upload"] = upload_end - sent
        sent = upload_end
    if head is not None and head_in is not None:
        if sent is not None:
            p["upstream_wait"] = max(0.0, head_in - sent)
        if tokens_expected and first is not None:
            first_in = first if m.get("token_arrived") is None else max(head_in, min(first, m["token_arrived"]))
            p["head_to_first_token"] = max(0.0, first_in - head_in)
            queue += first - first_in
            reached_first_token = True
        else:
            queue += head - head_in
            if not tokens_expected and end is not None:
                p["response_body"] = max(0.0, end - head)
                p["ttft"] = end - start
                reached_first_token = True
    if tokens_expected:
        if first is not None and last is not None:
            p["stream"] = max(0.0, last - first)
        if first is not None:
            p["ttft"] = first - start
    if any(m.get(name) is not None for name in ARRIVAL_MARKS):
        p["relay_queue"] = queue
    if end is not None:
        p["total"] = end - start
        if unfinished in CRITICAL_PHASES and not reached_first_token:
            # The wait from the last mark reached to the failure is the unfinished phase's.
            covered = sum(p.get(name, 0.0) for name in CRITICAL_PHASES)
            p[unfinished] = p.get(unfinished, 0.0) + max(0.0, p["total"] - covered)
    return {name: round(p[name], 3) for name in PHASES if name in p}


def handshake_rtt_ms(marks: Mapping[str, float], tls_version: str | None) -> float | None:
    """One network round trip to the upstream, learned from this request's new
    connection, or None.

    The TLS handshake is preferred: it crosses every hop to the real server,
    whereas a local forwarder or proxy can complete the TCP connect itself. TLS
    1.3 takes one round trip, older versions two. Without TLS the TCP connect is
    used, which includes the DNS lookup (an overestimate on a cold cache).
    """
    tcp, tls, conn0 = marks.get("upstream_tcp"), marks.get("upstream_tls"), marks.get("upstream_connect_start")
    if tcp is not None and tls is not None:
        rtts = 1 if tls_version in (None, "TLSv1.3") else 2
        return max(0.0, tls - tcp) / rtts
    if tcp is not None and conn0 is not None:
        return max(0.0, tcp - conn0)
    return None


@dataclass(frozen=True, slots=True)
class Gap:
    """The longest silence between response chunks, after the first token, and the stream's
    own pace around it."""

    ms: float
    cadence_ms: float | None
    """The mean of the stream's other gaps between chunks; None with fewer than three chunks."""

    @property
    def out_of_line(self) -> bool:
        """A stall: long enough to notice, and many times the stream's own cadence."""
        return self.ms >= STALL_MIN_MS and (self.cadence_ms is None or self.ms >= STALL_RATIO * self.cadence_ms)


def gap_after_first_token(marks: Mapping[str, float], max_gap_ms: float | None, chunks: int | None) -> Gap | None:
    """The longest silence between response chunks (`max_gap_ms`) if it came after the first
    token, with the stream's cadence; None when it came before (it was prefill, already in
    `head_to_first_token`) or there was none.

    Where the silence began (`longest_gap`) says which; without that mark (an older
    record), only a gap longer than first byte → first token must lie after the first token.
    """
    first_byte, first_token = marks.get("first_byte"), marks.get("first_token")
    if not max_gap_ms or first_token is None:
        return None
    began = marks.get("longest_gap")
    if began is not None:
        if began + 0.001 < first_token:
            return None
    elif max_gap_ms <= first_token - (first_byte if first_byte is not None else first_token) + 1.0:
        return None
    last = marks.get("end", marks.get("last_token"))
    cadence = None
    if chunks is not None and chunks >= 3 and first_byte is not None and last is not None:
        others = last - first_byte - max_gap_ms
        cadence = others / (chunks - 2) if others >= 0 else None
    return Gap(max_gap_ms, cadence)


def contributions(
    phases: Mapping[str, float],
    *,
    rtt_ms: float | None,
    upstream_ms: float | None = None,
    stall: float = 0.0,
    loop_lag_ms: float | None = None,
    client_rtt_ms: float | None = None,
    upstream_retransmit_ms: float | None = None,
) -> dict[str, float]:
    """What each hop cost the client, in verdict words, in timeline order.

    The client's request and its first token each cross the client's link once:
    one round trip that no mark shows, least of all on a kept-alive connection
    (`client_rtt_ms`: what the link cost, `record.client_link_ms`: the path's
    minimum RTT from the kernel, plus time lost to retransmission timeouts).
    The relay is saturated by what the kernel held for it (`relay_queue`) or,
    mid-stream, by a stall its own event loop explains: the part of the longest
    silence up to the loop's worst lag during the request (`loop_lag_ms`) is the
    relay's, the rest the stream's.
    The upstream wait always holds one network round trip (the request out, the
    head back): it is split into network and the upstream's own wait, which is how
    a far-away upstream differs from a slow one. Where the upstream says how long it
    worked on the request before its head (`upstream_ms`, OpenAI's
    `openai-processing-ms`), the rest of the wait is network; otherwise the
    round-trip estimate is, plus what the link lost to retransmissions before the
    first token (`upstream_retransmit_ms`): a lossy link, not a slow server. The
    request's upload beyond its first flight (`upstream_upload`) is the link's too.
    The time from head to first token is the upstream's too (prefill after an early head).
    """
    wait = phases.get("upstream_wait", 0.0)
    if upstream_ms is not None:
        network = max(0.0, wait - upstream_ms)
    else:
        # A lost segment of the answer delays the first token after the head as well.
        network = min(rtt_ms or 0.0, wait)
        network += min(upstream_retransmit_ms or 0.0, wait - network + phases.get("head_to_first_token", 0.0))
    own = wait - network + phases.get("head_to_first_token", 0.0)
    network += phases.get("upstream_upload", 0.0)
    relay_stall = min(stall, loop_lag_ms or 0.0)
    return {
        CLIENT_NETWORK: client_rtt_ms or 0.0,
        RELAY_SATURATED: max(phases.get("relay_queue", 0.0), relay_stall),
        CLIENT_UPLOAD: phases.get("client_upload", 0.0),
        RELAY: phases.get("relay", 0.0),
        UPSTREAM_CONNECT: phases.get("upstream_connect", 0.0),
        UPSTREAM_TLS: phases.get("upstream_tls", 0.0),
        UPSTREAM_NETWORK: network,
        UPSTREAM_WAIT: own,
        RESPONSE_DOWNLOAD: phases.get("response_body", 0.0),
        STREAM_STALL: stall - relay_stall,
    }


def dominant(contrib: Mapping[str, float]) -> str:
    """The largest contributor; near-ties go to the earlier one on the timeline.

    On a fresh connection the TLS handshake and the request's own round trip
    cost one round trip each: the handshake, which connection reuse removes, is
    named.
    """
    best, best_ms = UNKNOWN, 0.0
    for name, ms in contrib.items():
        if ms > best_ms * (1 + NEAR_TIE) and ms > 0:
            best, best_ms = name, ms
    return best


def starting_ms(marks: Mapping[str, float], phases: Mapping[str, float]) -> float | None:
    """The part of the relay's queue (`relay_queue`) held before this relay process began to
    serve (`relay_serving`, relative marks); None when it served already."""
    serving = marks.get("relay_serving")
    if serving is None or "relay_queue" not in phases:
        return None
    return round(min(phases["relay_queue"], max(0.0, serving - clock_start(marks))), 3)


def clock_start(marks: Mapping[str, float]) -> float:
    """Where the request's clock starts on its relative marks: at its first byte, when the
    kernel had it (`client_arrived`) if the relay read it later, else at the head (0)."""
    return min(0.0, marks.get("client_arrived", 0.0))


def error_phase(marks: Mapping[str, float], *, tls_expected: bool, tokens_expected: bool) -> str:
    """The phase a request was in when it failed: the first one left unfinished."""
    if "request_body" not in marks:
        return "client_upload"
    if "forwarded" not in marks:
        return "relay"
    if "response_head" not in marks:
        if "upstream_connect_start" in marks and "upstream_tcp" not in marks:
            return "upstream_connect"
        if tls_expected and "upstream_tcp" in marks and "upstream_tls" not in marks:
            return "upstream_tls"
        return "upstream_wait"
    if not tokens_expected:
        return "response_body"
    if "first_token" not in marks:
        return "head_to_first_token"
    return "stream"


@dataclass(frozen=True, slots=True)
class Setup:
    """Where a connection's set-up went, for the verdict on its first request: what the client
    felt before its request's clock started (`setup`)."""

    client_ms: float
    """The client's link: its TCP handshake, and the round trips of its CONNECT and TLS handshake."""
    relay_ms: float
    """The relay's: the connection waiting to be accepted, the TLS handshake beyond its round trips
    (a busy or starting relay reads the client's handshake late)."""
    starting_ms: float
    """Of `relay_ms`, what was held before this relay process began to serve (`relay_serving`)."""
    upstream_connect_ms: float
    """An upstream connect the client's TLS handshake waited on (mitmproxy's eager connect) ..."""
    upstream_tls_ms: float
    """... and that connection's TLS handshake."""


def setup(marks: Mapping[str, float], *, client_rtt_ms: float | None, round_trips: int | None,
          loop_lag_ms: float | None = None) -> Setup | None:
    """Split a first request's `connection_setup` (relative marks, from `client_syn`) into the
    client's link, the relay and an upstream connect; None without the set-up's marks.

        client_syn → client_tcp      the TCP handshake: the client's link
        client_tcp → client_connect  the accept queue: the relay's
        client_connect → client_tls  `round_trips` client round trips (a CONNECT, the TLS
                                     handshake: 1 for TLS 1.3, 2 before), an upstream connect
                                     it waited on; the rest the relay's as far as the relay had
                                     not served yet or its event loop ran late (`loop_lag_ms`),
                                     else the handshake's own work at either end: no one's hop
        → the request's first byte   the client's own idle time: no one's wait, left out

    Each stretch ends at the request's first byte at the latest: what the kernel held after it
    is already `relay_queue`.
    """
    syn, tcp, accepted = marks.get("client_syn"), marks.get("client_tcp"), marks.get("client_connect")
    if syn is None or tcp is None or accepted is None:
        return None
    start = clock_start(marks)
    tls = marks.get("client_tls")
    handshake = max(0.0, min(tcp, start) - syn)
    relay_spans = [(tcp, min(accepted, start))]
    upstream_connect = upstream_tls = 0.0
    if tls is not None and tls > accepted:
        end = min(tls, start)
        conn0, up_tcp, up_tls = marks.get("upstream_connect_start"), marks.get("upstream_tcp"), marks.get("upstream_tls")
        if conn0 is not None and up_tcp is not None:
            upstream_connect = _overlap(accepted, end, conn0, up_tcp)
            upstream_tls = _overlap(accepted, end, up_tcp, up_tls) if up_tls is not None else 0.0
        upstream = upstream_connect + upstream_tls
        client = min(max(0.0, end - accepted - upstream), (client_rtt_ms or 0.0) * (round_trips or 0))
        # The relay's part of the handshake: its end, after the client's round trips and the connect.
        rest = accepted + upstream + client
        before_serving = _overlap(rest, end, rest, marks.get("relay_serving", rest))
        relay_spans.append((rest, min(end, rest + before_serving + (loop_lag_ms or 0.0))))
        handshake += client
    relay = sum(max(0.0, b - a) for a, b in relay_spans)
    serving = marks.get("relay_serving")
    starting = 0.0 if serving is None else sum(_overlap(a, b, a, serving) for a, b in relay_spans)
    return Setup(round(handshake, 3), round(relay, 3), round(starting, 3), round(upstream_connect, 3),
                 round(upstream_tls, 3))


@dataclass(frozen=True, slots=True)
class Expectation:
    """What the upstream's own wait for this request's prompt should be, learned from the
    traffic to its upstream · model (`ttft_relay/observe/prefill.py`)."""

    own_ms: float
    """The upstream's own wait (queue and prefill, one round trip taken out) this prompt predicts."""
    tolerance_ms: float
    """How far beyond `own_ms` a wait is still in line (the traffic's own spread, and more)."""
    prompt_ms: float
    """The part of `own_ms` the prompt's tokens account for (the rest: the model's base)."""
    uncached_tokens: int
    cached_tokens: int
    ms_per_1k: float | None
    """The learned rate per 1k uncached prompt tokens; None while prompt sizes did not vary enough."""
    learned_from: int
    """Requests behind the prediction."""
    provisional: bool = False
    """Fewer requests than a fit needs: what the line's first requests with prompts at least
    as long took (`prefill.provisional`); a wait beyond it is `upstream wait
    (prefill/queue)`, the prompt's share and the queue not told apart yet."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verdict: its words (one of a few, for grouping and counting) and what they stand on."""

    words: str
    detail: str | None = None
    """The numbers behind it, one sentence: how far out of line, or what it was in line with."""
    expected_ttft_ms: float | None = None
    """This request's first token had the upstream waited what its prompt predicts."""


def failure_words(error: str | None, error_phase: str | None, status: int | None, *, upstream_answered: bool) -> str:
    """A failed request's verdict: who refused it and why, where the record tells.

    The relay stopping (`RELAY_SHUTTING_DOWN`, whichever phase it cut); the upstream's own
    answer with a failure status (`upstream_answered`): `upstream refused: <reason> (<status>)`
    for a 4xx, 503 or 529, `upstream failed: …` for another 5xx; the relay's own refusal (a 4xx
    it answered before forwarding): `refused by relay: <reason>`; else `error in <phase>`.
    """
    reason = STATUS_REASONS.get(status or 0) or f"status {status}"
    if error == RELAY_SHUTTING_DOWN:
        return RELAY_SHUTTING_DOWN
    if status is not None and status >= 400 and upstream_answered:
        refused = status < 500 or status in DECLINED_5XX
        return f"{UPSTREAM_REFUSED if refused else UPSTREAM_FAILED}: {reason} ({status})"
    if status is not None and 400 <= status < 500 and error_phase == "relay":
        return f"{REFUSED_BY_RELAY}: {reason}"
    return f"error in {PHASE_WORDS.get(error_phase or '', error_phase or 'unknown phase')}"


def where_time_went(phases: Mapping[str, float]) -> str:
    """The critical phases that held a failed request's time, largest first, in a few words."""
    held = sorted(((ms, name) for name in CRITICAL_PHASES if (ms := phases.get(name, 0.0)) >= 1.0), reverse=True)
    return ", ".join(f"{PHASE_WORDS.get(name, name)} {_s(ms)}" for ms, name in held[:3]) or "no time in any phase"


def judge(
    phases: Mapping[str, float],
    *,
    rtt_ms: float | None = None,
    upstream_ms: float | None = None,
    gap: Gap | None = None,
    error: str | None = None,
    error_phase: str | None = None,
    client_aborted: bool = False,
    loop_lag_ms: float | None = None,
    client_rtt_ms: float | None = None,
    no_prefill: bool = False,
    expectation: Expectation | None = None,
    unlearned: str | None = None,
    learning: bool = False,
    cache_miss: str | None = None,
    upstream_retransmit_ms: float | None = None,
    starting_ms: float | None = None,
    status: int | None = None,
    upstream_answered: bool = False,
    setup: Setup | None = None,
) -> Verdict:
    """The request's verdict: `ok` unless a phase is out of line, else the phase that is most.

    1. A client abort: `client aborted in <phase>`; any other failure (transport error,
       error event in the stream, HTTP status >= 400): who refused it and why where that is
       known (`failure_words`: the relay stopping, the upstream's failure `status` when it
       `upstream_answered`, the relay's own refusal), else `error in <phase>`; its detail
       says where its time went.
    2. Each hop's cost (`contributions`) against what is normal for it:
       - the upstream's own wait against the `expectation` for this prompt: beyond
         `own_ms + tolerance_ms` it is `upstream queueing`, out of line by the difference.
         Without an expectation (not learned yet: `unlearned` says why) it is
         `upstream wait (prefill/queue)`, prefill and queueing not told apart, against
         nothing; but while the relay is `learning` the line (its first requests, a
         prompt longer than any learned) a wait with no expectation is out of line with
         nothing (never a slow hop for what the relay does not know yet), and one with a
         provisional expectation (`Expectation.provisional`) beyond it is `upstream wait
         (prefill/queue)`, out of line with what the first requests took. A WebSocket
         handshake or a prewarm (`no_prefill`) has no prefill and no first token: its
         upstream wait (a prewarm's events up to the last included) is `upstream wait`,
         against nothing;
       - the longest silence after the first token (`gap`) against the stream's own
         cadence: a `stream stall` when `Gap.out_of_line` (the part the relay's own event
         loop explains, up to `loop_lag_ms`, is `relay saturated`);
       - the relay's queue: `relay saturated`, or `relay starting` where at least half of
         it (`starting_ms`) was held before this relay process began to serve;
       - the upstream's link as one hop: its connect, TLS handshake and round trips (the
         request's, its upload's beyond the first flight, what retransmissions cost) together,
         named after its connect or TLS handshake where one of them cost two thirds of it, else
         `upstream network` (`link_words`): a far provider costs a round trip in each, none of
         which alone need be a large share of the wait;
       - every other hop (client network, relay queue, client upload, relay, response
         download) against nothing: any cost is its own.
       The first request on a connection is judged on the wait the client felt: from its SYN
       (`setup`), so the client's handshakes count as client network, the accept queue and a
       handshake the relay read late as the relay's (starting, where that was before it served).
       A hop is out of line when it costs at least NOISE_MS beyond its normal and at least
       SHARE of the wait (the first token, or the whole answer without one): a few ms of
       noise, or a far link that adds little to a long wait, never make a verdict. The hop
       most out of line is named; near-ties go to the earlier one on the timeline.
    3. Nothing out of line: `prompt cache miss` when the prompt explains the wait (below) and
       `cache_miss` says the provider read a repeated prefix uncached; `context length`
       when the prompt's predicted share (`prompt_ms`) is at least NOISE_MS and CONTEXT_SHARE
       of the wait; else `ok`.
    """
    where = PHASE_WORDS.get(error_phase or "", error_phase or "unknown phase")
    if client_aborted:
        return Verdict(f"client aborted in {where}")
    if error:
        words = failure_words(error, error_phase, status, upstream_answered=upstream_answered)
        total = phases.get("total")
        after = f" after {_s(total)}" if total is not None else ""
        why = f"{error}; " if words.startswith(REFUSED_BY_RELAY) else ""
        cut = f" in {where}" if words == RELAY_SHUTTING_DOWN else ""
        return Verdict(words, f"{why}ended{cut}{after} ({where_time_went(phases)})")
    stall = gap.ms if gap is not None and gap.out_of_line else 0.0
    contrib = contributions(phases, rtt_ms=rtt_ms, upstream_ms=upstream_ms, stall=stall,
                            loop_lag_ms=loop_lag_ms, client_rtt_ms=client_rtt_ms,
                            upstream_retransmit_ms=upstream_retransmit_ms)
    first = phases.get("ttft", phases.get("total", 0.0))
    wait = first
    if setup is not None:  # what the client felt before the request's clock started
        wait += setup.client_ms + setup.relay_ms + setup.upstream_connect_ms + setup.upstream_tls_ms
        contrib[CLIENT_NETWORK] += setup.client_ms
        contrib[RELAY_SATURATED] += setup.relay_ms
        contrib[UPSTREAM_CONNECT] += setup.upstream_connect_ms
        contrib[UPSTREAM_TLS] += setup.upstream_tls_ms
        starting_ms = (starting_ms or 0.0) + setup.starting_ms
    own = contrib[UPSTREAM_WAIT]
    expected_ttft = None
    if expectation is not None and not expectation.provisional and not no_prefill and "ttft" in phases:
        expected_ttft = round(max(0.0, first - own + expectation.own_ms), 1)
    relay_stall = min(stall, loop_lag_ms or 0.0)
    beyond: dict[str, float] = {}
    for name, ms in contrib.items():
        if name == STREAM_STALL:
            if ms > 0 and gap is not None:
                beyond[name] = ms - (gap.cadence_ms or 0.0)
            continue
        if name == RELAY_SATURATED and relay_stall > phases.get("relay_queue", 0.0):
            beyond[name] = ms  # a stall the loop explains: judged as a stall, not against the wait
            continue
        if name == RELAY_SATURATED and starting_ms and 2 * starting_ms >= ms:
            name = RELAY_STARTING
        if name in UPSTREAM_LINK:
            if name != UPSTREAM_LINK[0]:
                continue  # judged with the first
            name, ms = link_words(contrib), sum(contrib[part] for part in UPSTREAM_LINK)
        if no_prefill and name == RESPONSE_DOWNLOAD:
            continue  # a prewarm's events after its first one: the upstream's work, in its wait below
        if name == UPSTREAM_WAIT:
            if no_prefill:
                name, ms = UPSTREAM_ANSWER, ms + contrib[RESPONSE_DOWNLOAD]
            elif expectation is not None:
                if ms <= expectation.own_ms + expectation.tolerance_ms:
                    continue
                name = UPSTREAM_WAIT if expectation.provisional else UPSTREAM_QUEUEING
                ms -= expectation.own_ms
            elif learning:
                continue
        if ms >= NOISE_MS and ms >= SHARE * wait:
            beyond[name] = ms
    words = dominant(beyond)
    if words == UNKNOWN:
        return _in_line(first, expectation, expected_ttft, cache_miss, no_prefill, unlearned)
    detail = _out_of_line(words, beyond[words], wait, contrib, gap, expectation, expected_ttft, unlearned,
                          client_rtt_ms, loop_lag_ms, no_prefill, phases.get("upstream_upload"), setup)
    return Verdict(words, detail, expected_ttft)


LINK_PART_DOMINATES = 2 / 3
"""A part of the upstream link is named for it from this share on: twice the rest together. A
fresh connection costs a round trip in its connect (unless a forwarder beside the relay answers
it), one or two in its TLS handshake and one in its request: about half each, which is the
link's, not one part's."""


def link_words(contrib: Mapping[str, float]) -> str:
    """The upstream link's name in a verdict: its connect or its TLS handshake where that cost
    most of it (`LINK_PART_DOMINATES`: a connect that timed out and was tried again, a handshake
    the server was slow in), else its network (round trips)."""
    total = sum(contrib[part] for part in UPSTREAM_LINK)
    for part in (UPSTREAM_CONNECT, UPSTREAM_TLS):
        if contrib[part] >= LINK_PART_DOMINATES * total > 0:
            return part
    return UPSTREAM_NETWORK


def verdict(phases: Mapping[str, float], **inputs: Any) -> str:
    """The words of `judge`'s verdict."""
    return judge(phases, **inputs).words


def _s(ms: float) -> str:
    """A duration for a sentence: ms below a second, else seconds."""
    return f"{ms:.0f} ms" if ms < 999.5 else f"{ms / 1000:.1f} s"


def _tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _prompt(e: Expectation) -> str:
    return f"{_tokens(e.uncached_tokens + e.cached_tokens)} prompt tokens ({_tokens(e.cached_tokens)} cached)"


def _in_line(wait: float, e: Expectation | None, expected_ttft: float | None, cache_miss: str | None,
             no_prefill: bool, unlearned: str | None) -> Verdict:
    what = "the answer" if no_prefill else "first token"
    why = f" ({unlearned})" if unlearned else ""
    if e is not None and e.provisional:
        return Verdict(OK, f"{what} {_s(wait)}, in line with the {_s(e.own_ms)} the upstream's own wait took on "
                       f"this line's first requests{why}")
    if e is None or expected_ttft is None:
        return Verdict(OK, f"{what} {_s(wait)}, nothing out of line{why}", expected_ttft)
    prompt_explains = e.prompt_ms >= NOISE_MS and e.prompt_ms >= CONTEXT_SHARE * wait
    rate = f" at {e.ms_per_1k:.0f} ms per 1k" if e.ms_per_1k is not None else ""
    if prompt_explains and cache_miss:
        return Verdict(PROMPT_CACHE_MISS, f"first token {_s(wait)}: {_prompt(e)} read uncached{rate} explain "
                       f"{_s(e.prompt_ms)} of it, although {cache_miss}", expected_ttft)
    if prompt_explains:
        return Verdict(CONTEXT_LENGTH, f"first token {_s(wait)}: {_prompt(e)}{rate} explain {_s(e.prompt_ms)} "
                       f"of it (this prompt predicts {_s(expected_ttft)})", expected_ttft)
    return Verdict(OK, f"first token {_s(wait)}, in line with the {_s(expected_ttft)} this prompt predicts",
                   expected_ttft)


def _out_of_line(words: str, ms: float, wait: float, contrib: Mapping[str, float], gap: Gap | None,
                 e: Expectation | None, expected_ttft: float | None, unlearned: str | None,
                 client_rtt_ms: float | None, loop_lag_ms: float | None, no_prefill: bool,
                 upload_ms: float | None, setup: Setup | None) -> str:
    """How far out of line the named hop is, in one sentence."""
    since = " from its connection's first packet" if setup is not None else ""
    share = f", {ms / wait:.0%} of the {_s(wait)}{since} {'it took' if no_prefill else 'to the first token'}" \
        if wait else ""
    if setup is not None and words in (RELAY_SATURATED, RELAY_STARTING) and setup.relay_ms >= 1.0:
        share += f" ({_s(setup.relay_ms)} of it before the relay read the new connection's request)"
    if words in UPSTREAM_LINK:
        upload = f", of which the request's upload {_s(upload_ms)}" if upload_ms else ""
        return (f"the link to the upstream {_s(ms)}{share} (connect {_s(contrib[UPSTREAM_CONNECT])}, TLS "
                f"{_s(contrib[UPSTREAM_TLS])}, round trips {_s(contrib[UPSTREAM_NETWORK])}{upload})")
    if words == UPSTREAM_QUEUEING and e is not None and expected_ttft:
        return (f"first token {_s(wait)}, {wait / expected_ttft:.1f}× the {_s(expected_ttft)} this prompt "
                f"predicts ({_prompt(e)}; the upstream's own wait {_s(contrib[UPSTREAM_WAIT])} against "
                f"{_s(e.own_ms)})")
    if words == UPSTREAM_WAIT:
        why = f" ({unlearned})" if unlearned else ""
        if e is not None and e.provisional:
            own = contrib[UPSTREAM_WAIT]
            return (f"the upstream's own wait {_s(own)}, {own / max(e.own_ms, 1.0):.1f}× the {_s(e.own_ms)} it took "
                    f"on this line's first requests{share}: prefill and queueing not told apart{why}")
        return f"the upstream's own wait {_s(ms)}{share}: prefill and queueing not told apart{why}"
    if words == STREAM_STALL and gap is not None:
        pace = f", {gap.ms / gap.cadence_ms:.0f}× the stream's {_s(gap.cadence_ms)} between chunks" \
            if gap.cadence_ms else ""
        return f"{_s(gap.ms)} of silence after the first token{pace}"
    if words == RELAY_SATURATED:
        return f"{_s(ms)} waiting on the relay itself (its event loop up to {_s(loop_lag_ms or 0.0)} late){share}"
    if words == RELAY_STARTING:
        return f"{_s(ms)} queued for this relay process while it started (a start or a restart, not load){share}"
    if words == CLIENT_NETWORK and setup is not None and setup.client_ms >= 1.0:
        return (f"the client's link {_s(ms)}: its connection's handshakes {_s(setup.client_ms)} and a "
                f"{_s(client_rtt_ms or 0.0)} round trip{share}")
    if words == CLIENT_NETWORK:
        return f"a {_s(client_rtt_ms or 0.0)} round trip to the client{share}"
    return f"{_s(ms)}{share}"


def advice(verdict: str, phases: Mapping[str, float], loop_lag_ms: float | None, setup: Setup | None = None) -> str | None:
    """What to do about a verdict that is the relay's own, with its numbers; else None. `setup`:
    a first request's, whose connection may have waited for the relay before its request."""
    if verdict != RELAY_SATURATED:
        return None
    queued = phases.get("relay_queue", 0.0) + (setup.relay_ms if setup is not None else 0.0)
    return (
        f"The relay was the slow hop: {queued:.0f} ms in its own queues, its event loop "
        f"up to {loop_lag_ms or 0.0:.0f} ms late. Run more workers (scripts/relay --workers N, one per core), "
        "keep other work off its cores, or switch off addons it does not need (relay_timing_console, relay_trim)."
    )


def server_timing(phases: Mapping[str, float]) -> str:
    """A `Server-Timing` header value with the phases known at response-head time."""
    return ", ".join(
        f"{name};dur={phases[name]:.1f}" for name in HEAD_TIME_PHASES if name in phases
    )
