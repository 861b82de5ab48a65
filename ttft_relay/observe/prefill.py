"""The upstream's own wait for a prompt, learned from the traffic (pure).

A model reads the whole prompt before its first token, so the upstream's own wait
(queue and prefill: `upstream_wait` and `head_to_first_token`, one network round trip
taken out, `phases.contributions`) grows with the prompt's uncached tokens, and less
with its cached ones. Per upstream · model the relay keeps the newest WINDOW samples
(time, uncached tokens, cached tokens, own wait) of its successful streamed requests and
fits

    own wait ≈ base + a · uncached/1k + b · cached/1k

by quantile regression (`fit`: the line under the queue spikes, then the median fit of
the samples near it): a queue spike on some requests does not drag the line up as it
would a least squares line. A rate is fitted only for a token count that varied enough
across the samples (else it is left out, and with it any claim about the prompt's share), and no
rate comes out negative. The residuals' robust spread (1.4826 × their median absolute
value) is how much this upstream's wait varies on its own.

From a fit, a request's `phases.Expectation`: the own wait its prompt predicts, the part
its tokens account for, and the tolerance beyond which the wait is out of line (queueing):
the largest of QUEUE_MIN_MS, QUEUE_RELATIVE of the prediction and QUEUE_SCALES spreads.
Nothing is predicted before MIN_SAMPLES requests, nor for a prompt far beyond those seen:
no verdict from a model that does not exist yet.

The samples persist as JSON (`encode`, `decode`) and merge by union (`merge`): each relay
process, a worker among N, keeps its own and merges them with the state file beside the
timing log now and then (`ttft_relay/observe/verdicts.py`), so every process learns from all.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import mul, sub
from typing import Any

import orjson

from ..timing import phases

WINDOW = 256
"""Recent samples kept per upstream · model."""
MIN_SAMPLES = 8
"""Requests of an upstream · model before anything is predicted for it."""
MAX_MODELS = 64
"""Upstream · model pairs learned at once (the names come from clients): the ones whose
newest sample is oldest go first."""
KEY_MAX = 200
"""Characters of an upstream · model key kept."""
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

Sample = tuple[float, int, int, float]
"""(time, uncached tokens, cached tokens, the upstream's own wait in ms)."""


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


def model_key(upstream: str, model: str | None) -> str:
    """The learned models' key, as `ttft-relay report` groups: "upstream · model"."""
    return f"{upstream} · {model or '?'}"[:KEY_MAX]


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


def sample_of(rec: Mapping[str, Any]) -> Sample | None:
    """What a record teaches: a successful streamed request (or turn) that asked for output
    and whose prompt's size is known; None for any other (a failure, a handshake, a
    prewarm, an answer not streamed, whose wait holds the whole answer)."""
    if (rec.get("error") or rec.get("client_aborted") or (rec.get("status") or 200) >= 400 or rec.get("prewarm")
            or (rec.get("transport") == "websocket" and rec.get("turn") == 0)
            or "first_token" not in (rec.get("marks") or {}) or "ttft" not in (rec.get("phases") or {})):
        return None
    prompt, own = prompt_of(rec.get("usage"), rec.get("prompt_tokens")), own_wait(rec)
    if prompt is None or own is None:
        return None
    return round(rec.get("ts") or 0.0, 3), *prompt, round(own, 1)


class PrefillRates:
    """Samples and fits per upstream · model; what a request's prompt predicts."""

    def __init__(self) -> None:
        self.samples: dict[str, deque[Sample]] = {}
        self._fits: dict[str, Fit | None] = {}
        self._added: dict[str, int] = {}
        """Samples added per key since its last fit."""

    def add(self, key: str, sample: Sample) -> None:
        window = self.samples.get(key)
        if window is None:
            if len(self.samples) >= MAX_MODELS:
                self._forget_oldest()
            window = self.samples[key] = deque(maxlen=WINDOW)
        window.append(sample)
        self._added[key] = self._added.get(key, 0) + 1

    def fit_of(self, key: str) -> Fit | None:
        """The key's fit, refitted once its samples grew by an eighth since the last one."""
        window = self.samples.get(key)
        if window is None:
            return None
        added = self._added.get(key, 0)
        if key not in self._fits or (added and added >= max(1, len(window) // 8)):
            self._fits[key] = fit(window)
            self._added[key] = 0
        return self._fits[key]

    def expect(self, key: str, prompt: tuple[int, int] | None) -> tuple[phases.Expectation | None, str | None]:
        """What this prompt predicts for the key, or None and why not."""
        if prompt is None:
            return None, "the prompt's size is unknown: the upstream reported no usage"
        f = self.fit_of(key)
        if f is None:
            n = len(self.samples.get(key, ()))
            return None, f"learning this upstream · model: {n} of {MIN_SAMPLES} requests"
        if not f.covers(*prompt):
            return None, (f"no prompt this long learned yet (up to {f.max_uncached} uncached, "
                          f"{f.max_cached} cached tokens)")
        return f.expect(*prompt), None

    def fits(self) -> dict[str, Fit]:
        return {key: f for key in self.samples if (f := self.fit_of(key)) is not None}

    def snapshot(self) -> dict[str, list[Sample]]:
        return {key: list(window) for key, window in self.samples.items()}

    def merge(self, other: Mapping[str, Iterable[Sample]]) -> None:
        """Take in samples learned elsewhere (the state file): the union, newest WINDOW kept."""
        merged = merge(self.snapshot(), other)
        for key in [key for key in self.samples if key not in merged]:
            self._forget(key)
        for key, samples in merged.items():
            if key not in self.samples or list(self.samples[key]) != samples:
                self.samples[key] = deque(samples, maxlen=WINDOW)
                self._fits.pop(key, None)  # refitted when next asked

    def _forget_oldest(self) -> None:
        self._forget(min(self.samples, key=lambda k: self.samples[k][-1][0] if self.samples[k] else 0.0))

    def _forget(self, key: str) -> None:
        self.samples.pop(key, None)
        self._fits.pop(key, None)
        self._added.pop(key, None)


def merge(a: Mapping[str, Iterable[Sample]], b: Mapping[str, Iterable[Sample]]) -> dict[str, list[Sample]]:
    """The union of two sets of samples per key, in time order, the newest WINDOW each, and
    the MAX_MODELS keys learned most recently."""
    out: dict[str, list[Sample]] = {}
    for key in {*a, *b}:
        union = sorted({tuple(s) for s in (*a.get(key, ()), *b.get(key, ()))})
        if union:
            out[key] = [(float(t), int(u), int(c), float(y)) for t, u, c, y in union[-WINDOW:]]
    newest = sorted(out, key=lambda k: out[k][-1][0], reverse=True)[:MAX_MODELS]
    return {key: out[key] for key in sorted(newest)}


STATE_VERSION = 1


def encode(samples: Mapping[str, Iterable[Sample]]) -> bytes:
    return orjson.dumps({"version": STATE_VERSION, "samples": {k: list(v) for k, v in samples.items()}})


def decode(data: bytes) -> dict[str, list[Sample]]:
    """The samples of a state file; empty for anything that is not one (a torn write, an
    older format, a hand edit): the model then learns again from the traffic."""
    try:
        state = orjson.loads(data) if data else {}
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or not isinstance(state.get("samples"), dict):
        return {}
    out: dict[str, list[Sample]] = {}
    for key, rows in state["samples"].items():
        if not isinstance(key, str) or not isinstance(rows, list):
            continue
        good = [(float(r[0]), int(r[1]), int(r[2]), float(r[3])) for r in rows
                if isinstance(r, list) and len(r) == 4 and all(_finite(v) for v in r)
                and r[1] >= 0 and r[2] >= 0 and r[3] >= 0]
        if good:
            out[key[:KEY_MAX]] = good[-WINDOW:]
    return merge(out, {})


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
