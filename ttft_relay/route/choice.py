"""Which member of an upstream group serves a request, by the first token each is expected to give (pure).

Each member's estimate is what the relay learned of it (`groups.py` computes them): the
upstream's own wait its first-token line predicts for this prompt
(`ttft_relay/observe/prefill.py`), read with the conversation's prefix cached on the
member that served its last request and uncached on every other (a cache miss costs the
whole prefill), plus the member's recent round trip and queue. So "stay where the cache
is" is mostly in the numbers: another member is chosen only when its first token, prefix read
in full, beats the cached member's by the margin (STICKY_MIN_MS, STICKY_SHARE), the gain
beating the cache miss. A member with no line yet (cold) gets EXPLORE_SHARE of the
requests that have no cache at stake, so it is learned; a member that failed moments ago is
tried last.

A request with no head by its member's bound (`sooner_elsewhere`), hedged or given up on at
its slow head, goes to another member only when that one's expected first token for it, cache
miss included, beats the late member's remaining wait: learned from the member's own late
heads (`late_heads`), else guessed from its estimate and the wait so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EXPLORE_SHARE = 0.05
"""Requests sent to a cold member (one with no first-token line yet) while others are learned."""
STICKY_MIN_MS = 100.0
STICKY_SHARE = 0.2
"""A conversation leaves the member holding its cache only for a first token faster by more
than the larger of these (ms, share of the cached member's): noise does not move it."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """What is known of one member for this request."""

    name: str
    first_token_ms: float | None
    """The first token it is expected to give (own wait for this prompt + round trip + queue);
    None: not known (no line, or no prompt this long learned)."""
    cold: bool = False
    """Its first-token line is still being learned and predicts nothing yet: exploring teaches it."""
    holds_cache: bool = False
    """It served this conversation's last request, within the providers' cache lifetime."""
    down: bool = False
    """It failed moments ago (connect, TLS, 5xx, 429): tried last."""


@dataclass(frozen=True, slots=True)
class Choice:
    order: tuple[str, ...]
    """The chosen member first, then where a failure before the answer's head goes next."""
    why: str
    reason: str
    """`why` in a word, one of the record's `record.ROUTE_REASONS`."""


def choose(estimates: Sequence[Estimate], *, explore_draw: float, explore_share: float = EXPLORE_SHARE) -> Choice:
    """The member for a request (`estimates` in the group's order, the listener's own first);
    `explore_draw`: a uniform draw in [0, 1) that decides whether a cold member explores."""
    up = [e for e in estimates if not e.down]
    down = [e for e in estimates if e.down]
    known = sorted((e for e in up if e.first_token_ms is not None), key=lambda e: e.first_token_ms or 0.0)
    unknown = [e for e in up if e.first_token_ms is None]
    cold = [e for e in unknown if e.cold]
    holder = next((e for e in up if e.holds_cache), None)

    def done(first: Estimate, reason: str, why: str) -> Choice:
        rest = [e.name for e in (*known, *unknown, *down) if e is not first]
        return Choice((first.name, *rest), why, reason)

    if not up:
        return Choice(tuple(e.name for e in estimates), "every member failed moments ago: trying them in order",
                      "all_down")
    if not known:
        first = holder or up[0]
        return done(first, "sticky" if holder else "order",
                    "this conversation's cache is there (nothing learned yet)" if holder
                    else "nothing learned yet: the group's order")
    if cold and holder is None and explore_draw < explore_share:
        # Never a conversation whose cache is somewhere: exploring it would cost its cache.
        return done(cold[0], "exploring", f"exploring: {cold[0].name}'s first-token line is still being learned")
    best = known[0]
    if holder is None or holder is best:
        return done(best, "lowest",
                    "lowest expected first token" + (" (this conversation's cache is there)" if holder else ""))
    assert best.first_token_ms is not None
    if holder.first_token_ms is None:
        return done(holder, "sticky", "sticky: this conversation's cache is there")
    gain = holder.first_token_ms - best.first_token_ms
    if gain <= max(STICKY_MIN_MS, STICKY_SHARE * holder.first_token_ms):
        return done(holder, "sticky", f"sticky: this conversation's cache is there ({best.name} would be "
                                      f"{gain:.0f} ms faster, too little to leave it)")
    return done(best, "left_cache", f"lowest expected first token, {gain:.0f} ms faster than {holder.name} "
                                    "with this conversation's cache")


@dataclass(frozen=True, slots=True)
class Elsewhere:
    to: str | None
    """The member a late request goes to (as well, or instead); None: none is expected sooner than waiting."""
    why: str


def remaining_ms(late: Estimate, waited_ms: float) -> float:
    """How much longer the first token of `late`, with no head after `waited_ms`, is taken to
    be when its own late heads say nothing (`late_heads`): what its estimate leaves, and once
    the wait is past that (a queue its estimate did not see) about as long again as it waited."""
    return max((late.first_token_ms or 0.0) - waited_ms, waited_ms)


def sooner_elsewhere(late: Estimate, waited_ms: float, candidates: Sequence[Estimate],
                     learned_remaining_ms: float | None = None) -> Elsewhere:
    """Where a request whose member `late` gave no head after `waited_ms` goes, as well (a
    hedge) or instead (a slow head given up on): the member of `candidates` (the others)
    expected to give this request's first token soonest (its cache miss, round trip and
    queue in it), if that is sooner than `late`'s remaining wait: `learned_remaining_ms`, what
    `late`'s own late heads took from this wait on (`late_heads.LateHeads.remaining_ms`), else
    `remaining_ms`. A provider sends its head before the prefill, so the other member's head
    wins a hedge's race even where its first token comes later than waiting would have given
    it, and a slow head given up on pays the other's whole prefill: only the expected first
    tokens say whether a second prompt is worth it."""
    learned = learned_remaining_ms is not None
    remaining = learned_remaining_ms if learned_remaining_ms is not None else remaining_ms(late, waited_ms)
    known = [e for e in candidates if e.first_token_ms is not None and not e.down]
    if not known:
        return Elsewhere(None, "no other member's first token is known")
    best = min(known, key=lambda e: e.first_token_ms or 0.0)
    expected = f"{best.name} expected {(best.first_token_ms or 0.0) / 1000:.1f} s, " \
               f"{late.name} {remaining / 1000:.1f} s more" + (" (its late heads)" if learned else "")
    return Elsewhere(best.name if (best.first_token_ms or 0.0) < remaining else None, expected)
