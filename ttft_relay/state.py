"""Per-flow state shared by the relay's addons.

One `FlowState` per in-scope flow, created by the scope addon in `requestheaders`,
each of its fields written by one owner (named with the field) and read by the others. It carries the flow's `Api`, resolved once
by scope: the floors below find in it everything they need to know of the API (its
reader, trim shape, error format, WebSocket turns) and never look an API up by name. It lives in a weak map keyed by the
flow, not in `flow.metadata`: mitmproxy deep-copies and serialises metadata when
flows are duplicated or saved, and this object holds parsers and buffers that
must not be. What should survive a save (the finished timing record) is put in
`flow.metadata` as plain data by the timing addon. A flow's error is written only by
`FlowState.record_error`, which states the precedence of its writers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import http

from . import flows
from .apis.api import Api
from .apis.reader import Watcher


@dataclass(slots=True, eq=False)
class FlowState:
    """One flow's state. Each field names the addon that writes it (its owner); the others
    only read it. Marks are everyone's, through `mark` (the first one set counts), and the
    failure is the error path's, through `record_error` (its precedence rule)."""

    api: Api
    """The API the request speaks (scope's choice, by its path); records keep its `name`. Scope."""
    model: str | None = None
    """The model the request names. Scope."""
    stream: bool = False
    """The client asked for a streamed response (`"stream": true` or a streaming path). Scope."""
    transport: str = "http"
    """`record.HTTP`, or `record.WEBSOCKET` for an upgrade request: the flow is the handshake. Scope."""
    marks: dict[str, float] = field(default_factory=dict)
    """Phase marks as absolute `time.time()` seconds, the clock of mitmproxy's timestamps.
    Set through `mark` by timing, the self-watch and faults; trim takes back a refused
    answer's `head_arrived` when it sends the request once more."""
    request_json: Any = None
    """The parsed request body (None: it did not parse). Scope sets it in `request` and drops
    it once the flow's record is published: trim works on it (and again on a refusal), the
    verdicts read the conversation in it as the record is judged, and nothing after; a flow
    kept in mitmweb does not keep its parsed body."""
    prompt_tokens: int | None = None
    """The prompt's tokens as sent, as trim counted them. Trim."""
    prefill_traits: str = ""
    """What of the request changes its prefill beyond its tokens (`Api.prefill_traits`, read
    by scope); a WebSocket's, its current turn's (websocket): the key of its first-token line."""
    trim: dict[str, Any] | None = None
    """What trimming did to the request (its stats). Trim."""
    route: dict[str, Any] | None = None
    """The upstream group's choice for the request: the member it went to, why, the others'
    expected first tokens, the members it failed over from (the record's `route`). Groups."""
    turn_trim: dict[str, Any] | None = None
    """A WebSocket's: what trimming did to the turn whose message is being passed on (the
    trim addon's stats), taken by that turn's record (updated in place after a refusal). Trim
    writes it, websocket takes it."""
    watcher: Watcher | None = None
    """The watcher of a streamed response (`sse.StreamWatcher`), fed by the stream callable.
    Streaming; trim takes it away from an answer it holds to read whole (a refusal)."""
    error: str | None = None
    """Why the flow failed; written only through `record_error` (the error path)."""
    error_phase: str | None = None
    """The phase it failed in; None: the record derives it from the marks. `record_error`."""
    error_status: int | None = None
    """Status of the relay's own error reply to the client (504 for its timeouts); None: 502.
    `record_error`."""
    links: dict[str, Any] | None = None
    """What the self-watch learned of the request's event loop and sockets (`record.LINK_KEYS`).
    The self-watch."""
    settle: Callable[[], float | None] | None = None
    """Set by the self-watch when `links` may still change (the client has not acknowledged
    the answer yet): timing calls it until it returns None, waiting the seconds it returns
    in between, before it makes the record (and clears it then)."""
    recorded: bool = False
    """The timing record has been written: each flow gets exactly one. Timing."""

    def record_error(self, error: str | None, *, phase: str | None = None, status: int | None = None) -> None:
        """Record why the flow failed (`error`), the phase it failed in and the status of
        the relay's reply; None leaves a part unknown. `error=None` records only what the
        relay knows of a failure whose text is mitmproxy's (a connect timeout's status,
        the phase of refused trailers).

        Precedence, the one rule for every writer: the first error recorded stands, with
        what was known of it; whatever comes after (the connection the relay closed
        failing the flow, the relay stopping with it in flight, a sibling's cut) changes
        nothing. So the relay's own findings, recorded as they happen, come first; when
        the flow ends, timing records in this order what mitmproxy and the stream say:
        the flow's error (unless the client left after the complete answer), the
        stream's error event, an HTTP error status (phase `upstream_wait`).
        """
        if self.error is not None:
            return
        self.error = error
        self.error_phase = self.error_phase or phase
        self.error_status = self.error_status or status


_states: weakref.WeakKeyDictionary[http.HTTPFlow, FlowState] = weakref.WeakKeyDictionary()


def get(flow: http.HTTPFlow) -> FlowState | None:
    """The relay's state for `flow`, or None if the flow is out of scope."""
    return _states.get(flow)


def source_of(flow: http.HTTPFlow) -> str:
    """Who sent the flow, for what the relay learns from it: the digest of the key its client
    presented (a relay access key, or the client's own upstream key: `flows.client_key`), else
    its client's address."""
    if key := flows.client_key(flow):
        return f"key {key}"
    peer = flow.client_conn.peername
    return f"address {peer[0]}" if peer else "address ?"


def attach(flow: http.HTTPFlow, st: FlowState) -> FlowState:
    _states[flow] = st
    return st


def mark(flow: http.HTTPFlow, name: str, t: float) -> None:
    """Set mark `name` once: the first occurrence is the one that counts."""
    st = _states.get(flow)
    if st is not None:
        st.marks.setdefault(name, t)
