"""Which label combinations (series) the metrics keep: a bounded set, least recently used out
first, in which the series of real models are never pushed out by junk (sans-IO).

A client can send any model name, any path, to any host (through the proxy listener): each
new combination of labels is a new series in every instrument, and a scrape of 780,017 of
them took 13 s, longer than Prometheus waits. `SeriesBound` keeps at most `limit`
combinations:

- a combination whose model and upstream host have had a successful call (a 2xx: the
  upstream knows that model) is *proven*; the others (a made-up model the upstream refused,
  a closed port, a path that is not an API) are not;
- a success proves a model only within its upstream's quota (`per_upstream` models: a
  quarter of the limit, 8 at least): an upstream that answers 200 to anything (an attacker's own,
  reached through the proxy listener, or a permissive one behind a reverse listener) proves
  its newest models in place of its own older ones, which fall back to unproven: 150 names
  sent to it cannot prove 150 models, nor push out another upstream's;
- a new combination takes the place of the least recently used unproven one; a proven one
  takes a proven one's place only when no unproven one is left, and only from an upstream
  whose answers proved less (fewer successes) than its own, or from its own upstream: junk
  spread over many upstreams, each with a success or two, never pushes out a model in real
  use;
- an unproven combination that finds the bound full of proven ones is counted in its
  overflow series instead: model and host `other`, the rest as it was (a few dozen at most:
  API shapes x status classes), so nothing goes uncounted.

The upstreams with proven models are as many as the limit at most: beyond, the one whose
answers proved least goes (its models unproven again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

OTHER = "other"

Labels = tuple[str, ...]
"""(operation, provider, model, host, api, status class): metrics.LABELS' values."""
MODEL, HOST = 2, 3


class SeriesBound:
    def __init__(self, limit: int, per_upstream: int | None = None) -> None:
        self.limit = max(limit, 1)
        self.per_upstream = per_upstream or max(self.limit // 4, min(self.limit, 8))
        self.proven: OrderedDict[Labels, None] = OrderedDict()
        self.unproven: OrderedDict[Labels, None] = OrderedDict()
        self.models: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        """Per upstream host (most recent success last), its proven models (most recent last)."""
        self.successes: dict[str, int] = {}
        """Per upstream host in `models`, its successful calls."""

    def __len__(self) -> int:
        return len(self.proven) + len(self.unproven)

    def is_proven(self, model: str, host: str) -> bool:
        return model in self.models.get(host, ())

    def admit(self, labels: Labels, success: bool, evict: Callable[[Labels], None]) -> Labels:
        """The labels to count a call under: its own, or its overflow series; `evict` is told
        each combination pushed out to make room (its series are to go)."""
        model, host = labels[MODEL], labels[HOST]
        if model == OTHER and host == OTHER:
            return labels  # an overflow series: outside the bound, and a few at most
        if success:
            self._prove(model, host)
        proven = self.is_proven(model, host)
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
            victim = next(iter(self.unproven), None) or (self._proven_victim(host) if proven else None)
            if victim is None:
                return overflow(labels)
            (self.unproven if victim in self.unproven else self.proven).pop(victim)
            evict(victim)
        (self.proven if proven else self.unproven)[labels] = None
        return labels

    def _prove(self, model: str, host: str) -> None:
        models = self.models.get(host)
        if models is None:
            if len(self.models) >= self.limit:
                weakest = min(self.models, key=self.successes.__getitem__)  # the least recent among equals
                self._unprove(weakest, *self.models.pop(weakest))
                del self.successes[weakest]
            models = self.models[host] = OrderedDict()
            self.successes[host] = 0
        self.models.move_to_end(host)
        self.successes[host] += 1
        models[model] = None
        models.move_to_end(model)
        if len(models) > self.per_upstream:
            oldest, _ = models.popitem(last=False)
            self._unprove(host, oldest)

    def _unprove(self, host: str, *models: str) -> None:
        """`models` of `host` are no longer proven: their combinations are the first junk to go."""
        for labels in [k for k in self.proven if k[HOST] == host and k[MODEL] in models]:
            del self.proven[labels]
            self.unproven[labels] = None
            self.unproven.move_to_end(labels, last=False)

    def _proven_victim(self, host: str) -> Labels | None:
        """The proven combination a newly proven one of `host` may take the place of: the least
        recently used of the upstream whose answers proved least, if that is fewer than `host`'s
        (or `host` itself); None: no room for it."""
        own = self.successes.get(host, 0)
        victim: Labels | None = None
        for labels in self.proven:  # least recently used first
            if labels[HOST] == host:
                return labels
            if self.successes.get(labels[HOST], 0) < own and (
                    victim is None or self.successes.get(labels[HOST], 0) < self.successes.get(victim[HOST], 0)):
                victim = labels
        return victim

    def _promote_proven(self) -> None:
        """The oldest unproven combinations whose model has had a success since are proven."""
        while self.unproven:
            oldest = next(iter(self.unproven))
            if not self.is_proven(oldest[MODEL], oldest[HOST]):
                return
            del self.unproven[oldest]
            self.proven[oldest] = None


def overflow(labels: Labels) -> Labels:
    """The series a call is counted in when its own has no room: model and host `other`."""
    return (*labels[:MODEL], OTHER, OTHER, *labels[HOST + 1:])
