"""The timing report as one self-contained HTML page: waterfalls and plots (pure).

Python does the arithmetic (percentiles, fits, time buckets, each request's bar
offsets); the page's own small script (`report_html.js`, inlined with
`report_html.css`) only draws: SVG for the waterfalls and bar charts, a canvas for
the scatter plots (a hundred thousand dots as SVG nodes would make the page slow).
Nothing is fetched when the page opens: no network, no CDN.

Per-request data travels as columns (one list per field), not one object per
request, which keeps a 100k-request page small and fast to parse. `page()` takes
any such data, so `ttft-relay diagnose --html` draws its probes with the same code
(`diagnose/findings_html.py`).
"""

from __future__ import annotations

import html
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

import orjson

from ..observe import prefill
from ..timing import phases
from .summary import (counts_as_first_token, group_key, is_handshake, is_prewarm, prompt_tokens, upstream_groups,
                      upstream_own_wait)

HERE = Path(__file__).resolve().parent
BAR_PHASES = phases.CRITICAL_PHASES + ("stream",)
"""A request's bars, left to right: the critical path to the first token, then the stream."""
TICK_MARKS = ("first_byte", "first_token", "last_token", "end", "longest_gap")
"""Marks the waterfall draws (the longest gap as the dashed stretch it began)."""
MAX_BUCKETS = 48
BUCKET_SIZES_S = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400)


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def bar_start(rec: Mapping[str, Any]) -> float:
    """Where the first bar begins (ms from the request head): the phases add up to ttft
    and end at the first token, or at the end for an answer not streamed or a failed
    one (to its total); the wait can begin before the head (the request's first byte
    held in the kernel, see `phases.compute`)."""
    marks, ttft, total = rec.get("marks") or {}, rec.get("ttft_ms"), (rec.get("phases") or {}).get("total")
    if ttft is not None:
        end_of_path = marks.get("first_token", marks.get("end"))
        if end_of_path is not None:
            return end_of_path - ttft
    if total is not None and marks.get("end") is not None:
        return marks["end"] - total
    return min(0.0, marks.get("client_arrived", 0.0))


def bucket_size(span_s: float) -> int:
    """The smallest of BUCKET_SIZES_S that cuts `span_s` into at most MAX_BUCKETS."""
    return next((b for b in BUCKET_SIZES_S if span_s / b <= MAX_BUCKETS), BUCKET_SIZES_S[-1])


def time_buckets(records: Sequence[Mapping[str, Any]], t0: float) -> dict[str, Any]:
    """Per time bucket: the median of each critical-path phase (the first token's
    parts, `phases.CRITICAL_PHASES`) over the requests that have it."""
    timed = [r for r in records if r.get("ts") and counts_as_first_token(r)]
    if not timed:
        return {"size_s": 60, "start": [], "n": [], "medians": []}
    span = max(r["ts"] for r in timed) - t0
    size = bucket_size(span)
    per_bucket: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in timed:
        per_bucket[int((r["ts"] - t0) // size)].append(r)
    keys = sorted(per_bucket)
    medians = []
    for k in keys:
        rows = per_bucket[k]
        row = []
        for name in phases.CRITICAL_PHASES:
            values = [v for r in rows if (v := (r.get("phases") or {}).get(name)) is not None]
            row.append(_r(statistics.median(values)) if values else 0)
        medians.append(row)
    return {"size_s": size, "start": [k * size for k in keys], "n": [len(per_bucket[k]) for k in keys], "medians": medians}


def columns(records: Sequence[Mapping[str, Any]], t0: float, bar_phases: Sequence[str] = BAR_PHASES) -> dict[str, Any]:
    """The per-request columns the page draws from (see the module docstring)."""
    verdicts = [v for v, _ in Counter(r.get("verdict") or "?" for r in records).most_common()]
    groups = [g for g, _ in Counter(group_key(r) for r in records).most_common()]
    v_index = {v: i for i, v in enumerate(verdicts)}
    g_index = {g: i for i, g in enumerate(groups)}
    col: dict[str, list[Any]] = {k: [] for k in (
        "id", "t", "ttft", "v", "g", "pt", "up", "own", "gap", "status", "s", "ph", "mk", "kind")}
    errors, error_phases = {}, {}
    for i, r in enumerate(records):
        p, m = r.get("phases") or {}, r.get("marks") or {}
        col["id"].append(r.get("id") or "")
        col["t"].append(round((r.get("ts") or t0) - t0, 3))
        col["ttft"].append(_r(r.get("ttft_ms")))
        col["v"].append(v_index[r.get("verdict") or "?"])
        col["g"].append(g_index[group_key(r)])
        col["pt"].append(prompt_tokens(r))
        col["up"].append(prompt[0] if (prompt := prefill.prompt_of(r.get("usage"), r.get("prompt_tokens"))) else None)
        col["own"].append(_r(upstream_own_wait(r)))
        col["gap"].append(_r(r.get("max_gap_ms")))
        col["status"].append(r.get("status"))
        col["s"].append(_r(bar_start(r)))
        col["ph"] += [_r(p.get(name)) for name in bar_phases]
        col["mk"] += [_r(m.get(name)) for name in TICK_MARKS]
        col["kind"].append("handshake" if is_handshake(r) else "prewarm" if is_prewarm(r)
                           else "ws" if r.get("transport") == "websocket" else "")
        if r.get("error") or r.get("client_aborted"):
            errors[i] = r.get("error") or "client aborted"
            error_phases[i] = r.get("error_phase")
    return {"verdicts": verdicts, "groups": groups, "col": col, "errors": errors, "error_phases": error_phases}


def report_data(records: Sequence[Mapping[str, Any]], summary: Mapping[str, Mapping[str, Any]], *,
                slowest: int, title: str = "ttft-relay report") -> dict[str, Any]:
    """Everything the report page shows, from the records and `report.summarize`'s summary."""
    t0 = min((r["ts"] for r in records if r.get("ts")), default=0.0)
    data = columns(records, t0)
    ranked = sorted(
        (i for i, r in enumerate(records) if r.get("ttft_ms") is not None and counts_as_first_token(r)),
        key=lambda i: -records[i]["ttft_ms"],
    )
    data |= {
        "title": title,
        "kind": "report",
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "t0": t0,
        "phases": list(BAR_PHASES),
        "marks": list(TICK_MARKS),
        "slowest": ranked[:slowest],
        "buckets": time_buckets(records, t0),
        "fits": {key: g["first_token_model"] for key, g in summary.items() if g.get("first_token_model")},
        "percentiles": {
            key: {name: g["stats"][name] for name in (*BAR_PHASES, "ttft") if name in g["stats"]}
            for key, g in summary.items()
        },
        "counts": {key: {k: g.get(k) for k in ("requests", "errors", "websocket")} for key, g in summary.items()},
        "upstream_groups": upstream_groups(records),
    }
    return data


def page(data: Mapping[str, Any]) -> str:
    """One HTML document: the data as JSON, and the script and styles that draw it."""
    # `</` cannot end the script element early once every `<` is escaped.
    payload = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS).replace(b"<", b"\\u003c").decode()
    css = (HERE / "report_html.css").read_text(encoding="utf8")
    js = (HERE / "report_html.js").read_text(encoding="utf8")
    title = html.escape(str(data.get("title", "ttft-relay")))
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width\"><title>{title}</title>"
        f"<style>{css}</style></head><body><div id=\"app\"><h1>{title}</h1><p class=\"note\">drawing…</p></div>"
        f"<script id=\"data\" type=\"application/json\">{payload}</script>"
        f"<script>{js}</script></body></html>\n"
    )
