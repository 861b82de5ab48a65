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
    upstream_resent         the relay's kernel last sent the request again: only when it was
                            retransmitted on the way (selfwatch)
    head_arrived            the kernel had the response head (selfwatch)
    response_head           response head parsed
    first_byte              first response body chunk
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
        + upstream_wait + head_to_first_token == ttft

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
    upstream_wait        max(forwarded, connection ready) → response head: one network
                         round trip plus the upstream's queueing and prefill
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

MARKS = (
    "client_syn",
    "client_connect",
    "client_tls",
    "client_arrived",
    "request_body",
    "body_arrived",
    "forwarded",
    "upstream_connect_start",
    "upstream_tcp",
    "upstream_tls",
    "upstream_resent",
    "head_arrived",
    "response_head",
    "first_byte",
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
    "upstream_wait",
    "head_to_first_token",
    "response_body",
)
"""In timeline order; together they cover the client's wait up to `ttft`."""

SETUP_PHASE = "connection_setup"
"""Before the request's first byte: outside ttft and the critical path (see the docstring)."""

PHASES = (SETUP_PHASE,) + CRITICAL_PHASES + ("stream", "ttft", "total")

HEAD_TIME_PHASES = ("relay_queue", "client_upload", "relay", "upstream_connect", "upstream_tls", "upstream_wait")
"""The phases complete when the response head leaves for the client (Server-Timing)."""

# Verdict words.
CLIENT_NETWORK = "client network (round trip)"
RELAY_SATURATED = "relay saturated"
CLIENT_UPLOAD = "client upload"
RELAY = "relay"
UPSTREAM_CONNECT = "upstream connect"
UPSTREAM_TLS = "upstream TLS"
UPSTREAM_NETWORK = "upstream network (round trip)"
UPSTREAM_WAIT = "upstream wait (prefill/queue)"
RESPONSE_DOWNLOAD = "response download"
STREAM_STALL = "stream stall"
UNKNOWN = "unknown"

PHASE_WORDS = {
    "relay_queue": "relay queue",
    "client_upload": CLIENT_UPLOAD,
    "relay": RELAY,
    "upstream_connect": UPSTREAM_CONNECT,
    "upstream_tls": UPSTREAM_TLS,
    "upstream_wait": "upstream wait",
    "head_to_first_token": "head to first token",
    "response_body": "response body",
    "stream": "stream",
}

NEAR_TIE = 0.05
"""A later contributor must beat the leader by more than this fraction to win."""


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

    # The clock starts at the request's first byte: when the kernel had it, if the relay read it later.
    arrived = m.get("client_arrived")
    start = min(0.0, arrived) if arrived is not None else 0.0
    p: dict[str, float] = {}
    setup_from = m.get("client_syn", m.get("client_connect"))
    if setup_from is not None:
        p[SETUP_PHASE] = max(0.0, start - setup_from)

    # Until the head was read the request's bytes were held: by an early upstream
    # connect where one ran (the request waited on it), else by the relay.
    pre_connect, pre_tls = 0.0, 0.0
    if conn0 is not None and tcp is not None and conn0 < 0:
        pre_connect = _overlap(start, 0.0, conn0, tcp)
        pre_tls = _overlap(start, 0.0, tcp, tls) if tls is not None else 0.0
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
    reached_first_token = False
    if head is not None:
        # The upstream's side ends when the kernel had its bytes; the relay read them later.
        head_in = head
        if sent is not None and m.get("head_arrived") is not None:
            head_in = max(sent, min(head, m["head_arrived"]))
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


def stall_ms(marks: Mapping[str, float], max_gap_ms: float | None) -> float:
    """The longest silence after the first token, as far as one `max_gap_ms` tells.

    A gap that fits between first byte and first token may be prefill (already in
    `head_to_first_token`); only a gap longer than that must lie after the first
    token, in the middle of the answer.
    """
    first_byte, first_token = marks.get("first_byte"), marks.get("first_token")
    if not max_gap_ms or first_token is None:
        return 0.0
    before_first_token = first_token - first_byte if first_byte is not None else 0.0
    return max_gap_ms if max_gap_ms > before_first_token + 1.0 else 0.0


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
    first token (`upstream_retransmit_ms`): a lossy link, not a slow server.
    The time from head to first token is the upstream's too (prefill after an early head).
    """
    wait = phases.get("upstream_wait", 0.0)
    if upstream_ms is not None:
        network = max(0.0, wait - upstream_ms)
    else:
        # A lost segment of the answer delays the first token after the head as well.
        network = min(rtt_ms or 0.0, wait)
        network += min(upstream_retransmit_ms or 0.0, wait - network + phases.get("head_to_first_token", 0.0))
    relay_stall = min(stall, loop_lag_ms or 0.0)
    return {
        CLIENT_NETWORK: client_rtt_ms or 0.0,
        RELAY_SATURATED: max(phases.get("relay_queue", 0.0), relay_stall),
        CLIENT_UPLOAD: phases.get("client_upload", 0.0),
        RELAY: phases.get("relay", 0.0),
        UPSTREAM_CONNECT: phases.get("upstream_connect", 0.0),
        UPSTREAM_TLS: phases.get("upstream_tls", 0.0),
        UPSTREAM_NETWORK: network,
        UPSTREAM_WAIT: wait - network + phases.get("head_to_first_token", 0.0),
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


def verdict(
    phases: Mapping[str, float],
    *,
    rtt_ms: float | None = None,
    upstream_ms: float | None = None,
    stall: float = 0.0,
    error: str | None = None,
    error_phase: str | None = None,
    client_aborted: bool = False,
    loop_lag_ms: float | None = None,
    client_rtt_ms: float | None = None,
    upstream_retransmit_ms: float | None = None,
) -> str:
    """The request's verdict in words.

    1. A client abort: `client aborted in <phase>`; any other failure (transport
       error, error event in the stream, HTTP status >= 400): `error in <phase>`.
    2. Otherwise the dominant contributor of `contributions` (largest, near-ties
       to the earlier phase): `client network (round trip)`, `relay saturated`,
       `client upload`, `relay`, `upstream connect`,
       `upstream TLS`, `upstream network (round trip)`, `upstream wait
       (prefill/queue)`, `response download`, or `stream stall` when the longest
       silence mid-stream outlasts every phase before the first token.
    """
    where = PHASE_WORDS.get(error_phase or "", error_phase or "unknown phase")
    if client_aborted:
        return f"client aborted in {where}"
    if error:
        return f"error in {where}"
    return dominant(contributions(phases, rtt_ms=rtt_ms, upstream_ms=upstream_ms, stall=stall,
                                  loop_lag_ms=loop_lag_ms, client_rtt_ms=client_rtt_ms,
                                  upstream_retransmit_ms=upstream_retransmit_ms))


def advice(verdict: str, phases: Mapping[str, float], loop_lag_ms: float | None) -> str | None:
    """What to do about a verdict that is the relay's own, with its numbers; else None."""
    if verdict != RELAY_SATURATED:
        return None
    return (
        f"The relay was the slow hop: {phases.get('relay_queue', 0.0):.0f} ms in its own queues, its event loop "
        f"up to {loop_lag_ms or 0.0:.0f} ms late. Run more workers (scripts/relay --workers N, one per core), "
        "keep other work off its cores, or switch off addons it does not need (relay_timing_console, relay_trim)."
    )


def server_timing(phases: Mapping[str, float]) -> str:
    """A `Server-Timing` header value with the phases known at response-head time."""
    return ", ".join(
        f"{name};dur={phases[name]:.1f}" for name in HEAD_TIME_PHASES if name in phases
    )
