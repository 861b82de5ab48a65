"""The upstream's own wait for a prompt, learned from the traffic (pure).

A model reads the whole prompt before its first token, so the upstream's own wait
(queue and prefill: `upstream_wait` and `head_to_first_token`, one network round trip
taken out, `phases.contributions`) grows with the prompt's uncached tokens, and less
with its cached ones. Per line — upstream · model · what else of the request changes its
prefill (`model_key`: reasoning effort or thinking budget, the tools' schema size, as the
API tells, `Api.prefill_traits`) — the relay keeps the newest WINDOW samples (time,
uncached tokens, cached tokens, own wait, source) of its successful streamed requests and
fits

    own wait ≈ base + a · uncached/1k + b · cached/1k

by quantile regression (`fit`: the line under the queue spikes, then the median fit of
the samples near it): a queue spike on some requests does not drag the line up as it
would a least squares line. A rate is fitted only for a token count that varied enough
across the samples (else it is left out, and with it any claim about the prompt's share), and no
rate comes out negative. The residuals' robust spread (1.4826 × their median absolute
value) is how much this upstream's wait varies on its own.

No client owns a line. Each sample names its source (the client's access key as a digest,
else its address: `state.source_of`); a full window drops the oldest sample of the source
holding most, and a fit counts no source for more than all the others together (`balanced`):
300 slow requests of one client neither push the others' samples out nor move the line
their first tokens draw. A line is admitted only from a successful streamed answer (the
traffic proves the model exists), at most UPSTREAM_MODELS per upstream and MAX_MODELS in
all; a proven line (MIN_SAMPLES samples once) is never evicted for a new one, however many
names clients send, unless it went unused for STALE_S.

From a fit, a request's `phases.Expectation`: the own wait its prompt predicts, the part
its tokens account for, and the tolerance beyond which the wait is out of line (queueing):
the largest of QUEUE_MIN_MS, QUEUE_RELATIVE of the prediction and QUEUE_SCALES spreads.
While a line has fewer than MIN_SAMPLES samples it is learning: from PROVISIONAL_MIN on,
a provisional expectation (`provisional`: what the first requests nearest in size whose
prompts were at least as long took) holds a wait against them; nothing is predicted
for a prompt far beyond those seen (that length is still being learned). A lasting change of the provider's speed (RELEARN_RUN requests in a
row out of line the same way by about the same factor, up to RELEARN_NEAR times; not all
from one source where the line recently had two)
starts the line again from those requests: re-learned in a few requests, not after a
window's worth.

What one relay process learns every process logging into the same directory uses within
moments: each line is one entry of the relay's store (`line_value`, `line_of`; two
processes' words on a line are merged as one line keeps samples, `merged_line`; the file
work is `ttft_relay/observe/verdicts.py`'s and `ttft_relay/store.py`'s).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import mul, sub
from typing import Any, NamedTuple

import orjson

from ..timing import phases

WINDOW = 256
"""Recent samples kept per line."""
MIN_SAMPLES = 8
"""Requests of a line before its fit predicts (and the line is proven)."""
PROVISIONAL_MIN = 3
"""Requests of a line before a provisional expectation holds a wait against them."""
PROVISIONAL_NEAREST = 3
"""The first requests nearest in size whose waits bound a prompt's, while learning."""
MAX_MODELS = 64
"""Lines learned at once (the names come from clients)."""
UPSTREAM_MODELS = 16
"""Lines learned at once per upstream: an upstream a client chose (proxy mode) takes no more."""
STALE_S = 7 * 86400.0
"""A proven line unused this long may give way to a new one."""
KEY_MAX = 200
"""Characters of a line's key kept."""
SOURCE_MAX = 40
"""Characters of a sample's source kept."""
MIN_SPREAD_TOKENS = 256
"""A token count varies enough to fit a rate when its samples span at least this many
tokens, and at least MIN_SPREAD_SHARE of their largest value."""
MIN_SPREAD_SHARE = 0.5
EXTRAPOLATE = 4.0
"""A prompt up to this many times the largest learned (plus EXTRAPOLATE_TOKENS) is predicted;
a longer one is not: prefill is linear only so far."""
EXTRAPOLATE_TOKENS = 1000
QUEUE_MIN_MS = 250.0
QUEUE_RELATIVE = 0.5
QUEUE_SCALES = 4.0
IRLS_ROUNDS = 30
FIRST_QUANTILE = 0.25
SPIKE_SPREADS = 3.0
SPIKE_MIN_MS = 50.0
"""A sample further above the first fit than this many spreads (and this many ms) is a queue
spike, left out of the second."""
IRLS_FLOOR_MS = 1.0
"""Residuals below this weigh as this in the median fit (its iteratively reweighted least squares)."""
RELEARN_RUN = 3
"""Requests in a row out of line the same way that make a new speed, not a queue."""
RELEARN_FACTOR = 1.2
"""... each within this factor of the others (a queue comes and goes; a new speed holds)."""
RELEARN_NEAR = 3.0
RELEARN_RUN_FAR = 24
"""A change beyond RELEARN_NEAR times the learned wait (either way) is more like a queue (a
server that holds every request 300 ms more is 25 times slower on a 12 ms line): it becomes
the line only after this many requests in a row."""
RELEARN_SHARE = 2 / 3
"""... of which no one source sends more than this share, where the line recently had more than one."""
RECENT = 32
RECENT_S = 600.0
"""The sources a new speed must be seen from: those of the line's last RECENT samples and of
its last RECENT_S seconds. Where there were two, one client alone, however many requests it
sends, does not re-learn the line the others use."""

Sample = tuple[float, int, int, float, str]
"""(time, uncached tokens, cached tokens, the upstream's own wait in ms, source)."""


class Prediction(NamedTuple):
    """What a line says of a prompt: the expectation, or None and why not; `learning`: the
    line, or prompts this long on it, are still being learned, so a wait without an
    expectation is out of line with nothing."""

    expectation: phases.Expectation | None
    unlearned: str | None
    learning: bool


@dataclass(frozen=True, slots=True)
class Fit:
    """own wait ≈ base_ms + per_1k_uncached · uncached/1k + per_1k_cached · cached/1k."""

    base_ms: float
    per_1k_uncached: float | None
    """None: uncached prompt sizes did not vary enough to learn a rate."""
    per_1k_cached: float | None
    scale_ms: float
    """The robust spread of the samples around the fit."""
    n: int
    max_uncached: int
    max_cached: int

    def covers(self, uncached: int, cached: int) -> bool:
        """The prompt is within what the samples let the fit say."""
        return all(tokens <= EXTRAPOLATE * seen + EXTRAPOLATE_TOKENS
                   for tokens, seen in ((uncached, self.max_uncached), (cached, self.max_cached)))

    def prompt_ms(self, uncached: int, cached: int) -> float:
        """What the prompt's tokens account for (0 for a part whose rate is unknown)."""
        return ((self.per_1k_uncached or 0.0) * uncached + (self.per_1k_cached or 0.0) * cached) / 1000

    def expect(self, uncached: int, cached: int) -> phases.Expectation:
        prompt = self.prompt_ms(uncached, cached)
        own = max(0.0, self.base_ms + prompt)
        return phases.Expectation(
            own_ms=round(own, 1),
            tolerance_ms=round(max(QUEUE_MIN_MS, QUEUE_RELATIVE * own, QUEUE_SCALES * self.scale_ms), 1),
            prompt_ms=round(min(prompt, own), 1),
            uncached_tokens=uncached,
            cached_tokens=cached,
            ms_per_1k=None if self.per_1k_uncached is None else round(self.per_1k_uncached, 1),
            learned_from=self.n,
        )

    def as_dict(self) -> dict[str, Any]:
        return {"base_ms": round(self.base_ms, 1),
                "ms_per_1k_uncached": None if self.per_1k_uncached is None else round(self.per_1k_uncached, 2),
                "ms_per_1k_cached": None if self.per_1k_cached is None else round(self.per_1k_cached, 2),
                "spread_ms": round(self.scale_ms, 1), "n": self.n}


def _varies(values: Sequence[float]) -> bool:
    low, high = min(values), max(values)
    return high - low >= MIN_SPREAD_TOKENS / 1000 and high - low >= MIN_SPREAD_SHARE * high and len(set(values)) >= 3


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """`a x = b` by Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _quantile_regression(columns: list[list[float]], ys: list[float], quantile: float = 0.5) -> list[float] | None:
    """Quantile regression (least absolute deviations at 0.5, the median) by iteratively
    reweighted least squares: `ys` against the `columns` (the first all ones), a residual
    above the line weighing `quantile`, one below `1 - quantile`. Per round the weighted
    normal equations, each sum one pass in C (`map`), so a window of samples fits in a few ms."""
    k = len(columns)
    weights = [1.0] * len(ys)
    beta: list[float] | None = None
    for _ in range(IRLS_ROUNDS):
        weighted = [list(map(mul, weights, col)) for col in columns]
        xtx = [[sum(map(mul, weighted[i], columns[j])) for j in range(k)] for i in range(k)]
        new = _solve(xtx, [sum(map(mul, weighted[i], ys)) for i in range(k)])
        if new is None:
            return beta
        if beta is not None and max(abs(a - b) for a, b in zip(new, beta)) < 0.01:
            return new
        beta = new
        weights = [(quantile if r > 0 else 1.0 - quantile) / max(abs(r), IRLS_FLOOR_MS)
                   for r in _residuals(beta, columns, ys)]
    return beta


def _residuals(beta: Sequence[float], columns: list[list[float]], ys: list[float]) -> list[float]:
    fitted = [beta[0]] * len(ys)
    for b, col in zip(beta[1:], columns[1:]):
        fitted = [f + b * x for f, x in zip(fitted, col)]
    return list(map(sub, ys, fitted))


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _fit_rates(values: Mapping[str, list[float]], columns: list[str], ys: list[float], quantile: float = 0.5
               ) -> tuple[list[float], dict[str, float], list[float]] | None:
    """The `quantile` fit of `ys` against the `columns` of `values` that give it no negative
    rate: (coefficients, rates by column, residuals); None when no fit can be solved."""
    columns = list(columns)
    while True:
        design = [[1.0] * len(ys), *(values[name] for name in columns)]
        beta = _quantile_regression(design, ys, quantile)
        if beta is None:
            if not columns:
                return None
            columns.pop()
            continue
        rates = dict(zip(columns, beta[1:]))
        negative = [name for name, rate in rates.items() if rate < 0]
        if not negative:
            return beta, rates, _residuals(beta, design, ys)
        columns.remove(min(negative, key=lambda name: rates[name]))  # a prompt never makes the wait shorter


def fit(samples: Sequence[Sample]) -> Fit | None:
    """The median fit of the samples' own wait against their tokens; None below MIN_SAMPLES.

    Queueing only ever adds to a wait. So a first fit at a low quantile (FIRST_QUANTILE,
    which queue spikes on up to about two thirds of the requests above the line cannot
    lift) finds the line under the spikes; the samples further above it than
    SPIKE_SPREADS spreads (at least SPIKE_MIN_MS; the spread measured below it, where no
    spike reaches) are left out, and the median fit of the rest is the model. With a
    third of the requests queued 1.5 s, one median fit could tilt towards the spikes of
    the largest prompts (seen: 413 ms predicted where the clean traffic's fit said 133)."""
    if len(samples) < MIN_SAMPLES:
        return None
    values = {"uncached": [s[1] / 1000 for s in samples], "cached": [s[2] / 1000 for s in samples]}
    ys = [s[3] for s in samples]
    columns = [name for name in ("uncached", "cached") if _varies(values[name])]
    first = _fit_rates(values, columns, ys, FIRST_QUANTILE)
    if first is None:
        return None
    beta, rates, residuals = first
    below = [-r for r in residuals if r <= 0]
    limit = max(SPIKE_SPREADS * 1.4826 * _median(below), SPIKE_MIN_MS) if below else SPIKE_MIN_MS
    keep = [i for i, r in enumerate(residuals) if r <= limit]
    kept = {name: [col[i] for i in keep] for name, col in values.items()}
    second = _fit_rates(kept, [name for name in columns if _varies(kept[name])], [ys[i] for i in keep])
    if second is not None:
        beta, rates, residuals = second
    return Fit(
        base_ms=beta[0],
        per_1k_uncached=rates.get("uncached"),
        per_1k_cached=rates.get("cached"),
        scale_ms=1.4826 * _median(list(map(abs, residuals))),
        n=len(samples),
        max_uncached=max(s[1] for s in samples),
        max_cached=max(s[2] for s in samples),
    )


def provisional(samples: Sequence[Sample], uncached: int, cached: int) -> phases.Expectation | None:
    """What a line's first requests (PROVISIONAL_MIN up to MIN_SAMPLES) say of a prompt: no
    more than the requests nearest in size whose prompts were at least as long took (a
    longer prompt never takes less; give or take MIN_SPREAD_TOKENS): the lower median wait
    of up to PROVISIONAL_NEAREST of them, with the usual tolerance. None before
    PROVISIONAL_MIN, or when none was as long (then any wait may be its prefill)."""
    if len(samples) < PROVISIONAL_MIN:
        return None
    longer = sorted((s for s in samples if s[1] + MIN_SPREAD_TOKENS >= uncached and s[2] + MIN_SPREAD_TOKENS >= cached),
                    key=lambda s: s[1] + s[2])[:PROVISIONAL_NEAREST]
    if not longer:
        return None
    ys = sorted(s[3] for s in longer)
    own = ys[(len(ys) - 1) // 2]
    spread = 1.4826 * _median([abs(y - own) for y in ys])
    return phases.Expectation(
        own_ms=round(own, 1), tolerance_ms=round(max(QUEUE_MIN_MS, QUEUE_RELATIVE * own, QUEUE_SCALES * spread), 1),
        prompt_ms=0.0, uncached_tokens=uncached, cached_tokens=cached, ms_per_1k=None, learned_from=len(samples),
        provisional=True)


def balanced(samples: Sequence[Sample]) -> list[Sample]:
    """The samples with the source holding most cut to its newest as many as all the others
    together hold (at least MIN_SAMPLES): no one client draws the line for the rest."""
    counts = Counter(s[4] for s in samples)
    if len(counts) < 2:
        return list(samples)
    source, most = counts.most_common(1)[0]
    drop = most - max(len(samples) - most, MIN_SAMPLES)
    out = []
    for s in samples:
        if drop > 0 and s[4] == source:
            drop -= 1
            continue
        out.append(s)
    return out


def model_key(upstream: str, model: str | None, traits: str = "") -> str:
    """A line's key: "upstream · model", and " · traits" when the request has any that change
    its prefill (`Api.prefill_traits`: "effort high · tools ≤16 kB")."""
    return " · ".join(part for part in (upstream, model or "?", traits) if part)[:KEY_MAX]


def prompt_of(usage: Mapping[str, Any] | None, prompt_tokens: int | None) -> tuple[int, int] | None:
    """(uncached, cached) prompt tokens: as the upstream reported them, else as the relay
    counted them (no cached part known); None when neither is known."""
    usage = usage or {}
    total, cached = usage.get("input_tokens"), usage.get("cached_tokens") or 0
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        return (prompt_tokens, 0) if isinstance(prompt_tokens, int) and prompt_tokens > 0 else None
    cached = min(cached, total) if isinstance(cached, int) and cached > 0 else 0
    return total - cached, cached


def own_wait(rec: Mapping[str, Any]) -> float | None:
    """A record's upstream's own wait (queue and prefill, one round trip taken out), as the
    verdict takes it; None without an upstream wait."""
    p = rec.get("phases") or {}
    if "upstream_wait" not in p:
        return None
    return phases.contributions(p, rtt_ms=rec.get("rtt_ms"), upstream_ms=rec.get("upstream_processing_ms"))[
        phases.UPSTREAM_WAIT]


def sample_of(rec: Mapping[str, Any], source: str = "") -> Sample | None:
    """What a record teaches: a successful streamed request (or turn) that asked for output
    and whose prompt's size is known; None for any other (a failure, a handshake, a
    prewarm, an answer not streamed, whose wait holds the whole answer, a request an upstream
    group failed over or hedged to another member, whose wait holds the first attempt's)."""
    if (rec.get("error") or rec.get("client_aborted") or (rec.get("status") or 200) >= 400 or rec.get("prewarm")
            or phases.waited_for_another(rec.get("route"))
            or (rec.get("transport") == "websocket" and rec.get("turn") == 0)
            or "first_token" not in (rec.get("marks") or {}) or "ttft" not in (rec.get("phases") or {})):
        return None
    prompt, own = prompt_of(rec.get("usage"), rec.get("prompt_tokens")), own_wait(rec)
    if prompt is None or own is None:
        return None
    return round(rec.get("ts") or 0.0, 3), *prompt, round(own, 1), source[:SOURCE_MAX]


@dataclass(eq=False, slots=True)
class Line:
    """One line's samples (time order) and its fit."""

    upstream: str
    samples: deque[Sample] = field(default_factory=deque)
    sources: Counter[str] = field(default_factory=Counter)
    """Samples per source in `samples`."""
    proven: bool = False
    """It had MIN_SAMPLES samples once: never evicted for a new line (but when stale)."""
    fitted: Fit | None = None
    added: int = -1
    """Samples added since the last fit; -1: never fitted."""
    since: float = 0.0
    """The time of the first sample of the provider's speed now (a new speed starts the line
    again from its run): older samples, wherever they are kept, are not the line's."""

    def add(self, sample: Sample) -> None:
        if len(self.samples) >= WINDOW:
            self._drop_oldest_of(max(self.sources, key=self.sources.__getitem__))
        self.samples.append(sample)
        self.sources[sample[4]] += 1
        self.proven = self.proven or len(self.samples) >= MIN_SAMPLES
        self.added = self.added + 1 if self.added >= 0 else -1
        if (run := self._new_speed()) is not None:
            self.samples = deque(self.samples[i] for i in range(len(self.samples) - run, len(self.samples)))
            self.sources = Counter(s[4] for s in self.samples)
            self.added = -1
            self.since = self.samples[0][0]

    def replace(self, samples: Sequence[Sample], since: float) -> None:
        """The line's samples (time order) as the store holds them; a later `since` than the
        line's (a new speed found elsewhere) starts its fit again."""
        fresh = len(set(samples) - set(self.samples))
        self.samples = deque(samples)
        self.sources = Counter(s[4] for s in self.samples)
        while len(self.samples) > WINDOW:
            self._drop_oldest_of(max(self.sources, key=self.sources.__getitem__))
        self.proven = self.proven or len(self.samples) >= MIN_SAMPLES
        self.added = -1 if since > self.since or self.added < 0 else self.added + fresh
        self.since = max(self.since, since)

    def _drop_oldest_of(self, source: str) -> None:
        for i, s in enumerate(self.samples):
            if s[4] == source:
                del self.samples[i]
                self.sources[source] -= 1
                if not self.sources[source]:
                    del self.sources[source]
                return

    def fit(self) -> Fit | None:
        """The line's fit, refitted once its samples grew by an eighth since the last one;
        None before MIN_SAMPLES."""
        n = len(self.samples)
        if self.added < 0 or self.added >= max(1, n // 8) or n < MIN_SAMPLES:
            self.fitted = fit(balanced(self.samples))
            self.added = 0
        return self.fitted

    def _new_speed(self) -> int | None:
        """The newest samples say the provider's speed changed for good: RELEARN_RUN of them
        (RELEARN_RUN_FAR for a change beyond RELEARN_NEAR times: more like a queue than a new
        speed) each out of line with the learned fit the same way, by about the same factor,
        and no more than RELEARN_SHARE of them from one source where the line recently had two.
        Returns how many they are, or None."""
        n, f = len(self.samples), self.fitted
        if f is None or not f.covers(*self.samples[-1][1:3]):
            return None
        newest = self.samples[-1]
        ratio = (newest[3] + 1.0) / (f.expect(newest[1], newest[2]).own_ms + 1.0)
        k = RELEARN_RUN if 1 / RELEARN_NEAR <= ratio <= RELEARN_NEAR else RELEARN_RUN_FAR
        if n < MIN_SAMPLES + k:
            return None
        run = [self.samples[i] for i in range(n - k, n)]
        ratios = []
        for s in run:
            if not f.covers(s[1], s[2]):
                return None
            e = f.expect(s[1], s[2])
            if abs(s[3] - e.own_ms) <= e.tolerance_ms:
                return None
            ratios.append((s[3] + 1.0) / (e.own_ms + 1.0))
        same_way = all(r > 1 for r in ratios) or all(r < 1 for r in ratios)
        if not same_way or max(ratios) > RELEARN_FACTOR * min(ratios):
            return None
        recent = {s[4] for i, s in enumerate(self.samples) if i >= n - RECENT or newest[0] - s[0] <= RECENT_S}
        if len(recent) >= 2 and Counter(s[4] for s in run).most_common(1)[0][1] > RELEARN_SHARE * k:
            return None  # one client's run: its own, not the provider's
        return k


class PrefillRates:
    """The lines, and what a request's prompt predicts on its line."""

    def __init__(self) -> None:
        self.lines: dict[str, Line] = {}

    def add(self, key: str, upstream: str, sample: Sample) -> bool:
        """Learn `sample` on the line `key` (of `upstream`); False: the line was not admitted
        (the table, or the upstream's share of it, is full of proven lines)."""
        key = key[:KEY_MAX]
        line = self.lines.get(key)
        if line is None:
            if not self._room_for(upstream, sample[0]):
                return False
            line = self.lines[key] = Line(upstream)
        line.add(sample)
        return True

    def _room_for(self, upstream: str, now: float) -> bool:
        """Whether a new line of `upstream` fits, evicting the stalest line that may go for it."""
        same = [key for key, line in self.lines.items() if line.upstream == upstream]
        if len(same) >= UPSTREAM_MODELS:
            candidates = same
        elif len(self.lines) >= MAX_MODELS:
            candidates = list(self.lines)
        else:
            return True
        newest = {key: self.lines[key].samples[-1][0] if self.lines[key].samples else 0.0 for key in candidates}
        may_go = [key for key in candidates if not self.lines[key].proven or now - newest[key] > STALE_S]
        if not may_go:
            return False
        del self.lines[min(may_go, key=newest.__getitem__)]
        return True

    def expect(self, key: str, prompt: tuple[int, int] | None) -> Prediction:
        """What this prompt predicts on the line `key`."""
        line = self.lines.get(key[:KEY_MAX])
        if prompt is None:
            return Prediction(None, "the prompt's size is unknown: the upstream reported no usage", False)
        f = line.fit() if line is not None else None
        if f is None:
            n = len(line.samples) if line is not None else 0
            first = provisional(balanced(line.samples), *prompt) if line is not None else None
            return Prediction(first, f"learning this upstream · model: {n} of {MIN_SAMPLES} requests", True)
        if not f.covers(*prompt):  # learning prompts this long: its prefill may explain any wait
            return Prediction(None, (f"no prompt this long learned yet (up to {f.max_uncached} uncached, "
                                     f"{f.max_cached} cached tokens)"), True)
        return Prediction(f.expect(*prompt), None, False)

    def fits(self) -> dict[str, Fit]:
        return {key: f for key, line in self.lines.items() if (f := line.fit()) is not None}

    def take(self, key: str, upstream: str, since: float, samples: Sequence[Sample]) -> None:
        """What the store holds of the line `key` (`line_of`: the words of every process on
        it, this one's included) becomes the line here, with the samples learned here since it
        was put there; a line this process does not hold is admitted as a new one is."""
        key = key[:KEY_MAX]
        line = self.lines.get(key)
        kept = sorted(s for s in samples if s[0] >= since)
        if line is None:
            for sample in kept:
                if not self.add(key, upstream, sample):
                    return
            if (line := self.lines.get(key)) is not None:
                line.since = since
            return
        theirs = set(kept)
        newest = kept[-1][0] if kept else since
        mine = [s for s in line.samples if s not in theirs and s[0] > newest]  # learned here meanwhile
        line.replace(kept + mine, since)

def line_value(line: Line) -> dict[str, Any]:
    """A line as the store keeps it (JSON): its upstream, since when its samples count, its samples."""
    return {"upstream": line.upstream, "since": line.since, "samples": [list(s) for s in line.samples]}


def line_of(value: Any) -> tuple[str, float, list[Sample]] | None:
    """(upstream, since, samples) of a line the store holds, or None if it is not one the relay wrote."""
    if not isinstance(value, dict) or not isinstance(value.get("upstream"), str) or not _finite(value.get("since")):
        return None
    raw = value.get("samples")
    if not isinstance(raw, list) or len(raw) > WINDOW:
        return None
    samples = []
    for s in raw:
        if not (isinstance(s, list) and len(s) == 5 and isinstance(s[4], str) and all(_finite(v) and v >= 0 for v in s[:4])):
            return None
        samples.append((float(s[0]), int(s[1]), int(s[2]), float(s[3]), s[4][:SOURCE_MAX]))
    return value["upstream"][:KEY_MAX], float(value["since"]), samples


def merged_line(theirs: Any, mine: Any) -> dict[str, Any]:
    """Two processes' words on one line (`line_value`s) as one: the samples of both since the
    later `since`, kept as one line keeps them (each source a bounded share of WINDOW)."""
    a, b = line_of(theirs), line_of(mine)
    if a is None or b is None:
        return mine
    since = max(a[1], b[1])
    line = Line(b[0], since=since)
    for sample in sorted(set(a[2]) | set(b[2])):
        if sample[0] >= since:
            line.add(sample)
    line.since = since  # a replay never starts a new speed (no fit yet), so `since` stands
    return line_value(line)


class Row(NamedTuple):
    """One line of the previous version's shared file: a sample learned on `key` of `upstream`."""

    key: str
    upstream: str
    sample: Sample


def decode_rows(data: bytes) -> list[tuple[str, Row]]:
    """(writer, row) for each whole line of the previous version's shared file (JSON lines,
    one a sample: [writer, key, upstream, time, uncached, cached, own wait, source]) that is
    one; anything else (a torn line, a hand edit) is skipped: what it held is learned again
    from the traffic."""
    rows = []
    for text in data.split(b"\n"):
        try:
            row = orjson.loads(text) if text else None
        except orjson.JSONDecodeError:
            continue
        if (isinstance(row, list) and len(row) == 8 and all(isinstance(row[i], str) for i in (0, 1, 2, 7))
                and all(_finite(v) and v >= 0 for v in row[3:7])):
            writer, key, upstream, t, u, c, y, source = row
            rows.append((writer, Row(key[:KEY_MAX], upstream[:KEY_MAX],
                                     (float(t), int(u), int(c), float(y), source[:SOURCE_MAX]))))
    return rows


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
