"""Upstream groups: each request of a grouped listener goes to the member expected to give its
first token soonest, and fails over to the next before any byte of an answer reached the client.

A reverse listener whose upstream `relay_upstream_groups` extends (`members.py`) has several
upstreams for its API. For each request in scope, after trimming (its prompt's tokens are
counted then), the addon estimates each member's first token (`estimate`: the member's
first-token line at this prompt, with this conversation's prefix cached where its last
request went, plus the member's recent round trip and queue as its records showed them),
lets `choice.choose` pick one, and aims the request at it: scheme, host, port and Host
header; the upstream key is the member's (`guard.AccessKeys` reads the choice from the
flow's state). The record's `route` says which member, why, and what the others were
expected to take.

Failover, before the answer's head reached the client, to the next member in the choice's
order, at once: a connect, DNS or TLS failure or a connection closed with no answer
(through `fixes.error_replies.instead_of_errors`, the seam the upstream pool retries its lost
reuse races through), and a 5xx or 429 answer (read whole and held by `fixes.resend`, as trim
holds a refusal, then sent to the next member instead). Each member is tried once per
request; the last one's failure reaches the client as any failure does. A member that
failed is tried last for DOWN_S. Only a request whose body the relay holds whole is sent
again; a WebSocket's turns stay on the member its handshake went to.

A slow head, opt-in (`relay_upstream_slow_head`, a budget: at most that percent of the
group's requests): when the chosen member's response head has not come by its bound (the
first token its line expects for this prompt, with the line's tolerance, `Expectation.
tolerance_ms`), its connection is closed and the request goes, as after a failure, to the
member expected to give its first token soonest (its cache miss, round trip and queue in
it) — only if that beats the late member's remaining wait (`choice.sooner_elsewhere`, with what
the member's own late heads took from such a wait on, `late_heads`, learned from its records;
else the head is waited for and the record's `route.not_given_up` says why); the member's queue
is taken to be at least that wait. The abandoned attempt's prompt is paid for all the same.
This is failover at a deadline: the two attempts never race.

A hedge, opt-in (`relay_upstream_hedge`, within `relay_upstream_hedge_budget`: at most that
percent of the group's requests), takes the slow head's place: at the same bound, by the same
rule (`choice.sooner_elsewhere`; else the record's `route.not_hedged` says why not), the
request goes as well to that member, the first one's attempt left running (`patches.speed.hedge`);
the first head wins, the other attempt's connection is closed before any byte of it reaches
the client. Either way both prompts are paid (the record's `route.hedged`, the duplicated
prompt tokens; a hedge whose connection failed sent nothing: not charged to the budget); a losing attempt on an HTTP/2 connection is left to finish (closing the
connection would end its other streams), so its answer is paid too. Never a request the operator marks unsafe to repeat (`relay_upstream_no_repeat`:
methods and paths), which is neither hedged, nor given up on at its slow head, nor failed over
once it went (only a connect that failed, when nothing of it left the relay, sends it on).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers.http import ErrorCode, HttpStream, ResponseProtocolError
from mitmproxy.proxy.mode_specs import ReverseMode

from .. import state
from ..observe import conversations, prefill
from ..observe.verdicts import Verdicts
from ..patches import connections, pins
from ..patches.fixes import error_replies, resend, upstream_copy
from ..patches.speed import hedge
from ..timing import phases, record
from . import choice, members
from .late_heads import LateHeads

logger = logging.getLogger(__name__)

FAILOVER_STATUSES = frozenset({429, 500, 502, 503, 504, 529})
"""Answers another member may not give: overload, rate limits, the provider's or a gateway's failure."""
DOWN_S = 30.0
"""A member that failed is tried last this long."""
SMOOTHING = 0.3
"""Weight of a record's round trip in its member's running figure."""
QUEUE_WEIGHT = 0.5
"""Weight of a record's queue (its first token beyond its line's prediction) in its member's."""
QUEUE_HALF_LIFE_S = 10.0
"""A member's queue, as last seen, halves every this long: a provider's queue comes and goes,
and a member left for its queue is tried again once the queue would be gone."""
CONVERSATIONS = 4096
"""Conversations whose last member is remembered, the least recently seen forgotten first."""
TOKENS_PER_BYTE = 0.25
"""A prompt's tokens from its body's size, where trimming did not count them."""
SLOW_HEAD_MIN_MS = 250.0
"""A head is never given up on sooner than this after the request went."""


@dataclass(slots=True)
class MemberState:
    """What the records taught of one member beyond its first-token line."""

    rtt_ms: float | None = None
    queue_ms: float = 0.0
    """How much its first tokens came later than their lines predicted, lately (not below 0) ..."""
    queue_at: float = 0.0
    """... as of then (`queue`)."""
    down_until: float = 0.0
    late_heads: LateHeads = field(default_factory=LateHeads)
    """Its recent requests whose head came past their bound: how long its queue spikes last."""

    def queue(self, now: float) -> float:
        """Its queue now: as last seen, halved every QUEUE_HALF_LIFE_S since."""
        return self.queue_ms * 0.5 ** (max(0.0, now - self.queue_at) / QUEUE_HALF_LIFE_S)


@dataclass(frozen=True, slots=True)
class Served:
    """Where a conversation's latest request went, and how long its prompt was."""

    member: str
    tokens: int
    ts: float


def smoothed(before: float | None, value: float) -> float:
    return value if before is None else before + SMOOTHING * (value - before)


def compared_path(path: str) -> str:
    """A path as `relay_upstream_no_repeat` compares it, the rule's and the request's alike:
    without its query, runs of '/' as one (a server reads '//v1//files' as '/v1/files');
    otherwise as sent (no percent-decoding, no dot segments resolved)."""
    return re.sub("/{2,}", "/", path.split("?", 1)[0])


def parse_no_repeat(entries: Sequence[str]) -> list[tuple[str | None, str]]:
    """`relay_upstream_no_repeat`'s entries, '[METHOD] PATH' (a path prefix; no method: any), as
    (METHOD or None, PATH as `compared_path` reads it); a bad entry is an OptionsError (a query:
    requests' are not compared)."""
    rules = []
    for entry in entries:
        fields = entry.split()
        if len(fields) not in (1, 2) or not fields[-1].startswith("/") or (len(fields) == 2 and not fields[0].isalpha()):
            raise exceptions.OptionsError(f"relay_upstream_no_repeat: {entry!r}: entries are '[METHOD] /PATH-PREFIX'")
        if "?" in fields[-1]:
            raise exceptions.OptionsError(f"relay_upstream_no_repeat: {entry!r}: a path prefix has no query "
                                          "(requests are compared by their path alone)")
        rules.append((fields[0].upper() if len(fields) == 2 else None, compared_path(fields[-1])))
    return rules


def unsafe_to_repeat(rules: Sequence[tuple[str | None, str]], method: str, path: str) -> bool:
    """Whether the operator marked a request with this method and path unsafe to send twice."""
    path = compared_path(path)
    return any((m is None or m == method.upper()) and path.startswith(prefix) for m, prefix in rules)


class UpstreamGroups:
    """Chooses a member of the listener's upstream group per request, and fails over before the head."""

    def __init__(self, verdicts: Verdicts) -> None:
        self.verdicts = verdicts
        """The learned first-token lines (`Verdicts.rates`): each member's line at a prompt."""
        self.groups: dict[str, tuple[members.Member, ...]] = {}
        self.by_upstream: dict[str, tuple[str, str]] = {}
        """A member's upstream name in records (host[:port]) → (its group, its name)."""
        self.members: dict[tuple[str, str], MemberState] = {}
        self.served: OrderedDict[bytes, Served] = OrderedDict()
        self.orders: dict[str, tuple[str, ...]] = {}
        """Per flow id in flight: the members still to try, in order."""
        self.held: set[str] = set()
        self.draw = random.random
        self.slow: dict[str, asyncio.TimerHandle] = {}
        """Per flow id in flight: its slow-head bound's timer."""
        self.giving_up: dict[str, tuple[str, str]] = {}
        """Flows whose connection the slow-head bound closed: what was late, and why it went elsewhere."""
        self.routed = 0
        self.given_up = 0
        self.hedges = 0
        self.no_repeat: list[tuple[str | None, str]] = []
        self.hedging: dict[str, float] = {}
        """Flows with a second attempt in flight: when it went."""
        self.conversation_of: dict[str, bytes] = {}
        """Per flow id in flight: its conversation's key (`served`)."""
        self.bounds: dict[str, tuple[str, float]] = {}
        """Per flow id in flight: the member chosen and its head's bound (a later head is a late head)."""

    def load(self, loader) -> None:
        loader.add_option(
            members.OPTION, Sequence[str], [],
            "More upstreams for a reverse listener's API, one chosen per request by its expected first token "
            "(cache-aware), failing over before the answer's head: entries 'HOST NAME=URL [env:VAR|file:PATH]', "
            "HOST the listener's upstream host (its own upstream is the group's first member), URL "
            "http(s)://HOST[:PORT], and the member's key (with relay_access_keys; else relay_upstream_keys by its host).",
        )
        loader.add_option(
            "relay_upstream_slow_head", int, 0,
            "Percent of a group's requests, at most, given up on when the chosen member's response head is later "
            "than its learned bound (the first token its line expects, with the line's tolerance) and sent instead "
            "to the member expected to give its first token (cache miss included) sooner than the late one's "
            "remaining wait, if any (else waited for); the first attempt is abandoned, its prompt paid all the "
            "same. 0: off.",
        )
        loader.add_option(
            "relay_upstream_hedge", bool, False,
            "Hedge before the head: when the chosen member's response head is later than its learned bound, send "
            "the request as well, without abandoning the first, to the member expected to give its first token "
            "(cache miss included) sooner than the late one's remaining wait, if any; the first head wins and the "
            "other attempt is closed before the client sees a byte of it (both prompts paid; a whole answer where the loser is on HTTP/2). Within "
            "relay_upstream_hedge_budget; in place of relay_upstream_slow_head.",
        )
        loader.add_option(
            "relay_upstream_hedge_budget", int, 5,
            "Percent of a group's requests, at most, hedged (relay_upstream_hedge; a hedge whose connection "
            "failed, nothing of it sent, is not counted).",
        )
        loader.add_option(
            "relay_upstream_no_repeat", Sequence[str], [],
            "Requests never sent to a group's member twice: no hedge, no slow-head, no failover once the request "
            "went (a failed connect still fails over): entries '[METHOD] /PATH-PREFIX', e.g. 'POST /v1/files' (the "
            "request's path without its query, runs of '/' as one in both).",
        )
        loader.add_option(
            "relay_upstream_explore", int, round(choice.EXPLORE_SHARE * 100),
            "Percent of a group's requests sent to a member whose first-token line is still being learned, "
            "while others predict (so it is learned; 0: only by failover).",
        )

    def configure(self, updated: set[str]) -> None:
        for share in ("relay_upstream_explore", "relay_upstream_slow_head", "relay_upstream_hedge_budget"):
            if not 0 <= getattr(ctx.options, share) <= 100:
                raise exceptions.OptionsError(f"{share} is a percentage, 0 to 100")
        if "relay_upstream_no_repeat" in updated:
            self.no_repeat = parse_no_repeat(ctx.options.relay_upstream_no_repeat)
        if updated & {"relay_upstream_hedge", "relay_speed_patches"}:
            if ctx.options.relay_upstream_hedge and pins.on(hedge):
                hedge.install()
            else:
                if ctx.options.relay_upstream_hedge:
                    logger.warning("relay_upstream_hedge: the hedge patch is off (relay_speed_patches, or another "
                                   "mitmproxy than %s): late heads are waited for (or relay_upstream_slow_head)",
                                   pins.MITMPROXY)
                hedge.uninstall()
        if not updated & {members.OPTION, "mode"}:
            return
        groups = members.parse_groups(ctx.options.relay_upstream_groups, members.listener_members(ctx.options.mode))
        if groups and not (pins.on(resend) and pins.on(error_replies)):
            raise exceptions.OptionsError(f"{members.OPTION}: failover needs the relay's patches resend and "
                                          "error_replies, which this mitmproxy does not take")
        self.groups = groups
        self.by_upstream = {m.authority: (host, m.name) for host, group in groups.items() for m in group}
        self.members = {key: self.members.get(key, MemberState())
                        for key in ((host, m.name) for host, group in groups.items() for m in group)}
        if groups:
            resend.install(by="groups")
            error_replies.instead_of_errors("upstream groups", self._fail_over_before_head)
            # A connection the slow-head bound closed, and a first attempt that failed while its
            # hedge runs, are this addon's, before anyone else takes their error (the upstream
            # pool would send the request on the same member).
            error_replies.instead_of_errors("upstream groups' slow heads", self._fail_over_slow_head, first=True)
        else:
            resend.uninstall(by="groups")
            error_replies.instead_of_errors("upstream groups", None)
            error_replies.instead_of_errors("upstream groups' slow heads", None)

    def done(self) -> None:
        for timer in self.slow.values():
            timer.cancel()
        self.slow.clear()
        hedge.uninstall()
        resend.uninstall(by="groups")
        error_replies.instead_of_errors("upstream groups", None)
        error_replies.instead_of_errors("upstream groups' slow heads", None)

    def group_of(self, flow: http.HTTPFlow) -> tuple[str, tuple[members.Member, ...]] | None:
        mode = flow.client_conn.proxy_mode
        if not isinstance(mode, ReverseMode):
            return None
        host = mode.address[0].lower()
        group = self.groups.get(host)
        return (host, group) if group else None

    # --- the choice

    def request(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        found = self.group_of(flow)
        if st is None or found is None or flow.response is not None:
            return
        host, group = found
        now = time.time()
        tokens = st.prompt_tokens if st.prompt_tokens is not None else \
            int(len(flow.request.raw_content or b"") * TOKENS_PER_BYTE)
        peer = flow.client_conn.peername
        conversation = conversations.conversation_key(st.api, st.request_json, str(peer[0]) if peer else "", st.model)
        served = self.served.get(conversation) if conversation is not None else None
        if served is not None and (now - served.ts > conversations.CACHE_TTL_S
                                   or served.tokens < conversations.CACHE_MIN_TOKENS):
            served = None
        estimated = [self.estimate(host, m, st, tokens, served, now) for m in group]
        estimates = [estimate for estimate, _ in estimated]
        picked = choice.choose(estimates, explore_draw=self.draw(),
                               explore_share=ctx.options.relay_upstream_explore / 100)
        st.route = {
            "group": host,
            "upstream": picked.order[0],
            "why": picked.why,
            "reason": picked.reason,
            "expected_ms": {e.name: None if e.first_token_ms is None else round(e.first_token_ms, 1)
                            for e in estimates},
        }
        self.orders[flow.id] = picked.order[1:]
        aim(flow.request, next(m for m in group if m.name == picked.order[0]))
        self.routed += 1
        chosen, bound_ms = next((e, bound) for e, bound in estimated if e.name == picked.order[0])
        if bound_ms is not None:
            self.bounds[flow.id] = (chosen.name, bound_ms)
        if bound_ms is not None and chosen.first_token_ms is not None and picked.order[1:] \
                and not self.unsafe(flow):
            others = [e for e in estimates if e.name in picked.order[1:]]
            if ctx.options.relay_upstream_hedge and hedge.installed():
                self.slow[flow.id] = asyncio.get_running_loop().call_later(
                    bound_ms / 1000, self._hedge, flow, host, chosen, others, bound_ms)
            elif ctx.options.relay_upstream_slow_head:
                self.slow[flow.id] = asyncio.get_running_loop().call_later(
                    bound_ms / 1000, self._slow_head, flow, host, chosen, others, bound_ms)
        if conversation is not None:
            self.conversation_of[flow.id] = conversation
            self.served.pop(conversation, None)
            self.served[conversation] = Served(picked.order[0], tokens, now)
            if len(self.served) > CONVERSATIONS:
                self.served.popitem(last=False)

    def estimate(self, host: str, member: members.Member, st: state.FlowState, tokens: int, served: Served | None,
                 now: float) -> tuple[choice.Estimate, float | None]:
        """`member`'s expected first token for this prompt: its line's own wait (with the prefix
        cached if it served the conversation's last request), its round trip and recent queue;
        and the bound of its head (that and the line's tolerance; None: not known)."""
        learned = self.members[(host, member.name)]
        holds_cache = served is not None and served.member == member.name
        cached = min(served.tokens, tokens) if served is not None and holds_cache else 0
        key = prefill.model_key(member.authority, st.model, st.prefill_traits)
        prompt = (tokens - cached, cached) if tokens > 0 else None
        prediction = self.verdicts.rates.expect(key, prompt)
        if prediction.expectation is None and cached:
            # A line not learned with cached prompts this long: the prompt read in full bounds it.
            prediction = self.verdicts.rates.expect(key, (tokens, 0))
        expected = bound = None
        if (e := prediction.expectation) is not None:
            expected = e.own_ms + (learned.rtt_ms or 0.0) + learned.queue(now)
            bound = max(SLOW_HEAD_MIN_MS, expected + e.tolerance_ms)
        return choice.Estimate(member.name, expected, cold=expected is None and prediction.learning,
                               holds_cache=holds_cache, down=learned.down_until > now), bound

    def unsafe(self, flow: http.HTTPFlow) -> bool:
        """Whether the operator marked `flow`'s request unsafe to send twice (`relay_upstream_no_repeat`)."""
        return bool(self.no_repeat) and unsafe_to_repeat(self.no_repeat, flow.request.method, flow.request.path)

    def timing_record(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        """Learn the member's round trip, queue and late heads from its record; forget the flow's order."""
        self.orders.pop(flow.id, None)
        self.held.discard(flow.id)
        self._no_slow_head(flow)
        self.giving_up.pop(flow.id, None)
        self.hedging.pop(flow.id, None)
        hedge.forget(flow)
        self.conversation_of.pop(flow.id, None)
        bound = self.bounds.pop(flow.id, None)
        found = self.by_upstream.get(rec.upstream)
        if (found is None or rec.error or rec.client_aborted or found not in self.members
                or phases.waited_for_another(rec.route)):  # its wait holds the other attempt's
            return
        learned = self.members[found]
        head_ms = rec.marks.get("response_head")
        if bound is not None and bound[0] == found[1] and head_ms is not None and head_ms > bound[1] \
                and rec.ttft_ms is not None:
            learned.late_heads.add(time.time(), head_ms, rec.ttft_ms)
        if rec.rtt_ms is not None:
            learned.rtt_ms = smoothed(learned.rtt_ms, rec.rtt_ms)
        if rec.ttft_ms is not None and rec.expected_ttft_ms is not None:
            now = time.time()
            beyond = rec.ttft_ms - rec.expected_ttft_ms
            learned.queue_ms = max(0.0, learned.queue(now) + QUEUE_WEIGHT * (beyond - learned.queue(now)))
            learned.queue_at = now

    # --- failover before the head

    def _no_slow_head(self, flow: http.HTTPFlow) -> None:
        if (timer := self.slow.pop(flow.id, None)) is not None:
            timer.cancel()

    def _slow_head(self, flow: http.HTTPFlow, host: str, chosen: choice.Estimate, others: Sequence[choice.Estimate],
                   bound_ms: float) -> None:
        """No head by the member's bound: close its connection (within the budget), if
        `choice.sooner_elsewhere` finds a member of `others` (their estimates when it was
        chosen) expected sooner than waiting; the close fails the request over to the next
        member, that one (`_fail_over_before_head`)."""
        self.slow.pop(flow.id, None)
        st, rest = state.get(flow), self.orders.get(flow.id)
        if (not flow.live or flow.response is not None or not rest
                or st is None or st.route is None
                or st.route.get("upstream") != chosen.name  # failed over since: the bound was the first member's
                or self.given_up + 1 > ctx.options.relay_upstream_slow_head / 100 * self.routed
                or flow.server_conn.alpn == b"h2"):  # an HTTP/2 connection carries other requests
            return
        # Its member is the next in the order (`choice.choose` puts the known ones first, soonest first).
        waited_ms, target = self._elsewhere(flow, st, host, chosen, others, rest, "not_given_up")
        if target.to is None:
            return
        self.giving_up[flow.id] = (f"no head after {waited_ms / 1000:.1f} s (its bound {bound_ms / 1000:.1f} s)",
                                   target.why)
        if not connections.close(flow.client_conn, flow.server_conn):
            del self.giving_up[flow.id]
            return
        self.given_up += 1
        # Its queue is at least the wait beyond what was expected of it.
        learned, now = self.members[(host, chosen.name)], time.time()
        learned.queue_ms = learned.queue(now) + max(0.0, waited_ms - (chosen.first_token_ms or 0.0))
        learned.queue_at = now

    def _elsewhere(self, flow: http.HTTPFlow, st: state.FlowState, host: str, chosen: choice.Estimate,
                   others: Sequence[choice.Estimate], rest: Sequence[str],
                   waited_field: str) -> tuple[float, choice.Elsewhere]:
        """How long the request has waited for `chosen`'s head, and where it may go
        (`choice.sooner_elsewhere` among `others` still in its order `rest`, with what `chosen`'s
        own late heads took beyond such a wait, if they say); when nowhere, the record's
        `waited_field` (`record.WAITED_INSTEAD_OF`) says why."""
        waited_ms = (time.time() - flow.request.timestamp_start) * 1000
        learned = self.members.get((host, chosen.name))  # (None: it left the group)
        learned_remaining = None if learned is None else learned.late_heads.remaining_ms(waited_ms, time.time())
        target = choice.sooner_elsewhere(chosen, waited_ms, [e for e in others if e.name in rest], learned_remaining)
        if target.to is None:
            assert st.route is not None  # both callers checked
            st.route = {**st.route, waited_field: target.why}
            logger.info("%s: %s had no head after %.1f s, %s: %s", host, chosen.name, waited_ms / 1000,
                        waited_field.replace("_", " "), target.why)
        return waited_ms, target

    def _served_by(self, flow: http.HTTPFlow, member: str) -> None:
        """`flow` goes to `member` after all (a failover, a hedge): its conversation's prefix is cached there now."""
        conversation = self.conversation_of.get(flow.id)
        if conversation is not None and (served := self.served.get(conversation)) is not None:
            self.served[conversation] = Served(member, served.tokens, served.ts)

    def _hedge(self, flow: http.HTTPFlow, host: str, chosen: choice.Estimate, others: Sequence[choice.Estimate],
               bound_ms: float) -> None:
        """No head by the member's bound: send the request as well (within the budget) to the
        member `choice.sooner_elsewhere` picks from `others` (their estimates when it was chosen), if one
        is expected sooner than waiting; the first head wins (`hedge`)."""
        self.slow.pop(flow.id, None)
        st, rest = state.get(flow), self.orders.get(flow.id)
        handler = connections.handler_of(flow.client_conn)
        if (st is None or st.route is None or not rest or handler is None or not flow.live
                or st.route.get("upstream") != chosen.name  # failed over since: the bound was the first member's
                or flow.response is not None or flow.error is not None
                or flow.request.stream or flow.request.raw_content is None or "upgrade" in flow.request.headers
                or self.hedges + 1 > ctx.options.relay_upstream_hedge_budget / 100 * self.routed
                or flow.server_conn.alpn == b"h2"):  # its close would end the other streams
            return
        waited_ms, target = self._elsewhere(flow, st, host, chosen, others, rest, "not_hedged")
        if target.to is None:
            return
        if (second := next((m for m in self.groups.get(host, ()) if m.name == target.to), None)) is None:
            return  # the group changed since the request was routed
        request = flow.request.copy()
        aim(request, second)
        route = st.route
        st.route = {**route, "upstream": second.name}  # its key is the second member's (guard.AccessKeys)
        try:
            request = upstream_copy.outgoing(flow, request)
        finally:
            st.route = route

        unconnected: list[str] = []  # why the hedge's connection failed, if it did (before or after `started`)

        def started(done: bool) -> None:
            if not done or (st.route or {}).get("hedged"):
                return
            self.hedges += 1
            self.hedging[flow.id] = time.time()
            self.orders[flow.id] = tuple(name for name in rest if name != second.name)
            assert st.route is not None
            st.route = {**st.route, "hedged": {"upstream": second.name, "from": chosen.name,
                                               "after_ms": round(waited_ms, 1), "won": None, "why": target.why}}
            logger.info("%s: %s had no head after %.1f s (its bound %.1f s): the request goes to %s as well (%s)",
                        host, chosen.name, waited_ms / 1000, bound_ms / 1000, second.name, target.why)
            if unconnected:
                self._hedge_unconnected(flow, host, unconnected[0])

        def connect_failed(flow: http.HTTPFlow, why: str) -> None:
            unconnected.append(why)
            if (st.route or {}).get("hedged"):
                self._hedge_unconnected(flow, host, why)

        hedge.race(handler, flow, request, lambda flow: self._hedge_won(flow, host, chosen), started,
                   connect_failed)

    def _hedge_unconnected(self, flow: http.HTTPFlow, host: str, why: str) -> None:
        """The hedge's connection failed, nothing of it sent: it is given back to the budget
        (it cost no prompt), the record's `hedged` says why (no head of it can win), and its
        member is tried last for a while, as after any failed connect. In the layer: nothing may raise."""
        st = state.get(flow)
        if st is None or st.route is None or not (hedged := st.route.get("hedged")) or "error" in hedged:
            return
        self.hedges -= 1
        self.hedging.pop(flow.id, None)
        # No race was run, even where the first head came before the hedge's connect failed:
        # nothing is counted as a hedge or as a prompt paid twice.
        st.route = {**st.route, "hedged": {**hedged, "won": None, "error": why}}
        if (learned := self.members.get((host, hedged["upstream"]))) is not None:  # the group may have changed
            learned.down_until = time.time() + DOWN_S
        logger.info("%s: the hedge to %s did not connect (%s): not charged to the budget", host, hedged["upstream"], why)

    def _hedge_won(self, flow: http.HTTPFlow, host: str, first: choice.Estimate) -> None:
        """The second attempt's head came first (in the layer, before the stream sees it): the
        flow's member is the second; the first one's queue is at least its wait."""
        st = state.get(flow)
        if st is None or st.route is None or not (hedged := st.route.get("hedged")):
            return
        now = time.time()
        head_ms = (now - self.hedging.get(flow.id, now)) * 1000
        st.route = {**st.route, "upstream": hedged["upstream"], "hedged": {**hedged, "won": hedged["upstream"],
                                                                           "head_ms": round(head_ms, 1)}}
        # The marks stay the first attempt's: the wait from its request to this head is the upstream side's.
        # In the layer: the group may have changed since (relay_upstream_groups), and nothing may raise here.
        if (second := next((m for m in self.groups.get(host, ()) if m.name == hedged["upstream"]), None)) is not None:
            aim(flow.request, second)
        self._served_by(flow, hedged["upstream"])
        if (learned := self.members.get((host, first.name))) is None:
            return
        waited_ms = (now - flow.request.timestamp_start) * 1000
        learned.queue_ms = learned.queue(now) + max(0.0, waited_ms - (first.first_token_ms or 0.0))
        learned.queue_at = now

    def _first_won(self, flow: http.HTTPFlow) -> None:
        """A head came; if it is the first attempt's while a second raced, that one is closed."""
        hedge.lose_second(flow)
        st = state.get(flow)
        if (st is None or st.route is None or not (hedged := st.route.get("hedged")) or hedged.get("won")
                or "error" in hedged):  # its connection failed: no race
            return
        now = time.time()
        head_ms = (now - self.hedging.get(flow.id, now)) * 1000
        st.route = {**st.route, "hedged": {**hedged, "won": hedged["from"], "head_ms": round(head_ms, 1)}}

    def _next_member(self, flow: http.HTTPFlow, why: str, cause: str, chose: str | None = None) -> members.Member | None:
        """Aim the flow at its next member (the one it leaves marked down, unless only slow:
        `cause` one of `record.FAILOVER_CAUSES`; `chose`: why that member, if a rule chose it);
        None when none is left."""
        st = state.get(flow)
        found = self.group_of(flow)
        rest = self.orders.get(flow.id)
        if st is None or st.route is None or found is None or not rest:
            return None
        host, group = found
        failed = st.route["upstream"]
        if cause != "slow_head":
            self.members[(host, failed)].down_until = time.time() + DOWN_S
        following = next(m for m in group if m.name == rest[0])
        self.orders[flow.id] = rest[1:]
        after_ms = round((time.time() - flow.request.timestamp_start) * 1000, 1)
        st.route = {**st.route, "upstream": following.name,
                    "failed_over": [*st.route.get("failed_over", ()),
                                    {"upstream": failed, "error": why, "cause": cause, "after_ms": after_ms,
                                     **({"why": chose} if chose else {})}]}
        logger.info("%s: %s failed before its answer's head (%s): the request goes to %s",
                    host, failed, why, following.name)
        aim(flow.request, following)
        self._served_by(flow, following.name)
        # The next member's connection and answer are the record's (the first mark set counts).
        for mark in ("upstream_connect_start", "upstream_tcp", "upstream_tls", "upstream_sent", "upstream_resent",
                     "head_arrived"):
            st.marks.pop(mark, None)
        return following

    def _fail_over_before_head(self, stream: HttpStream, event: object) -> layer.CommandGenerator[None] | None:
        flow = stream.flow
        if not (
            isinstance(event, ResponseProtocolError)
            and flow.id in self.orders
            and resend.can_send_again(stream)
        ):
            return None
        if not connections.closed_here(flow.server_conn) and hedge.first_failed(flow):
            # The hedge racing it is the request's attempt now: its head, or its failure, is the flow's.
            self._left_for_hedge(flow, event.message)
            return dropped()
        hedge.lose_second(flow)  # a close of the relay's own (a deadline) ends the hedge too
        if self.unsafe(flow) and event.code != ErrorCode.CONNECT_FAILED:
            return None  # it may have reached the member: not sent again
        slow = self.giving_up.pop(flow.id, None)
        if (self._next_member(flow, event.message, "connection") if slow is None
                else self._next_member(flow, slow[0], "slow_head", chose=slow[1])) is None:
            return None
        return resend.send_again(stream)

    def _left_for_hedge(self, flow: http.HTTPFlow, why: str) -> None:
        """The first attempt failed before its head while its hedge raced: the hedge's member is
        the flow's (its head or its failure), the first one is tried last for a while."""
        st, found = state.get(flow), self.group_of(flow)
        if st is None or st.route is None or found is None or not (hedged := st.route.get("hedged")):
            return
        host, group = found
        if (first := self.members.get((host, hedged["from"]))) is not None:  # the group may have changed since
            first.down_until = time.time() + DOWN_S
        after_ms = round((time.time() - flow.request.timestamp_start) * 1000, 1)
        st.route = {**st.route, "upstream": hedged["upstream"],
                    "failed_over": [*st.route.get("failed_over", ()), {"upstream": hedged["from"], "error": why,
                                                                        "cause": "connection", "after_ms": after_ms}]}
        if (second := next((m for m in group if m.name == hedged["upstream"]), None)) is not None:
            aim(flow.request, second)
        self._served_by(flow, hedged["upstream"])

    def _fail_over_slow_head(self, stream: HttpStream, event: object) -> layer.CommandGenerator[None] | None:
        """A connection the slow-head bound closed, or a first attempt failing while its hedge
        runs: this addon's, before anyone else's (the upstream pool would send it on the same member)."""
        flow = stream.flow
        hedged = hedge.racing(flow) and not connections.closed_here(flow.server_conn)
        return self._fail_over_before_head(stream, event) if flow.id in self.giving_up or hedged else None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._no_slow_head(flow)
        self._first_won(flow)
        response = flow.response
        if (response is None or response.status_code not in FAILOVER_STATUSES or not self.orders.get(flow.id)
                or flow.request.stream or flow.request.raw_content is None or not resend.installed()
                or self.unsafe(flow)):
            return
        # Read it whole, and send the request to the next member before the client sees any of it.
        response.stream = False
        if (st := state.get(flow)) is not None:
            st.watcher = None
        self.held.add(flow.id)
        resend.hold(flow)

    def relay_held_answer(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if flow.id not in self.held or response is None:
            return
        self.held.discard(flow.id)
        retry_after = response.headers.get("retry-after")
        why = f"{response.status_code}" + (f", retry-after {retry_after}" if retry_after else "")
        if self._next_member(flow, why, "429" if response.status_code == 429 else "5xx") is not None:
            resend.again(flow)


def dropped() -> layer.CommandGenerator[None]:
    """No commands: a protocol error taken over and dropped."""
    yield from ()


def aim(request: http.Request, member: members.Member) -> None:
    """Send `request` to `member`: its scheme, host and port, and its name in the Host header."""
    request.scheme, request.host, request.port = member.scheme, member.host, member.port
    request.host_header = member.authority
