"""How much longer a member's late head is to be waited for, learned from its own late heads (pure).

A queue spike shows nothing of its length until it ends: at a member's bound, the wait so far
is all a request knows. What the member's earlier late heads know is how long its spikes
lasted: among its recent requests whose head came later than this one has waited, how much
longer their first token took from here. `LateHeads` keeps those requests (a head past the
member's bound when it was chosen, and its first token) and gives that remainder as their median
(`choice.sooner_elsewhere` compares it against the other members' expected first tokens);
with fewer than MIN_SAMPLES such requests it knows nothing (None: the rule's own guess).

Guarded as the rest of what the relay learns: the last WINDOW late heads of the member, none
older than MAX_AGE_S (a provider's queue changes), each request one sample, and a median, so
one request's wait cannot make the estimate.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 16
"""Late heads kept per member, the oldest forgotten first."""
MAX_AGE_S = 600.0
"""A late head older than this is forgotten: the member's queue may have changed since."""
MIN_SAMPLES = 3
"""Late heads, at least, later than the wait so far before their remainder says anything."""


@dataclass(frozen=True, slots=True)
class LateHead:
    """One request whose head came past its member's bound."""

    at: float
    """When it was learned (its record), Unix seconds."""
    head_ms: float
    """Its response head's wait, from its request."""
    first_token_ms: float
    """Its first token's, from its request."""


class LateHeads:
    """One member's recent late heads."""

    def __init__(self, window: int = WINDOW, max_age_s: float = MAX_AGE_S) -> None:
        self.samples: deque[LateHead] = deque(maxlen=window)
        self.max_age_s = max_age_s

    def add(self, at: float, head_ms: float, first_token_ms: float) -> None:
        """A request of the member whose head came past its bound (the caller knows the bound)."""
        self.samples.append(LateHead(at, head_ms, max(head_ms, first_token_ms)))

    def remaining_ms(self, waited_ms: float, now: float) -> float | None:
        """How much longer than `waited_ms` a request of the member with no head yet is taken to
        wait for its first token: the median of that remainder among its recent late heads that
        came later than `waited_ms`; None with fewer than MIN_SAMPLES of those."""
        while self.samples and now - self.samples[0].at > self.max_age_s:
            self.samples.popleft()
        later = [s.first_token_ms - waited_ms for s in self.samples if s.head_ms > waited_ms]
        return statistics.median(later) if len(later) >= MIN_SAMPLES else None
