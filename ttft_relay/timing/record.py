"""The timing record: one per flow, its schema, its text forms, and the JSONL writer.

A record holds timings, counts and names only: never header values, bodies or
keys, so a timing log can be shared. `Record` is its one definition: its fields, in
order, are the keys of a JSON line (schema `SCHEMA`), and docs/records.md's "Record schema"
table names them (tests/test_record.py holds the two together). Bump `SCHEMA`
whenever a key changes meaning or goes away (adding keys is compatible).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import orjson

from ..text import cut_text, printable
from . import logrotation, phases

logger = logging.getLogger(__name__)

SCHEMA = 1
REQUEST_ID_MAX = 128
"""A client's request id is kept for joining, not as evidence: longer ones are cut."""
MODEL_MAX = 256
"""A model name longer than any real one is cut (saying how long it was): a client's 200 KB
name was in every record, sink and trace of its request."""
HTTP = "http"
WEBSOCKET = "websocket"
WEBSOCKET_HANDSHAKE_FAILED = "websocket handshake failed"
ROUTE_REASONS = ("order", "exploring", "lowest", "sticky", "left_cache", "all_down")
"""Why an upstream group chose its member, in a word (`route.reason`, `ttft_relay/route/choice.py`;
the metrics' label and the report's): nothing learned yet, the group's order; a member whose
line is still learned, explored; the lowest expected first token; the member holding the
conversation's cache, kept; that member left for one quicker by more than the miss; every
member failed moments ago, tried in order."""
FAILOVER_CAUSES = ("connection", "slow_head", "429", "5xx")
"""Why an upstream group left a member before the answer's head, in a word (`route.failed_over`'s
`cause`, `ttft_relay/route/groups.py`): a connect, DNS or TLS failure or a connection closed
with no answer; no head by its bound; a 429; a 5xx."""
HEDGE = "hedge"
"""The duplicated prompt tokens' cause for a hedge's losing attempt (`route.hedged`)."""
HEDGE_WINNERS = ("first", "second")
"""Whose head came first in a hedge: the chosen member's, or the one hedged to."""
WAITED_INSTEAD_OF = {"not_hedged": HEDGE, "not_given_up": "slow_head"}
"""A late head waited for, no other member expected sooner than its remaining wait
(`choice.sooner_elsewhere`): the `route` field that says why → what was not done, in a word
(the metrics' `instead_of` label and the report's): a hedge, a slow head's give-up."""



@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One flow's (or WebSocket turn's) timing record; its JSON form is `as_dict()`.

    Frozen: `measure` makes it of what was seen, `judged` a copy with its verdict and
    what the observers learned (`Learned`), and that copy is what every sink gets."""

    schema: int = SCHEMA
    """This schema's version."""
    id: str
    """mitmproxy's flow id (a WebSocket turn: the flow's id, `#`, the turn)."""
    request_id: str | None
    """The client's `x-request-id` header (a correlation id, not a secret: `ttft-relay
    diagnose` joins its probes by it), cut to REQUEST_ID_MAX."""
    ts: float
    """Request head arrival, Unix seconds."""
    api: str
    """API shape (`apis.NAMES`)."""
    model: str | None
    """The model the request named (cut to MODEL_MAX)."""
    stream: bool
    """The client asked for a streamed answer."""
    status: int | None
    """Response status code."""
    upstream: str
    """Upstream host (":port" unless 80/443)."""
    marks: dict[str, float]
    """{mark: ms since the request head}, see `phases.MARKS`."""
    phases: dict[str, float]
    """{phase: ms}, see `phases.PHASES`; a phase is absent when unknown."""
    ttft_ms: float | None
    """Time to first token (to the full response when not streamed)."""
    reused_connection: bool | None
    """The request did not open its upstream connection (an earlier request, or the
    upstream pool ahead of it, did: no connect or TLS phase); None when none was made."""
    upstream_connection: str | None = None
    """Which upstream connection the request went on (mitmproxy's id of the connection; a
    pooled one keeps its id from client connection to client connection); None: none."""
    upstream_dial: dict[str, Any] | None = None
    """The upstream connect this request made (`ttft_relay/dial.py`): the address it used
    (`address`, `family`) and why each other address of the name did not serve (`failed`);
    None when the request opened no connection."""
    upstream_tls_resumed: bool | None = None
    """Whether the upstream TLS handshake this request waited for resumed a session
    (`ttft_relay/tls_resumption.py`: no certificate chain); None when it waited for none."""
    rtt_ms: float | None
    """The upstream round-trip estimate behind the verdict."""
    client_setup_round_trips: int | None = None
    """On a connection's first request: the client's round trips in its connection's set-up
    after the TCP handshake (a CONNECT's, one; its TLS handshake's: one for TLS 1.3, two
    before); None on a later request."""
    max_gap_ms: float | None
    """The longest silence between response chunks."""
    chunks: int | None
    """Response chunks the stream watcher saw."""
    bytes: int | None
    """Response body bytes the stream watcher saw."""
    output_tokens_per_s: float | None
    """Output tokens / (last_token - first_token)."""
    prompt_tokens: int | None
    """Prompt tokens the relay counted."""
    usage: dict[str, Any] | None
    """{input_tokens, output_tokens, cached_tokens, reasoning_tokens, ...} as the upstream reported them."""
    verdict: str
    """`ok`, or the phase most out of line, in words (`phases.judge`); `phases.UNKNOWN` until
    `judged`."""
    verdict_detail: str | None = None
    """The verdict's numbers in a sentence: how far out of line, or what the wait was in line with."""
    expected_ttft_ms: float | None = None
    """The first token had the upstream waited what this prompt predicts (learned per upstream ·
    model, `ttft_relay/observe/prefill.py`); None before that is learned."""
    error: str | None
    """What went wrong (transport error, stream error event, HTTP status), cut to `text.ERROR_MAX`."""
    error_phase: str | None
    """The phase it went wrong in."""
    client_aborted: bool
    """The client went away before the answer was complete."""
    trim: dict[str, Any] | None
    """What trimming did (owned by the trim addon)."""
    route: dict[str, Any] | None = None
    """On a listener with an upstream group (`ttft_relay/route/`): the `group` (the listener's
    upstream host), the member that served it (`upstream`), `why` it was chosen and the
    `reason` in a word (ROUTE_REASONS), each member's expected first token in ms
    (`expected_ms`, null: not known), and `failed_over`: the members left before the
    answer's head, why, and its `cause` in a word (FAILOVER_CAUSES); `hedged`: the member
    the request went to as well, when, and which one's head came first (`won`);
    `not_hedged` / `not_given_up`: why a late head was not hedged / given up on at its slow
    head (no member expected sooner than waiting)."""
    transport: str
    """HTTP, or WEBSOCKET for a WebSocket's handshake and its turns."""
    turn: int | None
    """None for HTTP; on a WebSocket 0 is the handshake (upgrade request → 101 or its
    failure), 1, 2, ... each turn (a Responses `response.create`)."""
    prewarm: bool
    """A turn that only prepares a response (Responses `"generate": false`): no output is
    expected, so its first token is not a slow one."""
    body_path: str | None
    """Which path carried the response body to the client (`patches.speed.splice`): mitmproxy's
    layers, the splice, or its direct reads; None with no response, or unknown (a request a
    dead process took)."""
    upstream_request_id: str | None
    """The upstream's own request id (`x-request-id`, `request-id`): what providers ask for
    in support tickets."""
    upstream_processing_ms: float | None
    """The upstream's own processing time as it reports it (`openai-processing-ms`)."""
    attempt_group: str | None = None
    """The id of the first record of a request the client sent again after it failed or was
    cut (`ttft_relay/observe/attempts.py`): set on that first attempt's record (it failed)
    and on each retry's; None for a request that neither failed nor repeated one."""
    attempt: int | None = None
    """This record's attempt in its group: 1 for the first, 2 for the first retry, ..."""
    loop_lag_ms: float | None = None
    """The relay's event loop: its worst lag while the request ran (selfwatch); on a
    connection's first request from the client's SYN."""
    gc_pause_ms: float | None = None
    """The relay's process: its longest garbage collection while the request ran (one of at
    least 1 ms; 0.0 if none), a pause every thread and every live stream waited for."""
    client_rtt_ms: float | None = None
    """The client connection's smoothed round trip (Linux TCP_INFO)."""
    client_retransmits: int | None = None
    """Segments the kernel retransmitted to the client during the request, counted once the
    client acknowledged the response (or `selfwatch.SETTLE_MAX_S` passed)."""
    upstream_tcp_rtt_ms: float | None = None
    """The upstream connection's smoothed round trip (TCP_INFO: to the next hop)."""
    upstream_retransmits: int | None = None
    """Segments retransmitted to the upstream during the request."""
    client_min_rtt_ms: float | None = None
    """The client connection's minimum round trip (TCP_INFO): the path's own, without the
    queueing and delayed acknowledgements that inflate the smoothed one."""
    client_retransmit_ms: float | None = None
    """Time the relay's sending to the client spent in retransmission timeouts during the
    request (TCP_INFO, Linux 6.7+)."""
    client_out_of_order: int | None = None
    """Packets from the client that arrived out of order during the request: the client
    lost segments and sent them again."""
    upstream_retransmit_ms: float | None = None
    """What the upstream link lost to retransmissions before the first token: the request
    resent (`upstream_resent` after it was first sent; in the `upstream_upload` phase instead
    where `upstream_sent` is marked), plus one round trip where answer packets came out of
    order (the least a lost segment costs); upstream network in the verdict."""
    upstream_out_of_order: int | None = None
    """As `client_out_of_order`, from the upstream."""

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data: one JSON line of the timing log, `flow.metadata`'s copy."""
        return {name: getattr(self, name) for name in FIELDS}


FIELDS = tuple(f.name for f in fields(Record))
"""The record's keys, in the order of a JSON line."""
LINK_KEYS = FIELDS[FIELDS.index("loop_lag_ms"):]
"""What the relay's self-watch learned of a request (`selfwatch.SelfWatch`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordInput:
    """What the relay saw of one flow (or WebSocket turn): plain data, marks relative, in ms;
    `build_record` makes its record of it. Timing builds one for a flow, websocket for a
    turn, the ledger for a request its process died with.

    `tokens_expected`: the answer was streamed as events, so `first_token` decides ttft;
    `tls_expected`: the upstream speaks https, so a connection without a handshake mark
    failed in TLS. `token_events` is the rate's fallback when the upstream reported no
    output token count. A WebSocket handshake (`turn` 0) has no first token of its own: its
    phases end at the `101`. `links`: the `LINK_KEYS` known.
    """

    id: str
    ts: float
    api: str
    model: str | None
    stream: bool
    status: int | None
    upstream: str
    marks: Mapping[str, float]
    tokens_expected: bool
    tls_expected: bool
    reused_connection: bool | None
    rtt_ms: float | None
    client_setup_round_trips: int | None = None
    upstream_connection: str | None = None
    upstream_dial: Mapping[str, Any] | None = None
    upstream_tls_resumed: bool | None = None
    max_gap_ms: float | None = None
    chunks: int | None = None
    bytes: int | None = None
    token_events: int | None = None
    prompt_tokens: int | None = None
    usage: Mapping[str, Any] | None = None
    error: str | None = None
    error_phase: str | None = None
    client_aborted: bool = False
    trim: Mapping[str, Any] | None = None
    route: Mapping[str, Any] | None = None
    request_id: str | None = None
    transport: str = HTTP
    turn: int | None = None
    prewarm: bool = False
    body_path: str | None = None
    upstream_request_id: str | None = None
    upstream_processing_ms: float | None = None
    links: Mapping[str, float | int | None] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Learned:
    """What the observers (`ttft_relay/observe/`) learned across records that a record's
    verdict or fields take: each observer says its part (`Timing`'s observers), `judged`
    takes them all at once. Empty: nothing learned."""

    expectation: phases.Expectation | None = None
    """The first token this prompt predicts (`phases.judge`'s `expectation`)."""
    unlearned: str | None = None
    """Why there is no expectation yet, in words."""
    learning: bool = False
    """The record's first-token line is still being learned."""
    cache_miss: str | None = None
    """A prompt cache miss, as a clause for the verdict's detail."""
    attempt_group: str | None = None
    """`Record.attempt_group`."""
    attempt: int | None = None
    """`Record.attempt`."""

    def merged(self, other: Learned) -> Learned:
        """This with what `other` learned (its parts that are not empty)."""
        said = {f.name: value for f in fields(other) if (value := getattr(other, f.name)) != f.default}
        return replace(self, **said) if said else self


NOTHING_LEARNED = Learned()


def build_record(seen: RecordInput, learned: Learned = NOTHING_LEARNED) -> Record:
    """The record of one flow (or WebSocket turn), judged with what was `learned`."""
    return judged(measure(seen), learned)


def measure(seen: RecordInput) -> Record:
    """The record of what was seen of one flow (or WebSocket turn): its phases and numbers,
    not yet judged (`judged` gives its verdict)."""
    handshake = is_handshake(seen.transport, seen.turn)
    error_phase = seen.error_phase
    if (seen.error or seen.client_aborted) and error_phase is None:
        error_phase = phases.error_phase(
            seen.marks, tls_expected=seen.tls_expected, tokens_expected=seen.tokens_expected
        )
    # A failed request's wait runs on in the phase it failed in, up to its end.
    p = phases.compute(seen.marks, tokens_expected=seen.tokens_expected,
                       unfinished=error_phase if seen.error or seen.client_aborted else None)
    if handshake or seen.prewarm:
        # Neither is an answer: their time is in the phases, never a (slow) first token.
        p.pop("ttft", None)
    # The self-watch's numbers (`LINK_KEYS`) by name (Any: a type checker cannot match a dict's keys to fields).
    links: dict[str, Any] = {key: (seen.links or {}).get(key) for key in LINK_KEYS}
    output_tokens = (seen.usage or {}).get("output_tokens") or seen.token_events
    stream_s = p.get("stream", 0.0) / 1000
    return Record(
        id=seen.id,
        request_id=seen.request_id[:REQUEST_ID_MAX] if seen.request_id else None,
        ts=round(seen.ts, 3),
        api=seen.api,
        model=cut_text(seen.model, MODEL_MAX) if seen.model else seen.model,
        stream=seen.stream,
        status=seen.status,
        upstream=seen.upstream,
        marks=dict(seen.marks),
        phases=p,
        ttft_ms=p.get("ttft"),
        reused_connection=seen.reused_connection,
        upstream_connection=seen.upstream_connection,
        upstream_dial=dict(seen.upstream_dial) if seen.upstream_dial else None,
        upstream_tls_resumed=seen.upstream_tls_resumed,
        rtt_ms=None if seen.rtt_ms is None else round(seen.rtt_ms, 3),
        client_setup_round_trips=seen.client_setup_round_trips,
        max_gap_ms=None if seen.max_gap_ms is None else round(seen.max_gap_ms, 3),
        chunks=seen.chunks,
        bytes=seen.bytes,
        output_tokens_per_s=round(output_tokens / stream_s, 1) if output_tokens and stream_s > 0 else None,
        prompt_tokens=seen.prompt_tokens,
        usage=dict(seen.usage) if seen.usage else None,
        verdict=phases.UNKNOWN,
        error=cut_text(seen.error) if seen.error else None,
        error_phase=error_phase,
        client_aborted=seen.client_aborted,
        trim=dict(seen.trim) if seen.trim else None,
        route=dict(seen.route) if seen.route else None,
        transport=seen.transport,
        turn=seen.turn,
        prewarm=seen.prewarm,
        body_path=seen.body_path,
        upstream_request_id=seen.upstream_request_id[:REQUEST_ID_MAX] if seen.upstream_request_id else None,
        upstream_processing_ms=seen.upstream_processing_ms,
        **links,
    )


def is_handshake(transport: str | None, turn: int | None) -> bool:
    """The record of a WebSocket's opening handshake (turn 0), not of a turn."""
    return transport == WEBSOCKET and turn == 0


def judged(rec: Record, learned: Learned = NOTHING_LEARNED) -> Record:
    """The record with its verdict, its detail and expected first token, from its own numbers
    and what the relay `learned` across records (`phases.judge`), and its attempt group:
    the one judgement a record gets."""
    handshake = is_handshake(rec.transport, rec.turn)
    error = rec.error
    client_link = client_link_ms(rec.client_min_rtt_ms, rec.client_rtt_ms, rec.client_retransmit_ms)
    v = phases.judge(
        rec.phases,
        rtt_ms=rec.rtt_ms,
        upstream_ms=rec.upstream_processing_ms,
        gap=phases.gap_after_first_token(rec.marks, rec.max_gap_ms, rec.chunks),
        error=error,
        error_phase=rec.error_phase,
        client_aborted=rec.client_aborted,
        loop_lag_ms=rec.loop_lag_ms,
        client_rtt_ms=client_link,
        upstream_retransmit_ms=rec.upstream_retransmit_ms,
        starting_ms=phases.starting_ms(rec.marks, rec.phases),
        status=rec.status,
        upstream_answered=upstream_answered(rec),
        setup=connection_setup(rec.marks, rec.client_min_rtt_ms, rec.client_rtt_ms, rec.client_setup_round_trips,
                               rec.loop_lag_ms),
        no_prefill=handshake or rec.prewarm,
        expectation=learned.expectation,
        unlearned=learned.unlearned,
        learning=learned.learning,
        cache_miss=learned.cache_miss,
    )
    verdict, detail = v.words, v.detail
    if handshake and (error or rec.client_aborted):
        # Clients retry a failed handshake, then fall back to HTTP: say which transport failed.
        verdict = f"{WEBSOCKET_HANDSHAKE_FAILED}: {v.words}"
    elif not error and not rec.client_aborted and (hedged := (rec.route or {}).get("hedged")) \
            and hedged.get("won"):
        verdict, detail = phases.UPSTREAM_HEDGED, hedge_detail(hedged, (rec.route or {}).get("failed_over") or ())
    elif not error and not rec.client_aborted and (failed := (rec.route or {}).get("failed_over")):
        verdict, detail = phases.UPSTREAM_FAILED_OVER, failover_detail(failed, rec.route, rec.ttft_ms)
    return replace(rec, verdict=verdict, verdict_detail=detail, expected_ttft_ms=v.expected_ttft_ms,
                   attempt_group=learned.attempt_group, attempt=learned.attempt)


def failover_detail(failed: Sequence[Mapping[str, Any]], route: Mapping[str, Any] | None,
                    ttft_ms: float | None) -> str:
    """The members an upstream group left before the head, and the one that answered, in a sentence:
    "a: 503 after 1.2 s; b gave the first token 0.3 s later (first token 1.5 s)"."""
    said = "; ".join(f"{f.get('upstream')}: {f.get('error')}"
                     + (f" after {f['after_ms'] / 1000:.1f} s" if isinstance(f.get("after_ms"), (int, float)) else "")
                     for f in failed)
    last = failed[-1].get("after_ms")
    answered = (route or {}).get("upstream")
    if ttft_ms is None or not isinstance(last, (int, float)):
        return f"{said}; {answered} answered"
    return f"{said}; {answered} gave the first token {(ttft_ms - last) / 1000:.1f} s later (first token {ttft_ms / 1000:.1f} s)"


def hedge_detail(hedged: Mapping[str, Any], failed: Sequence[Mapping[str, Any]]) -> str:
    """A hedge in a sentence: "hedged: a had no head after 2.1 s, b answered in 0.4 s", or
    "…, sent to b as well; a answered first, 0.3 s later"."""
    first, second, won = hedged.get("from"), hedged.get("upstream"), hedged.get("won")
    after, head = hedged.get("after_ms"), hedged.get("head_ms")
    said = f"hedged: {first} had no head after {after / 1000:.1f} s" if isinstance(after, (int, float)) \
        else f"hedged: {first} had no head by its bound"
    if failed:
        said += f", then failed ({failed[-1].get('error')})"
    took = f" in {head / 1000:.1f} s" if isinstance(head, (int, float)) else ""
    if won == second:
        return f"{said}, {second} answered{took}"
    return f"{said}, sent to {second} as well; {first} answered first" + (
        f", {head / 1000:.1f} s later" if isinstance(head, (int, float)) else "")


def connection_setup(marks: Mapping[str, float], client_min_rtt_ms: float | None, client_rtt_ms: float | None,
                     round_trips: int | None, loop_lag_ms: float | None) -> phases.Setup | None:
    """Where a connection's first request's set-up went (`phases.setup`), from its record's fields:
    the handshakes' round trips are the path's own (its minimum RTT), not time lost to retransmissions."""
    return phases.setup(marks, client_rtt_ms=client_min_rtt_ms or client_rtt_ms, round_trips=round_trips,
                        loop_lag_ms=loop_lag_ms)


def upstream_answered(rec: Record) -> bool:
    """The record's failure status is the upstream's own answer: a forwarded request whose
    response head said it (timing records such a failure as `HTTP <status>`), not a reply
    the relay made."""
    return (rec.status is not None and rec.error == f"HTTP {rec.status}"
            and "forwarded" in rec.marks and "response_head" in rec.marks)


def client_link_ms(min_rtt_ms: float | None, rtt_ms: float | None, retransmit_ms: float | None) -> float | None:
    """What the client's link cost the request, as far as the kernel tells: one round trip
    (the request in, the first token out; the path's minimum `min_rtt_ms`, so that a
    smoothed `rtt_ms` that delayed acknowledgements inflated on loopback is not taken for a
    far client) plus the time the relay's sending to the client spent waiting on
    retransmission timeouts (`retransmit_ms`)."""
    rtt = min_rtt_ms if min_rtt_ms is not None else rtt_ms
    if rtt is None:
        return None
    return rtt + (retransmit_ms or 0.0)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def top_phases(rec: Mapping[str, Any], n: int = 3) -> list[tuple[str, float]]:
    """The `n` largest critical-path phases, largest first."""
    p = rec.get("phases") or {}
    ranked = sorted(
        ((name, p[name]) for name in phases.CRITICAL_PHASES if p.get(name)),
        key=lambda item: -item[1],
    )
    return ranked[:n]


def _trim_note(trim: Any) -> str:
    """What trimming did, when it did anything (by whose word: the record and mitmweb)."""
    if not isinstance(trim, Mapping):
        return ""
    note = ""
    if trim.get("trimmed"):
        note = f" · trimmed {trim.get('tokens_before')}→{trim.get('tokens_after')}"
        if trim.get("over_budget"):
            note += f" over budget (rounds -{trim.get('dropped_rounds')}, results cut {trim.get('cut_results')})"
    elif trim.get("over_budget"):
        note = f" · over budget {trim.get('budget')}"
    if refused := trim.get("refused"):
        note += " · refused as too long" + (", resent trimmed" if refused.get("resent") else "")
    return note


CONSOLE_WIDTH = 120
"""The console line fits a terminal this wide when it can (the phases it names are dropped
from the smallest up); the verdict's sentence and every phase are in the record and mitmweb."""

_DURATION = re.compile(r"\d+(?:\.\d+)? m?s\b")
_PROMPT_SIZE = re.compile(r"([\d.]+k?) prompt tokens")


def headline(rec: Mapping[str, Any]) -> str:
    """The verdict and the number it stands on, in a few words: `upstream TLS 200 ms`,
    `upstream queueing 13.0× predicted`, `context length 9.2k tokens`, `ok`."""
    verdict, detail = str(rec.get("verdict")), rec.get("verdict_detail") or ""
    ttft, expected = rec.get("ttft_ms"), rec.get("expected_ttft_ms")
    if verdict == phases.OK or not detail:
        return verdict
    if verdict == phases.UPSTREAM_QUEUEING and ttft and expected:
        return f"{verdict} {ttft / expected:.1f}× predicted"
    if verdict in (phases.CONTEXT_LENGTH, phases.PROMPT_CACHE_MISS):
        size = _PROMPT_SIZE.search(detail)
        return f"{verdict} {size.group(1)} tokens" if size else verdict
    number = _DURATION.search(detail)  # the hop's own cost comes first in its sentence
    return f"{verdict} {number.group(0)}" if number else verdict


def summary_line(rec: Mapping[str, Any]) -> str:
    """One line for the console: the verdict and its number, the first token and its largest
    phases, then the model, the status and the upstream (last: it is not the client); the API
    shape and the verdict's sentence are in the record and mitmweb."""
    lead = f"{headline(rec)} · ttft {_ms(rec.get('ttft_ms'))}"
    tail = (f" · {rec.get('model') or '?'} {rec.get('status') or 'ERR'} → {rec.get('upstream')}"
            f"{_trim_note(rec.get('trim'))}")
    biggest = top_phases(rec)
    while True:
        shown = " [" + ", ".join(f"{name} {ms:.0f}" for name, ms in biggest) + "]" if biggest else ""
        line = printable(lead + shown + tail)
        if len(line) <= CONSOLE_WIDTH or not biggest:
            return line
        biggest = biggest[:-1]


SLOW_WORD = "SLOW"
"""Marks a slow flow's comment, after its verdict and number (mitmweb's Comment column is 150 px
wide until the user widens it: it shows the verdict's first words): plain letters any font draws."""


def comment(rec: Mapping[str, Any], slow: bool = False) -> str:
    """The breakdown shown as the flow's comment in mitmweb (and in its flow list's
    Comment column, which shows the start of it: the verdict and its number, as the
    console line leads, then the first token; the verdict's sentence follows).

    One short sentence per line: mitmweb collapses line breaks and runs of
    spaces, so the text must read as well run together as on separate lines.
    """
    detail = rec.get("verdict_detail")
    expected = rec.get("expected_ttft_ms")
    lines = [printable(f"{headline(rec)} · {SLOW_WORD + ': ' if slow else ''}ttft {_ms(rec.get('ttft_ms'))}"
                       + (f", expected {_ms(expected)}." if expected is not None else "."))]
    lines.append(printable(f"{rec.get('verdict')}: {detail}." if detail else f"{rec.get('verdict')}."))
    phase_list = " · ".join(f"{name} {ms:.1f}" for name, ms in (rec.get("phases") or {}).items())
    if phase_list:
        lines.append(f"Phases (ms): {phase_list}.")
    conn = {True: "reused", False: "new", None: "none"}[rec.get("reused_connection")]
    stream = ""
    if rec.get("chunks") is not None:
        rate = rec.get("output_tokens_per_s")
        stream = f"; {rec['chunks']} chunks, max gap {_ms(rec.get('max_gap_ms'))}" + (f", {rate} tok/s" if rate else "")
    lines.append(f"Connection {conn}, rtt {_ms(rec.get('rtt_ms'))}{stream}.")
    setup = connection_setup(rec.get("marks") or {}, rec.get("client_min_rtt_ms"), rec.get("client_rtt_ms"),
                             rec.get("client_setup_round_trips"), rec.get("loop_lag_ms"))
    if advice := phases.advice(rec.get("verdict") or "", rec.get("phases") or {}, rec.get("loop_lag_ms"), setup):
        lines.append(advice)
    if rec.get("error"):
        lines.append(printable(f"Error ({rec.get('error_phase')}): {rec['error']}"))
    if (attempt := rec.get("attempt") or 0) > 1:
        lines.append(printable(f"Attempt {attempt} of a request the client sent again (first: {rec.get('attempt_group')})."))
    return "\n".join(lines)


def turn_line(rec: Mapping[str, Any], slow: bool = False) -> str:
    """One WebSocket turn in a sentence, for the socket's comment in mitmweb: its verdict first."""
    which = f"turn {rec.get('turn')}" + (" (prewarm)" if rec.get("prewarm") else "") + (f", {SLOW_WORD}" if slow else "")
    verdict, detail = rec.get("verdict"), rec.get("verdict_detail")
    said = f"{verdict} ({which}): {detail}" if detail and verdict != phases.OK else f"{verdict} ({which})"
    return printable(f"{said}, ttft {_ms(rec.get('ttft_ms'))}.")


_CLOSE = object()
_REOPEN = object()
WRITE_BATCH_S = 0.05
"""The writer thread lets records gather this long before it writes them: one thread
wake-up (and GIL hand-over) per batch instead of one per record under load."""
CONSOLE_BATCH_S = 0.25
"""Console lines closer together than this go out as one log record."""


class ConsoleLines:
    """Logs summary lines at INFO: at once when the console has been quiet for
    CONSOLE_BATCH_S, else gathered and logged together when that time is up.

    In mitmproxy every log record costs far more than its line (the termlog print,
    and an `add_log` event for the addons: ~0.4 ms per flow under load, measured
    before the relay dispatched events from plans). Gathering keeps one line per
    flow while the record count stays bounded at a few per second. `flush()` logs
    whatever is gathered."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.pending: list[str] = []
        self.last = 0.0

    def add(self, line: str) -> None:
        if self.pending:
            self.pending.append(line)
            return
        wait = self.last + CONSOLE_BATCH_S - time.monotonic()
        if wait <= 0:
            self.last = time.monotonic()
            self.log.info(line)
            return
        try:
            asyncio.get_running_loop().call_later(wait, self.flush)
        except RuntimeError:  # no event loop (a script or a unit test): no one to flush later
            self.log.info(line)
            return
        self.pending.append(line)

    def flush(self) -> None:
        if self.pending:
            self.log.info("\n".join(self.pending))
            self.pending.clear()
        self.last = time.monotonic()


def valid_text(value: Any) -> Any:
    """`value` with every string made valid UTF-8: a byte that was not UTF-8 (kept as a
    surrogate, as mitmproxy decodes header values) becomes U+FFFD, as does any other
    surrogate."""
    if isinstance(value, str):
        try:
            raw = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that is not an escaped byte
            raw = value.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")
    if isinstance(value, Mapping):
        return {valid_text(k): valid_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [valid_text(v) for v in value]
    return value


class RecordWriter:
    """Appends records as JSON lines to `path` from a background thread.

    The event loop only serialises and enqueues; the thread writes whatever has
    queued up within WRITE_BATCH_S, so a reader of the log sees records within
    moments. `close()` writes everything still queued, without waiting out the batch, before returning.

    Several processes may append to one log: the workers of `ttft-relay run --workers N`
    (ttft_relay/workers.py) share the log the user named. Each batch of whole lines
    leaves in one write() to a file opened with O_APPEND, which Linux never interleaves
    with another process's write on a local filesystem (not over NFS). Before each batch,
    under an exclusive lock (flock of `.<log's name>.lock` beside it), the writer checks
    that the file it holds is still the one at `path` and moves to the one there if not,
    and rotates when the policy says so: one writer rotates, every other moves to the
    new file before its next write, so nothing reaches a rotated file once it has been
    renamed and its compression may start.

    With a `rotation` (ttft_relay/timing/logrotation.py) the thread rotates the log between two
    records, never inside one, and compresses and expires rotated files in
    another thread. A log renamed by someone else (logrotate) is followed the same
    way; `reopen()` makes the writer open the file at `path` anew after the records
    queued so far (SIGHUP does, ttft_relay/reload.py).
    """

    def __init__(self, path: str | Path, rotation: logrotation.Rotation | None = None) -> None:
        self.path = Path(path)
        self.rotation = rotation or logrotation.Rotation()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._opened()
        try:
            self._lock = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            os.close(self._fd)
            raise
        self._housekeeping: threading.Thread | None = None
        self._queue: queue.SimpleQueue[bytes | object] = queue.SimpleQueue()
        self.queued = 0
        """Records handed to `write` so far."""
        self.written = 0
        """Of those, how many the thread has written to the file (or failed to write and
        said so): a process killed now keeps them (`ledger` waits for this)."""
        self.on_written: Callable[[], object] | None = None
        """Called from the writer thread after each batch it wrote."""
        self._closing = threading.Event()
        """Set by `close`: the batch the thread gathers goes out at once, not WRITE_BATCH_S later."""
        self._thread = threading.Thread(target=self._run, name="ttft-relay-record-writer", daemon=True)
        self._thread.start()

    def write(self, rec: Mapping[str, Any]) -> None:
        try:
            line = orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError:
            # A header value that is not UTF-8 (mitmproxy keeps its bytes as surrogates,
            # which JSON cannot carry): the record is written all the same.
            line = orjson.dumps(valid_text(rec), option=orjson.OPT_APPEND_NEWLINE)
        self._queue.put(line)
        self.queued += 1

    def reopen(self) -> None:
        self._queue.put(_REOPEN)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_CLOSE)
            self._closing.set()
            self._thread.join()
        if self._housekeeping is not None:
            self._housekeeping.join()

    def _opened(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def _open(self) -> None:
        """Write to the file at `path` (created if missing); the file open before is
        closed only once the new one is open, so a failure leaves the writer writing where it was."""
        fd = self._opened()
        os.close(self._fd)
        self._fd = fd

    def _run(self) -> None:
        closing = False
        while not closing:
            batch = [self._queue.get()]
            if batch[0] is not _CLOSE:
                self._closing.wait(WRITE_BATCH_S)
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            closing = _CLOSE in batch
            lines: list[bytes] = []
            for item in batch:
                if item is _REOPEN:
                    self._write(lines)
                    lines = []
                    try:
                        self._open()
                    except OSError as e:
                        logger.error("cannot reopen timing log %s, still writing to the old file: %s", self.path, e)
                elif isinstance(item, bytes):  # not _CLOSE
                    lines.append(item)
            self._write(lines)
        os.close(self._fd)
        os.close(self._lock)

    def _write(self, lines: list[bytes]) -> None:
        """Append whole lines to the file at `path`, rotating between two of them where the
        policy says so, under the lock the log's other writers take too."""
        if not lines:
            return
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        except OSError as e:  # not expected on a local filesystem; the lines are written all the same
            logger.error("cannot lock timing log %s: %s", self.path, e)
        try:
            now = time.time()
            size, last_write = self._current()
            start, failed = 0, False
            for i, line in enumerate(lines):
                if not failed and self.rotation.due(size, len(line), last_write, now):
                    self._append(lines[start:i])
                    start = i
                    try:
                        self._rotate(now)
                        size = 0
                    except OSError as e:  # tried again with the next batch, not for every line
                        failed = True
                        logger.error("cannot rotate timing log %s, still writing to it: %s", self.path, e)
                size += len(line)
                last_write = now
            self._append(lines[start:])
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def _current(self) -> tuple[int, float]:
        """(size, last write) of the file at `path`, which the writer holds open from now
        on: another writer may have rotated it, logrotate renamed or someone removed it."""
        held = os.fstat(self._fd)
        try:
            there = os.stat(self.path)
            moved = (there.st_dev, there.st_ino) != (held.st_dev, held.st_ino)
        except FileNotFoundError:
            moved = True
        if moved:
            try:
                self._open()
                held = os.fstat(self._fd)
            except OSError as e:
                logger.error("cannot reopen timing log %s, still writing to the old file: %s", self.path, e)
        return held.st_size, held.st_mtime

    def _append(self, lines: list[bytes]) -> None:
        if not lines:
            return
        data = memoryview(b"".join(lines))
        try:
            while data:  # one write, unless the disk filled up halfway
                data = data[os.write(self._fd, data):]
        except OSError as e:
            logger.error("cannot write timing records to %s: %s", self.path, e)
        finally:
            self.written += len(lines)
            if (told := self.on_written) is not None:
                told()

    def _rotate(self, now: float) -> None:
        # Under the lock: no other writer writes meanwhile, and each looks at `path`
        # again before its next write.
        rotated = logrotation.rotate(self.path, now)
        self._open()
        if self._housekeeping is not None:
            self._housekeeping.join()  # one at a time: expiring must see the last compression done
        self._housekeeping = threading.Thread(target=self._compress_and_expire, args=(rotated,),
                                              name="ttft-relay-log-rotation", daemon=True)
        self._housekeeping.start()

    def _compress_and_expire(self, rotated: Path) -> None:
        try:
            logrotation.compress(rotated)
            logrotation.remove_expired(self.path, self.rotation.keep)
        except OSError as e:
            logger.error("cannot compress or expire rotated timing log %s: %s", rotated, e)
