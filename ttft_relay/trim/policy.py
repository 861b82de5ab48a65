"""What to leave out of an oversized conversation, per API shape (pure, sans-IO).

The policy is the same for every API; how an API lays out its conversation (where the
items are, their roles, calls and results, what a shrunk part looks like) is its API
module's trim shape (`Api.trim_shape`, a `ttft_relay/apis/shape.py` `Shape`).

A request over budget is cut down in this order until it fits its target below the
budget (see "Cache-stable cuts"):

1. **Shrink.** The bodies of old tool results, then old tool-call arguments, then old
   images are replaced by a short placeholder saying how much was removed (what
   Anthropic's server-side `clear_tool_uses` does). Every message, block and id stays,
   so calls stay paired and roles alternate as before. The newest round (the last tool
   results and the calls they answer) stays whole. Item by item, oldest first, or with
   the order `newest` (relay_trim_shrink_order) from the newest round back.
2. **Drop.** Whole turns — a turn starts at a user prompt, and a call and its results
   never straddle a cut — from the middle: the oldest ones after the pinned head first
   ("middle-out"). The head then meets the first kept prompt: two user messages in a
   row, which Anthropic's Messages API combines into one turn, as its reference says;
   so that the model does not read the two as one question, a shape with `gap_notice`
   (Anthropic's) always starts that prompt with the notice of what was left out. With
   the order `newest`, whole rounds and turns go from the middle instead, from the one
   before the newest round back (`_Trimmer._drop_newest_first`).

Over budget — the pinned head and the newest turn alone do not fit — it goes on into
the newest turn rather than send the whole history (`_Trimmer._into_newest_turn`):

3. **Drop rounds.** The newest turn's oldest rounds (an answer with its calls, and
   their results), down to its newest round.
4. **Cut the newest results.** The newest round's own tool results are shrunk, one by
   one, while it is still over the budget.

The request is then the smallest the API accepts, marked (`over_budget`), even if
what is left (head, prompt, the newest calls) is still over the budget.

Never changed: request-level parts (`system`, `instructions`, `tools`); every system or
developer message, wherever it is (Anthropic's mid-conversation system messages too);
context items (Codex's `<environment_context>`, `<user_instructions>`, AGENTS.md); the
pinned head (the leading system/developer/user messages before the first answer: the
opening context and first prompt); the newest user prompt; the newest round's calls;
reasoning, thinking and
redacted-thinking blocks with their signatures, server tool blocks, and anything the
relay does not recognise, which is carried as it is.

**Cache-stable cuts.** A provider's prompt cache hits on an identical prefix. A cut made
to just fit the budget moves on every turn and misses the cache every time; instead the
plan (how far shrinking reached, where the drop ends) is remembered per conversation —
recognised by a hash of its pinned head, no server state — in a bounded `PlanCache`, and
the conversation's next requests get the same plan as long as it keeps them within the
budget, so each one sends its predecessor's body plus its own new items. Oldest first, a
request that makes a new cut shares little more than the pinned head with its
predecessor, so what keeps the cache is how rarely cuts come: a new cut goes below the
budget by room for `REQUESTS_BETWEEN_CUTS` requests at the conversation's own recent
growth per request (read from its history: `_Trimmer.growth`), within `LEAST_HEADROOM`
and `MOST_HEADROOM` of the budget (docs/trimming.md weighs the cache against the context
a deeper cut loses). Newest first, a new cut keeps the previous plan's shrinks and drops
and shrinks more from the newest round back: it changes the prompt only from the first
result it shrinks, so it goes just `NEWEST_FIRST_HEADROOM` below the budget; when
shrinking is not enough it drops whole rounds from the middle, the newest old ones first,
`NEWEST_FIRST_MOST_DROP` below it: the front of the conversation stays as it was sent.

**Bounded counting.** Items are counted newest first; once the count passes
`COUNT_LIMIT` times the budget, older items are dropped uncounted (`tokens_before` is
then a lower bound). The tokenizer estimates huge strings (`tokens.ESTIMATE_ABOVE`).

`trim` never raises on malformed input: what it does not understand is left untouched,
with the reason in the stats.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from ..apis.api import Api
from ..apis.shape import RESULTS, SHRINK_KINDS, Shape
from .windows import Budget

REQUESTS_BETWEEN_CUTS = 16
"""A new cut leaves room below the budget for this many of the conversation's next
requests at its recent growth per request, so that they go with the same cut (the same
prefix, a prompt-cache hit) and at most about one request in this many makes a new cut."""

GROWTH_WINDOW = 16
"""The recent growth per request is read from this many of the conversation's last
requests (the model's answers in its history, and what followed each)."""

LEAST_HEADROOM = 0.1
"""A new cut leaves at least this share of the budget free, however slowly the
conversation grows: a cut that would hold only a few requests re-reads the whole prompt
uncached for a few tokens of context."""

MOST_HEADROOM = 0.6
"""and at most this share: one cut never throws away more, however fast it grows."""

OLDEST, NEWEST = "oldest", "newest"
SHRINK_ORDERS = (OLDEST, NEWEST)
"""Which old tool results a new cut shrinks first (relay_trim_shrink_order): the oldest
(the default: the model keeps what it read last) or the newest before the newest round
(the prompt the provider cached stays a prefix; see "Cache-stable cuts")."""

NEWEST_FIRST_HEADROOM = 0.02
"""Newest first, a new cut that only shrinks goes this share of the budget below it (not
`REQUESTS_BETWEEN_CUTS` requests' growth): such a cut misses the cache only from the first
result it shrinks on, so the shallower it is, the more of the cached prompt it keeps; it
comes every request or two."""

MOST_SHRUNK_SPANS = 32
"""Newest first, a plan holds at most this many ranges of shrunk items (a new cut that
does not reach back to the previous one's adds one), and as many of dropped ones: the
store keeps it small. Past it the two newest ranges are joined (what lies between them
shrunk, or dropped), so the change is as late as it can be."""

NEWEST_FIRST_MOST_DROP = 0.1
"""Newest first, a drop (shrinking was not enough) goes this share of the budget below it:
it changes the prompt from where it starts, so the deeper it goes the less of the cached
prompt stays, and the rarer drops are (the room for `REQUESTS_BETWEEN_CUTS` requests, when
smaller, is what it leaves). 10 %: the deepest that kept the lowest share at 0.8 or more in
the loops docs/trimming.md measures ("Shrinking newest first")."""

MIDDLE_NOTICE = "[ttft-relay: messages of this conversation were left out here to fit the context budget]"
"""Where a middle drop (newest first) left a gap. Without a count: gaps that later join keep
their notices as they were (the cached prompt has them so)."""

COUNT_LIMIT = 2
"""Counting stops once this many budgets are counted; older items are dropped uncounted."""

UNBUDGETED_COUNT_LIMIT = 2_000_000
"""Without a budget (unknown model, no relay_trim_max_tokens) prompts are still counted,
for the record, up to this many tokens."""

NOTICE = "[ttft-relay: {n} earlier turns of this conversation were left out to fit the context budget]"
ROUNDS_NOTICE = (
    "[ttft-relay: {n} earlier turns of this conversation, and the first {rounds} tool rounds of this turn,"
    " were left out to fit the context budget]"
)

class TokenCounter(Protocol):
    """What `trim` needs to count tokens (`tokens.Counter`, or a fake in tests)."""

    label: str
    """Name of the encoding, for the stats."""
    source: str
    """"exact" (the provider's tokenizer) or "estimate", for the stats."""
    request_overhead: int
    """Tokens added once per request."""

    def message(self, item: Any) -> int: ...

    def value(self, obj: Any) -> int: ...


# --- budget ----------------------------------------------------------------------------


def max_output(api: Api, body: Any) -> int | None:
    """The cap on the answer's tokens the request sets in its API's field, if it sets one."""
    shape = api.trim_shape
    return shape.max_output(body) if shape is not None and isinstance(body, dict) else None


def long_context(api: Api, anthropic_beta: str | None) -> bool:
    """The request opens the model's long window (Claude's 1M: `anthropic-beta: context-1m-…`)."""
    shape = api.trim_shape
    return shape is not None and shape.long_context(anthropic_beta)


# --- conversation layout ---------------------------------------------------------------


@dataclass(slots=True)
class Layout:
    """Where a conversation's parts are (indexes into its item list)."""

    always: list[bool]
    """Kept as it is: pinned items and the head."""
    head_end: int
    """Items before this are the pinned head."""
    cuts: list[int]
    """Where a drop may end: prompts after the head at which no call waits for its result."""
    newest: int
    """Start of the newest turn, never dropped (a cut, or head_end)."""
    protect_from: int
    """Items from here on are never shrunk: the newest round and what follows."""
    rounds: list[int]
    """Where a drop inside the newest turn may end (over budget only): the starts of its
    answers after the first, at which no call waits for its result, up to the newest round."""
    bounds: list[int]
    """Where a middle drop (newest first) may start or end, after the head up to the newest
    round: the cuts, and the answers at which no call waits for its result (stable as the
    conversation grows, so a plan's drops stay valid)."""

    @property
    def turn_body(self) -> int:
        """Where the newest turn's rounds start: after its prompt (or the head)."""
        return self.newest + 1 if self.cuts else self.head_end


def layout(items: list[dict], shape: Shape) -> Layout:
    n = len(items)
    always = [shape.pinned(item) for item in items]
    head_end = 0
    while head_end < n and (always[head_end] or shape.is_prompt(items[head_end])):
        always[head_end] = True
        head_end += 1
    caller: dict[str, int] = {}
    answered_at: dict[str, int] = {}
    for i, item in enumerate(items):
        for call_id in shape.calls(item):
            caller.setdefault(call_id, i)
        for call_id in shape.results(item):
            answered_at[call_id] = i
    # A prompt is a cut unless a call made before it is answered at or after it (a call
    # that is never answered holds nothing up: the client sent it that way).
    reach_at = [-1] * (n + 1)  # latest answer to a call made before index i
    for call_id, i in caller.items():
        if call_id in answered_at:
            reach_at[i + 1] = max(reach_at[i + 1], answered_at[call_id])
    cuts, free, reach = [], [False] * n, -1
    for i, item in enumerate(items):
        reach = max(reach, reach_at[i])
        free[i] = reach < i
        if i > head_end and free[i] and not always[i] and shape.is_prompt(item):
            cuts.append(i)
    newest = cuts[-1] if cuts else head_end
    last_round = max(answered_at.values(), default=None)
    protect_from = n - 1
    if last_round is not None:
        protect_from = min(
            (caller[c] for c, at in answered_at.items() if at == last_round and c in caller), default=last_round
        )
    protect_from = max(min(protect_from, n - 1), 0)
    turn_body = newest + 1 if cuts else head_end
    rounds = [
        i for i in range(turn_body + 1, protect_from + 1)
        if shape.from_model(items[i]) and not shape.from_model(items[i - 1]) and not always[i]
        and free[i]
    ]  # fmt: skip
    prompts = set(cuts)
    bounds = [
        i for i in range(head_end + 1, protect_from + 1)
        if i in prompts or (not always[i] and free[i] and shape.from_model(items[i]) and not shape.from_model(items[i - 1]))
    ]  # fmt: skip
    return Layout(always, head_end, cuts, newest, protect_from, rounds, bounds)


# --- plans -----------------------------------------------------------------------------


Spans = tuple[tuple[int, int], ...]
"""Item indexes as half-open ranges (start, end), ascending and apart."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What to leave out of one conversation, in item indexes (stable as it grows)."""

    shrunk: Spans
    """The items in these ranges are sent shrunk: oldest first one range from the cut on,
    newest first a range per new cut that did not reach back to the one before (at most
    `MOST_SHRUNK_SPANS`)."""
    cut: int
    """Items from the head up to here are dropped (except pinned ones); head_end: none."""
    anchor: bytes
    """Digest of the items at `cut` and `rounds_to` when the plan was made: the same
    conversation has them there."""
    rounds_to: int = 0
    """Over budget: the newest turn's rounds before this index are dropped too (0: none)."""
    dropped: Spans = ()
    """Newest first: the items in these ranges are dropped too (pinned ones kept), the
    middle of the conversation (a range per new drop that did not reach back to the one
    before; at most `MOST_SHRUNK_SPANS`)."""

    def keeps(self, lay: Layout, i: int) -> bool:
        """Item `i` is sent (shrunk or not)."""
        return lay.always[i] or (i >= self.cut and not lay.turn_body <= i < self.rounds_to
                                 and not any(start <= i < end for start, end in self.dropped))

    def shrinks(self, i: int) -> bool:
        """Item `i`, if sent, is sent shrunk."""
        return any(start <= i < end for start, end in self.shrunk)


def spans(indexes: set[int]) -> Spans:
    """`indexes` as ranges of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indexes):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


def _anchor(items: list[dict], cut: int, rounds_to: int, dropped: Spans = ()) -> bytes:
    at = [items[cut] if cut < len(items) else None, items[rounds_to] if rounds_to else None]
    return _digest([*at, [[items[start], items[end]] for start, end in dropped]] if dropped else at)


def _digest(obj: Any) -> bytes:
    """Content digest, blind to `cache_control` (Claude Code moves its markers each turn)."""
    return hashlib.blake2b(orjson.dumps(without_cache_control(obj)), digest_size=16).digest()


def without_cache_control(obj: Any) -> Any:
    """`obj` without its `cache_control` fields: a conversation's content as the prompt cache
    compares it (Claude Code moves its markers each turn)."""
    if isinstance(obj, dict):
        return {k: without_cache_control(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [without_cache_control(v) for v in obj]
    return obj


def conversation_key(api: str, body: dict, shape: Shape, items: list[dict], head_end: int) -> bytes:
    """Who a request belongs to: its API, model, request-level text and pinned head."""
    fixed = [body.get(k) for k in shape.fixed_keys if k != "tools"]
    return _digest([api, body.get("model"), fixed, items[:head_end]])


class PlanCache:
    """Least-recently-used map from conversation key to its current `Plan` (bounded)."""

    def __init__(self, maxsize: int = 4096) -> None:
        self.maxsize = maxsize
        self._plans: OrderedDict[bytes, Plan] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: bytes) -> Plan | None:
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key: bytes, plan: Plan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        if len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)


# --- trimming --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrimResult:
    body: dict | None
    """The trimmed request body, or None: forward the original bytes."""
    stats: dict[str, Any]
    """For the timing record: see `trim`."""


def untouched_stats(
    reason: str | None, budget: Budget | None = None, encoding: str | None = None, count_source: str | None = None
) -> dict[str, Any]:
    """Stats with every key, for a request left untouched because of `reason`.

    `budget_source` says whose word the budget rests on (`windows`: "window" known,
    "configured", "learned" from the provider's refusal, "user"), `window` the window it
    came from; `count_source` whether the count is the provider's own tokenizer's
    ("exact") or an estimate (Claude, Gemini: "estimate"). A request the upstream refused
    as too long also has `refused` (set by the addon)."""
    return {
        "trimmed": False,
        "reason": reason,
        "messages_before": None,
        "messages_after": None,
        "tokens_before": None,
        "tokens_before_lower_bound": False,
        "tokens_after": None,
        "dropped_units": 0,
        "dropped_messages": 0,
        "shrunk_messages": 0,
        "dropped_rounds": 0,
        "cut_results": 0,
        "plan": None,
        "target": None,
        "budget": budget.tokens if budget else None,
        "budget_source": budget.source if budget else None,
        "window": budget.window if budget else None,
        "encoding": encoding,
        "count_source": count_source,
        "over_budget": False,
        "trim_ms": 0.0,
    }


def trim(
    body: Any,
    api: Api,
    budget: Budget | None,
    counter: TokenCounter,
    *,
    plans: PlanCache | None = None,
    notice: bool = False,
    headroom: bool = True,
    order: str = OLDEST,
) -> TrimResult:
    """Bring `body` within `budget` (see the module docstring).

    Stats keys: see `untouched_stats`. `reason` says why the body is untouched (None when
    trimmed); `plan` is "new" or "kept" (the conversation's previous cut, reused), and
    `target` where a new cut aimed (the budget less the room it leaves; `headroom=False`:
    the budget itself, for a request the upstream refused, sent again at the limit it
    named); tokens are counted even without a budget, so `tokens_after` is the prompt size
    either way. `over_budget`: the pinned head and the newest turn alone were over the
    budget, so the newest turn's older rounds were dropped (`dropped_rounds`) and, if that
    was not enough, its newest round's tool results cut (`cut_results`); `tokens_after`
    may still be over the budget (what is left cannot go). Untouched with reason
    "over_budget": nothing could go.
    """
    started = time.perf_counter()
    stats = untouched_stats(None, budget, counter.label, getattr(counter, "source", None))
    new_body = _Trimmer(body, api, budget, counter, plans, notice, stats, headroom, order).run()
    stats["trim_ms"] = round((time.perf_counter() - started) * 1000, 3)
    return TrimResult(new_body, stats)


class _Trimmer:
    """One request's trim: the counts and versions of its items while plans are tried."""

    def __init__(self, body, api, budget, counter, plans, notice, stats, headroom, order) -> None:
        self.body, self.api, self.budget, self.counter = body, api, budget, counter
        self.plans, self.notice, self.stats, self.headroom, self.order = plans, notice, stats, headroom, order
        self.items: list[dict] = []
        self.versions: list[dict] = []
        """The item list as it would be sent: `items`, some of them shrunk."""
        self._counts: dict[int, int] = {}

    def count(self, i: int) -> int:
        n = self._counts.get(i)
        if n is None:
            n = self._counts[i] = self.counter.message(self.versions[i])
        return n

    def replace(self, i: int, item: dict) -> int:
        """Put a new version of item `i`; returns the change in tokens."""
        before = self.count(i)
        self.versions[i] = item
        del self._counts[i]
        return self.count(i) - before

    def run(self) -> dict | None:
        body, stats = self.body, self.stats
        shape = self.api.trim_shape
        if shape is None:
            stats["reason"] = f"api {self.api.name} is not trimmed"
            return None
        if not isinstance(body, dict):
            stats["reason"] = "malformed: body is not an object"
            return None
        items = shape.items(body)
        if not isinstance(items, list):
            stats["reason"] = f"malformed: {shape.items_key} is not a list"
            return None
        for item in items:
            if problem := shape.problem(item):
                stats["reason"] = f"malformed: {problem}"
                return None
        self.items, self.versions = items, list(items)
        n = len(items)
        stats["messages_before"] = stats["messages_after"] = n
        lay = layout(items, shape)
        fixed = self.counter.request_overhead
        fixed += sum(self.counter.value(body[k]) for k in shape.fixed_keys if body.get(k) is not None)
        fixed += sum(self.count(i) for i in range(n) if lay.always[i])

        # Count newest first, never stopping inside the newest turn.
        budget = self.budget
        limit = COUNT_LIMIT * budget.tokens if budget else UNBUDGETED_COUNT_LIMIT
        total, counted_from = fixed, n
        for i in range(n - 1, lay.head_end - 1, -1):
            if lay.always[i]:
                continue
            if total > limit and i < lay.newest:
                break
            total += self.count(i)
            counted_from = i
        uncounted = any(not lay.always[i] for i in range(lay.head_end, counted_from))
        stats.update(tokens_before=total, tokens_before_lower_bound=uncounted, tokens_after=total)
        if budget is None:
            stats["reason"] = "no budget: the model's window is not known and relay_trim_max_tokens is 0"
            return None
        if total <= budget.tokens and not uncounted:
            stats["reason"] = "fits"
            return None
        # The earliest cut that keeps nothing uncounted.
        floor = min((c for c in lay.cuts if c >= counted_from), default=lay.head_end) if uncounted else lay.head_end

        key = conversation_key(self.api.name, body, shape, items, lay.head_end) if self.plans is not None else None
        plan = self.plans.get(key) if key is not None else None
        kept = plan if plan is not None and self._valid(plan, lay) else None
        kept_total = None
        if kept is not None:
            kept_total = self._apply(kept, lay, fixed, shape)
            if kept_total <= budget.tokens:
                kept_total, shrunk = self._finish(kept, lay, shape, kept_total)  # the notice may not fit
        if kept is not None and kept_total is not None and kept_total <= budget.tokens:
            plan = kept
            stats.update(plan="kept", over_budget=bool(plan.rounds_to))
            total = kept_total
        else:
            # Newest first, a new cut goes on from the conversation's plan: what it sent stays as it was.
            previous = kept if self.order == NEWEST else None
            plan, total, shrunk, cut_results = self._plan_anew(lay, floor, fixed, shape, counted_from, budget.tokens,
                                                               previous)
            if total > budget.tokens and not stats["over_budget"]:
                # The notice (Anthropic's, always) tipped it over: once more, that much lower.
                room = 2 * budget.tokens - total
                plan, total, shrunk, cut_results = self._plan_anew(lay, floor, fixed, shape, counted_from, room,
                                                                   previous)
                stats["over_budget"] = stats["over_budget"] or total > budget.tokens
            if plan.cut == lay.head_end and not plan.rounds_to and not plan.dropped and not shrunk:
                stats["reason"] = "over_budget"  # nothing could go: the head and the newest prompt
                return None
            stats.update(plan="new", cut_results=cut_results)
            if key is not None and total <= budget.tokens and not cut_results:
                self.plans.put(key, plan)

        # A turn (a round) counts as dropped when what came before its prompt (answer) went.
        dropped_units = sum(1 for c in lay.cuts if c <= plan.cut or not plan.keeps(lay, c - 1))
        dropped_rounds = sum(1 for r in lay.rounds if r <= plan.rounds_to or not plan.keeps(lay, r - 1))
        new_items = [self.versions[i] for i in range(n) if plan.keeps(lay, i)]
        stats.update(
            trimmed=True,
            messages_after=len(new_items),
            tokens_after=total,
            dropped_units=dropped_units,
            dropped_messages=n - len(new_items),
            shrunk_messages=shrunk,
            dropped_rounds=dropped_rounds,
            # Newest first, the newest turn's rounds go before older turns: marked all the same.
            over_budget=stats["over_budget"] or dropped_rounds > 0,
        )
        return {**body, shape.items_key: new_items}

    def _plan_anew(self, lay: Layout, floor: int, fixed: int, shape: Shape, counted_from: int,
                   room: int, previous: Plan | None) -> tuple[Plan, int, int, int]:
        """A new plan within `room` tokens (the budget, or less to leave the notice room), into
        the newest turn if it must be: the plan, its total, how many kept items are shrunk and
        how many newest results were cut."""
        self._restore()
        plan, total = self._new_plan(lay, floor, fixed, shape, counted_from, self.budget.tokens - room, previous)
        cut_results = 0
        if total > room:
            self.stats["over_budget"] = True
            plan, total, cut_results = self._into_newest_turn(plan, lay, shape, total, room)
        total, shrunk = self._finish(plan, lay, shape, total)
        return plan, total, shrunk, cut_results

    def _finish(self, plan: Plan, lay: Layout, shape: Shape, total: int) -> tuple[int, int]:
        """After a drop, the notice in front of the first kept prompt (Anthropic's always, as
        the API merges it with the head's user message; others' with relay_trim_notice, if it
        fits). Returns the total with it, and how many kept items are shrunk."""
        n = len(self.items)
        shrunk = sum(1 for i in range(plan.cut, n) if self.versions[i] is not self.items[i] and plan.keeps(lay, i))
        dropped_units = sum(1 for c in lay.cuts if c <= plan.cut)
        rounds = sum(1 for r in lay.rounds if r <= plan.rounds_to)
        if (self.notice or shape.gap_notice) and dropped_units and plan.cut < n:
            text = ROUNDS_NOTICE.format(n=dropped_units, rounds=rounds) if rounds else NOTICE.format(n=dropped_units)
            delta = self.replace(plan.cut, shape.with_notice(self.versions[plan.cut], text))
            if total + delta <= self.budget.tokens or shape.gap_notice:
                total += delta
            else:
                self.replace(plan.cut, self.items[plan.cut])
        for start, end in plan.dropped if self.notice or shape.gap_notice else ():
            # At a gap, the notice: in front of the prompt after it (as after the head), else
            # after the results or prompt before it (an answer is the model's own words).
            at = end if shape.is_prompt(self.items[end]) else start - 1
            was = self.versions[at]
            new = shape.with_notice(was, MIDDLE_NOTICE) if at == end else shape.with_notice_after(was, MIDDLE_NOTICE)
            if new is None or lay.always[at]:
                continue
            delta = self.replace(at, new)
            if total + delta <= self.budget.tokens or shape.gap_notice:
                total += delta
            else:
                self.replace(at, was)
        return total, shrunk

    def _restore(self) -> None:
        """Every item back to its original, keeping the counts of those that were."""
        self._counts = {i: c for i, c in self._counts.items() if self.versions[i] is self.items[i]}
        self.versions = list(self.items)

    def _valid(self, plan: Plan, lay: Layout) -> bool:
        """`plan` still fits this conversation: same cut item, nothing shrunk in its newest
        round. (It may keep items that counting did not reach: `_apply` counts them.)"""
        if plan.cut != lay.head_end and plan.cut not in lay.cuts:
            return False
        if not lay.head_end <= plan.cut <= lay.newest or (plan.shrunk and plan.shrunk[-1][1] > lay.protect_from):
            return False
        if plan.rounds_to and (plan.cut != lay.newest or plan.rounds_to not in lay.rounds):
            return False
        bounds = set(lay.bounds)
        if any(start not in bounds or end not in bounds or start <= lay.newest < end and lay.cuts
               for start, end in plan.dropped):
            return False
        return _anchor(self.items, plan.cut, plan.rounds_to, plan.dropped) == plan.anchor

    def _apply(self, plan: Plan, lay: Layout, fixed: int, shape: Shape) -> int:
        """Tokens of the request with `plan` applied; stops counting once over budget."""
        total = fixed
        for i in range(len(self.versions) - 1, plan.cut - 1, -1):
            if lay.always[i] or not plan.keeps(lay, i):
                continue
            if plan.shrinks(i) and (new := _shrunk(shape, self.versions[i])) is not None:
                self.versions[i] = new
                self._counts.pop(i, None)
            total += self.count(i)
            if total > self.budget.tokens:
                break
        return total

    def growth(self, lay: Layout, shape: Shape, counted_from: int) -> float | None:
        """Tokens the conversation added per request over its last `GROWTH_WINDOW` requests:
        each request added the model's previous answer and what followed it (tool results,
        a prompt), so the items from the `GROWTH_WINDOW`-th last answer on are that many
        requests' growth. Read from the request itself, it is there for a conversation's
        first cut too, and after a restart. None before the model's first answer."""
        items, answers, added = self.items, 0, 0
        for i in range(len(items) - 1, max(lay.head_end, counted_from) - 1, -1):
            added += self.count(i)
            if shape.from_model(items[i]) and not (i > lay.head_end and shape.from_model(items[i - 1])):
                answers += 1
                if answers == GROWTH_WINDOW:
                    break
        return added / answers if answers else None

    def target(self, lay: Layout, shape: Shape, counted_from: int) -> int:
        """Where a new cut brings the request: `REQUESTS_BETWEEN_CUTS` requests' growth below
        the budget, within `LEAST_HEADROOM` and `MOST_HEADROOM` of it."""
        budget = self.budget.tokens
        if not self.headroom:
            return budget
        growth = self.growth(lay, shape, counted_from)
        headroom = REQUESTS_BETWEEN_CUTS * growth if growth is not None else 0
        headroom = min(max(headroom, LEAST_HEADROOM * budget), MOST_HEADROOM * budget)
        return math.floor(budget - headroom)

    def _new_plan(self, lay: Layout, floor: int, fixed: int, shape: Shape, counted_from: int,
                  lower: int = 0, previous: Plan | None = None) -> tuple[Plan, int]:
        """Shrink in the trim's order, then drop oldest first, until the request fits `target`
        (`lower` below it). Newest first it goes on from the `previous` plan's cut and shrinks."""
        target = self.target(lay, shape, counted_from) - lower
        if self.order == NEWEST:
            return self._new_plan_newest_first(lay, shape, floor, fixed, target, lower, previous)
        n = len(self.versions)
        cut = floor
        total = fixed + sum(self.count(i) for i in range(cut, n) if not lay.always[i])
        shrunk, total = self._shrink_oldest_first(lay, shape, cut, total, target)
        self.stats["target"] = target
        for c in lay.cuts:
            if total <= target:
                break
            if cut < c <= lay.newest:
                total -= sum(self.count(i) for i in range(cut, c) if not lay.always[i])
                cut = c
        shrunk = tuple((max(start, cut), end) for start, end in shrunk if end > cut)
        return Plan(shrunk, cut, _anchor(self.items, cut, 0)), total

    def _new_plan_newest_first(self, lay: Layout, shape: Shape, floor: int, fixed: int, target: int, lower: int,
                               previous: Plan | None) -> tuple[Plan, int]:
        """Newest first: the `previous` plan's cut, shrinks and drops kept (what it kept fit the
        budget: counted whole, where the first cut goes from `floor`, past what counting left
        out), then a shallow cut (it changes only what it shrinks and what follows), and if
        shrinking is not enough a drop in the middle, from the newest round back
        (`_drop_newest_first`)."""
        cut = floor if previous is None else previous.cut
        dropped = {i for start, end in (previous.dropped if previous is not None else ())
                   for i in range(max(start, cut), end)}  # fmt: skip
        total = fixed + sum(self.count(i) for i in range(cut, len(self.items)) if not lay.always[i] and i not in dropped)
        if previous is not None and (shape.gap_notice or self.notice):
            # The notices at the plan's gaps (`_finish`) fit in half the headroom; past it, room
            # is kept for them (a new gap's notice has the drop's room).
            notices = len(previous.dropped) * (self.counter.value({"type": "text", "text": MIDDLE_NOTICE}) + 1)
            lower += max(0, notices - math.floor(NEWEST_FIRST_HEADROOM / 2 * self.budget.tokens))
        shallow = max(target, math.floor((1 - NEWEST_FIRST_HEADROOM) * self.budget.tokens) - lower)
        shrunk, total = self._shrink_newest_first(lay, shape, cut, total, shallow, previous, dropped)
        if total <= shallow:
            target = shallow
        else:
            target = max(target, math.floor((1 - NEWEST_FIRST_MOST_DROP) * self.budget.tokens) - lower)
            total = self._drop_newest_first(lay, shape, cut, total, target, dropped)
        self.stats["target"] = target
        gaps = spans(dropped)
        return Plan(spans(shrunk | dropped), cut, _anchor(self.items, cut, 0, gaps), 0, gaps), total

    def _shrink(self, lay: Layout, shape: Shape, i: int) -> int:
        """Item `i` shrunk, unless it is pinned or has nothing to shrink; returns the change in tokens."""
        if lay.always[i] or (new := _shrunk(shape, self.versions[i])) is None:
            return 0
        return self.replace(i, new)

    def _shrink_oldest_first(self, lay: Layout, shape: Shape, cut: int, total: int,
                             target: int) -> tuple[Spans, int]:
        """From `cut` on, item by item, until the request fits `target` or the newest round is next."""
        shrunk = cut
        for i in range(cut, lay.protect_from):
            if total <= target:
                break
            total += self._shrink(lay, shape, i)
            shrunk = i + 1
        return ((cut, shrunk),) if shrunk > cut else (), total

    def _shrink_newest_first(self, lay: Layout, shape: Shape, cut: int, total: int, target: int,
                             previous: Plan | None, dropped: set[int]) -> tuple[set[int], int]:
        """What the `previous` plan shrank (the prefix the provider cached has it so), then from
        the newest round back, item by item, until the request fits `target`: the first item
        that changes is as late as that allows, the newest prompt skipped. It goes back no further than the previous
        plan reached (what it left whole, before that, is cached whole: a drop after it costs
        less). Past `MOST_SHRUNK_SPANS` ranges the two newest are joined. Items in `dropped`
        are not sent: not shrunk."""
        shrunk: set[int] = set()
        reached = cut
        for start, end in previous.shrunk if previous is not None else ():
            reached = max(reached, end)
            for i in range(max(start, cut), min(end, lay.protect_from)):
                if i not in dropped:
                    shrunk.add(i)
                    total += self._shrink(lay, shape, i)
        for i in range(lay.protect_from - 1, reached - 1, -1):
            if total <= target:
                break
            if lay.newest <= i < lay.turn_body:
                continue  # the newest prompt (an image the user just attached): the last thing to lose
            if i not in shrunk and i not in dropped:
                shrunk.add(i)
                total += self._shrink(lay, shape, i)
        while len(runs := spans(shrunk | dropped)) > MOST_SHRUNK_SPANS:
            for i in range(runs[-2][1], runs[-1][0]):
                shrunk.add(i)
                total += self._shrink(lay, shape, i)
        return shrunk, total

    def _drop_newest_first(self, lay: Layout, shape: Shape, cut: int, total: int, target: int,
                           dropped: set[int]) -> int:
        """Whole rounds and turns (`Layout.bounds` apart), from the one before the newest round
        back, until the request fits `target`: what comes before the drop, cached, is sent as it
        was. Never the head, the newest round or the newest prompt; what `dropped` holds (the
        previous plan's drops) stays dropped, and it gets the new items. The API's rules hold
        where the gap closes: never two of the model's items meet (`_closes`). Past
        `MOST_SHRUNK_SPANS` gaps the two newest are joined. Returns the new total."""
        bounds = [b for b in lay.bounds if b > cut]
        pending: list[int] = []  # dropped since the gap last closed validly

        def drop(start: int, end: int) -> None:
            nonlocal total
            for i in range(start, end):
                if i not in dropped:
                    dropped.add(i)
                    pending.append(i)
                    total -= 0 if lay.always[i] else self.count(i)

        for k in range(len(bounds) - 1, 0, -1):
            if total <= target and not pending:
                break
            start, end = bounds[k - 1], bounds[k]
            if lay.cuts and start == lay.newest:
                continue  # the newest prompt: a gap closes right after it
            drop(start, end)
            if self._closes(lay, shape, cut, start, dropped):
                pending.clear()
        while len(gaps := spans(dropped)) > MOST_SHRUNK_SPANS:
            # The newest two gaps that the newest prompt does not part.
            newer = next((g for g in range(len(gaps) - 1, 0, -1)
                          if not (lay.cuts and gaps[g - 1][1] <= lay.newest < gaps[g][0])), None)
            if newer is None:
                break
            older = gaps[newer - 1]
            drop(older[1], gaps[newer][0])
            for start in reversed([b for b in bounds if b <= older[0]]):
                drop(start, older[0])
                if self._closes(lay, shape, cut, start, dropped):
                    pending.clear()
                    break
        for i in pending:  # no valid gap: kept after all
            dropped.discard(i)
            total += 0 if lay.always[i] else self.count(i)
        return total

    def _closes(self, lay: Layout, shape: Shape, cut: int, start: int, dropped: set[int]) -> bool:
        """The gap of `dropped` items at `start` is one the API accepts: the item sent before it
        and the one after it (pinned items aside) are not both the model's (Anthropic's turns
        alternate, and an assistant turn with thinking starts with it)."""
        before = start - 1
        while before >= lay.head_end and (before < cut or before in dropped or lay.always[before]):
            before -= 1
        after = start
        while after < len(self.items) and (after in dropped or lay.always[after]):
            after += 1
        if before < lay.head_end or after == len(self.items):
            return True
        return not (shape.from_model(self.items[before]) and shape.from_model(self.items[after]))

    def _into_newest_turn(self, plan: Plan, lay: Layout, shape: Shape, total: int,
                          room: int) -> tuple[Plan, int, int]:
        """Over budget with every older turn dropped and everything before the newest round
        shrunk: the newest turn's oldest rounds go too, down to its newest round, until the
        request fits the target; then, while it is still over `room`, the newest round's
        own tool results are shrunk (each says what it held). Returns the plan, the total and
        how many results were cut."""
        target = self.stats["target"]
        rounds_to = 0
        for r in lay.rounds if self.order == OLDEST else ():  # newest first: the middle drop took them
            if total <= target:
                break
            total -= sum(self.count(i) for i in range(max(lay.turn_body, rounds_to), r) if not lay.always[i])
            rounds_to = r
        plan = Plan(plan.shrunk, plan.cut, _anchor(self.items, plan.cut, rounds_to, plan.dropped), rounds_to,
                    plan.dropped)
        cut_results = 0
        for i in range(max(lay.protect_from, lay.newest), len(self.items)):
            if total <= room:
                break
            if not lay.always[i] and (new := shape.shrink(self.versions[i], RESULTS)) is not None:
                total += self.replace(i, new)
                cut_results += 1
        return plan, total, cut_results


def _shrunk(shape: Shape, item: dict) -> dict | None:
    """`item` with every kind of part shrunk that it has, or None if it has none."""
    new = item
    for kind in SHRINK_KINDS:
        new = shape.shrink(new, kind) or new
    return None if new is item else new


def summary(stats: dict[str, Any]) -> str | None:
    """One line for the X-Relay-Trim header and the mitmweb comment; None if nothing to say.

    Trimmed:     "dropped=3; shrunk=5; messages=120->40; tokens=130512+->31870; budget=32000; by=window:200000"
                 ("+" after tokens before: at least that many, counting stopped early;
                 `by`: whose word the budget rests on, `by_word`)
    Into the newest turn: "...; by=user; over_budget; rounds=12; cut=1" (its older tool
                 rounds dropped, its newest round's tool results cut: see `trim`)
    Over budget: "over_budget; tokens=150000+; budget=120000; by=user" (untouched: nothing could go)
    Either, after a refusal as too long: "...; refused=219898>200000; resent"
    """
    before = f"{stats['tokens_before']}{'+' if stats['tokens_before_lower_bound'] else ''}"
    if stats.get("trimmed"):
        line = (
            f"dropped={stats['dropped_units']}; shrunk={stats['shrunk_messages']}; "
            f"messages={stats['messages_before']}->{stats['messages_after']}; "
            f"tokens={before}->{stats['tokens_after']}; budget={stats['budget']}; by={by_word(stats)}"
        )
        if stats.get("over_budget"):
            line += f"; over_budget; rounds={stats.get('dropped_rounds', 0)}; cut={stats.get('cut_results', 0)}"
    elif stats.get("over_budget"):
        line = f"over_budget; tokens={before}; budget={stats['budget']}; by={by_word(stats)}"
    elif not stats.get("refused"):
        return None
    else:
        line = f"untouched ({stats.get('reason')})"
    if refused := stats.get("refused"):
        line += f"; refused={refused.get('provider_tokens') or '?'}>{refused.get('max_input') or refused.get('window')}"
        line += "; resent" if refused.get("resent") else ""
    return line


def by_word(stats: dict[str, Any]) -> str:
    """Whose word the budget rests on: "window:200000" (known), "learned:200000" (the
    provider's refusal), "configured:32000" (relay_context_windows), "user"."""
    source = stats.get("budget_source")
    return f"{source}:{stats['window']}" if stats.get("window") else str(source)
