"""Which label combinations (series) the metrics keep: a bounded set, least recently used out
first, in which the series of real models are never pushed out by junk (sans-IO).

A client can send any model name, any path, to any host (through the proxy listener): each
new combination of labels is a new series in every instrument, and a scrape of 780,017 of
them took 13 s, longer than Prometheus waits. `SeriesBound` keeps at most `limit`
combinations:

- a combination whose model and upstream host have had a successful call (a 2xx: the
  upstream knows that model) is *proven*; the others (a made-up model the upstream refused,
  a closed port, a path that is not an API) are not;
- a new combination takes the place of the least recently used unproven one; a proven one
  takes the least recently used proven one's place only when no unproven one is left;
- an unproven combination that finds the bound full of proven ones is counted in its
  overflow series instead: model and host `other`, the rest as it was (a few dozen at most:
  API shapes x status classes), so nothing goes uncounted.

Junk therefore only ever evicts junk, and a real model's series, once it has had a success,
stays until other real models have been used more recently than it, `limit` of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

OTHER = "other"

Labels = tuple[str, ...]
"""(operation, provider, model, host, api, status class): metrics.LABELS' values."""
MODEL, HOST = 2, 3


class SeriesBound:
    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 1)
        self.proven: OrderedDict[Labels, None] = OrderedDict()
        self.unproven: OrderedDict[Labels, None] = OrderedDict()
        self.proven_pairs: OrderedDict[tuple[str, str], None] = OrderedDict()
        """(model, host) pairs with a success, most recent last; as many as the limit."""

    def __len__(self) -> int:
        return len(self.proven) + len(self.unproven)

    def admit(self, labels: Labels, success: bool, evict: Callable[[Labels], None]) -> Labels:
        """The labels to count a call under: its own, or its overflow series; `evict` is told
        each combination pushed out to make room (its series are to go)."""
        pair = (labels[MODEL], labels[HOST])
        if labels[MODEL] == OTHER and labels[HOST] == OTHER:
            return labels  # an overflow series: outside the bound, and a few at most
        if success:
            self.proven_pairs[pair] = None
            self.proven_pairs.move_to_end(pair)
            if len(self.proven_pairs) > self.limit:
                self.proven_pairs.popitem(last=False)
        proven = pair in self.proven_pairs
        for kept in (self.proven, self.unproven):
            if labels in kept:
                if proven and kept is self.unproven:  # its model has had a success since
                    del self.unproven[labels]
                    self.proven[labels] = None
                else:
                    kept.move_to_end(labels)
                return labels
        if len(self) >= self.limit:
            self._promote_proven()
            if self.unproven:
                victim, _ = self.unproven.popitem(last=False)
            elif proven:
                victim, _ = self.proven.popitem(last=False)
            else:
                return overflow(labels)
            evict(victim)
        (self.proven if proven else self.unproven)[labels] = None
        return labels


    def _promote_proven(self) -> None:
        """The oldest unproven combinations whose model has had a success since are proven."""
        while self.unproven:
            oldest = next(iter(self.unproven))
            if (oldest[MODEL], oldest[HOST]) not in self.proven_pairs:
                return
            del self.unproven[oldest]
            self.proven[oldest] = None


def overflow(labels: Labels) -> Labels:
    """The series a call is counted in when its own has no room: model and host `other`."""
    return (*labels[:MODEL], OTHER, OTHER, *labels[HOST + 1:])
