"""Summarise ttft-relay timing logs (JSONL, one record per request).

Grouped by upstream host and model: p50/p90/p99 of every phase and of ttft,
error counts, the slowest requests with their verdict, and a least-squares fit
of the upstream's own wait against prompt tokens (ms per 1k prompt tokens plus a
base), which tells context-length slowness from a slow or far-away upstream.
WebSocket turns are counted apart, and so are WebSocket handshakes (the record of
turn 0) and the failed ones; handshakes and prewarm turns (`generate: false`, no
token asked for) stay out of the phase statistics, the fit and the slowest list.

    ttft-relay report logs/timing.jsonl [more.jsonl ...|'logs/timing*.jsonl'] [--since 2h] [--model gpt-4o]
                   [--slowest 5] [--json] [--html report.html]

`--html` also writes the report as one self-contained page of waterfalls and
plots (report_html.py).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from ..timing import phases, record

QUANTILES = (50, 90, 99)
METRICS = phases.PHASES
"""Every phase, ttft included."""
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
GZIP_MAGIC = b"\x1f\x8b"


def parse_since(text: str, now: float | None = None) -> float:
    """`--since` as Unix seconds: a duration back from now (`90s`, `30m`, `2h`,
    `7d`) or an ISO date/time (local time unless it names a zone)."""
    if m := _DURATION.match(text.strip()):
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration (30m, 2h, 7d) or ISO time: {text!r}") from None


def open_log(path: str | Path) -> io.BufferedIOBase:
    """A timing log for reading: plain, or gzip-compressed (a rotated `.gz`, told by its
    magic bytes, whatever its name)."""
    f = open(path, "rb")
    if f.peek(2)[:2] == GZIP_MAGIC:
        return gzip.open(f)
    return f


def read_records(
    paths: Iterable[str | Path], *, since: float | None = None, model: str | None = None
) -> tuple[list[dict[str, Any]], int]:
    """The records of the logs that pass the filters, and the number of unreadable lines."""
    out, bad = [], 0
    for path in paths:
        with open_log(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    bad += 1  # e.g. a line cut short by a crash
                    continue
                if since is not None and (rec.get("ts") or 0) < since:
                    continue
                if model is not None and rec.get("model") != model:
                    continue
                out.append(rec)
    return out, bad


def expand_globs(paths: Iterable[str]) -> list[str]:
    """Paths as given, except a pattern naming no file, which stands for the files it matches."""
    out = []
    for path in paths:
        matches = [] if Path(path).exists() else sorted(glob.glob(path))
        out += matches or [path]
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def upstream_own_wait(rec: Mapping[str, Any]) -> float | None:
    """The upstream's own share of the wait (network round trip taken out), as in the verdict."""
    p = rec.get("phases") or {}
    if "upstream_wait" not in p:
        return None
    return phases.contributions(p, rtt_ms=rec.get("rtt_ms"))[phases.UPSTREAM_WAIT]


def is_handshake(rec: Mapping[str, Any]) -> bool:
    """The record of a WebSocket's opening handshake (turn 0), not of a turn."""
    return rec.get("transport") == "websocket" and rec.get("turn") == 0


def is_prewarm(rec: Mapping[str, Any]) -> bool:
    """A Responses turn with `generate: false`: it asks for no token."""
    return bool(rec.get("prewarm"))


def counts_as_first_token(rec: Mapping[str, Any]) -> bool:
    """A request or WebSocket turn that waited for a first token."""
    return not is_handshake(rec) and not is_prewarm(rec)


def group_key(rec: Mapping[str, Any]) -> str:
    return record.printable(f"{rec.get('upstream')} · {rec.get('model') or '?'}")  # one line, whatever the model


def websocket_counts(records: Sequence[Mapping[str, Any]]) -> dict[str, int] | None:
    """WebSocket turns (prewarm among them) and handshakes (failed among them), or None without any."""
    ws = [r for r in records if r.get("transport") == "websocket"]
    if not ws:
        return None
    handshakes = [r for r in ws if is_handshake(r)]
    return {
        "turns": len(ws) - len(handshakes),
        "prewarm": sum(1 for r in ws if is_prewarm(r)),
        "handshakes": len(handshakes),
        "failed_handshakes": sum(1 for r in handshakes if r.get("error") or r.get("client_aborted")),
    }


def prompt_tokens(rec: Mapping[str, Any]) -> int | None:
    """Prompt tokens as the relay counted them, else as the upstream reported them."""
    return rec.get("prompt_tokens") or (rec.get("usage") or {}).get("input_tokens")


def fit_wait_vs_prompt(records: Iterable[Mapping[str, Any]]) -> dict[str, float] | None:
    """Least squares `own wait = base + slope * prompt_tokens` over successful
    requests; None with fewer than 3 points or a single prompt size."""
    pts = [
        (float(x), y)
        for rec in records
        if not rec.get("error")
        and (x := prompt_tokens(rec)) is not None
        and (y := upstream_own_wait(rec)) is not None
    ]
    n = len(pts)
    if n < 3:
        return None
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    base = my - slope * mx
    syy = sum((y - my) ** 2 for _, y in pts)
    ss_res = sum((y - base - slope * x) ** 2 for x, y in pts)
    return {
        "ms_per_1k_prompt_tokens": round(slope * 1000, 3),
        "base_ms": round(base, 3),
        "r2": round(1 - ss_res / syy, 3) if syy else 1.0,
        "n": n,
    }


def summarize_group(records: Sequence[Mapping[str, Any]], slowest: int = 5) -> dict[str, Any]:
    errors = [r for r in records if r.get("error") or r.get("client_aborted")]
    timed = [r for r in records if counts_as_first_token(r)]
    stats = {}
    for name in METRICS:
        values = [v for r in timed if (v := (r.get("phases") or {}).get(name)) is not None]
        if values:
            # Never None: `values` is not empty.
            quantiles = {f"p{q}": round(x, 1) for q in QUANTILES if (x := percentile(values, q)) is not None}
            stats[name] = quantiles | {"n": len(values)}
    ranked = sorted((r for r in timed if r.get("ttft_ms") is not None), key=lambda r: -r["ttft_ms"])
    return {
        "requests": len(records),
        "websocket": websocket_counts(records),
        "errors": len(errors),
        "client_aborted": sum(1 for r in records if r.get("client_aborted")),
        "errors_by_phase": dict(Counter(r.get("error_phase") or "unknown" for r in errors)),
        "reused_connections": sum(1 for r in records if r.get("reused_connection")),
        "verdicts": dict(Counter(r.get("verdict") for r in records).most_common()),
        "stats": stats,
        "slowest": [
            {k: r.get(k) for k in ("id", "ts", "ttft_ms", "verdict", "prompt_tokens", "status")}
            for r in ranked[:slowest]
        ],
        "wait_vs_prompt": fit_wait_vs_prompt(timed),
    }


def summarize(records: Iterable[Mapping[str, Any]], slowest: int = 5) -> dict[str, dict[str, Any]]:
    """Per "upstream · model" group, the group's summary."""
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for rec in records:
        groups[group_key(rec)].append(rec)
    return {key: summarize_group(groups[key], slowest) for key in sorted(groups)}


def format_text(report: Mapping[str, Mapping[str, Any]], websocket: Mapping[str, int] | None = None) -> str:
    """The report as text; `websocket`: `websocket_counts` over every group (a handshake
    names no model, so its group is not its turns' group)."""
    out = []
    if websocket:
        out += [f"WebSocket, all upstreams: {websocket['turns']} turns ({websocket['prewarm']} prewarm),"
                f" {websocket['handshakes']} handshakes ({websocket['failed_handshakes']} failed)", ""]
    for key, g in report.items():
        out.append(f"== {key}: {g['requests']} requests, {g['errors']} errors"
                   f" ({g['client_aborted']} client aborts), {g['reused_connections']} on reused connections")
        if ws := g.get("websocket"):
            out.append(f"   WebSocket: {ws['turns']} turns ({ws['prewarm']} prewarm), {ws['handshakes']} handshakes"
                       f" ({ws['failed_handshakes']} failed)")
        if g["errors_by_phase"]:
            out.append("   errors by phase: " + ", ".join(f"{k} {v}" for k, v in g["errors_by_phase"].items()))
        out.append(f"   {'ms':<22}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>7}")
        for name, s in g["stats"].items():
            out.append(f"   {name:<22}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}{s['n']:>7}")
        if fit := g["wait_vs_prompt"]:
            out.append(f"   upstream own wait ≈ {fit['base_ms']:.0f} ms + {fit['ms_per_1k_prompt_tokens']:.1f} ms"
                       f" per 1k prompt tokens (r² {fit['r2']:.2f}, n {fit['n']})")
        out.append("   verdicts: " + ", ".join(f"{k} {v}" for k, v in g["verdicts"].items()))
        if g["slowest"]:
            out.append("   slowest:")
            for r in g["slowest"]:
                when = datetime.fromtimestamp(r["ts"]).isoformat(timespec="seconds") if r.get("ts") else "?"
                out.append(f"     {r['ttft_ms']:>9.0f} ms  {when}  {r['id']}  → {r['verdict']}")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ttft-relay report", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+",
                    help="JSONL timing logs (relay_timing_log), or quoted glob patterns: 'logs/timing*.jsonl' "
                         "reads the single relay's log and every worker's (scripts/relay --workers N)")
    ap.add_argument("--since", type=parse_since, help="only requests since: 30m, 2h, 7d or an ISO time")
    ap.add_argument("--model", help="only requests for this model")
    ap.add_argument("--slowest", type=int, metavar="N", help="list the N slowest requests per group (default 5)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--html", type=Path, metavar="FILE",
                    help="also write the report as one self-contained HTML page: waterfalls of the --slowest "
                         "requests (10 if not given) and of any picked from its table, first token over time, "
                         "upstream wait vs prompt tokens, phase percentiles")
    args = ap.parse_args(argv)
    try:
        records, bad = read_records(expand_globs(args.logs), since=args.since, model=args.model)
    except OSError as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    if bad:
        print(f"report: skipped {bad} unreadable line(s)", file=sys.stderr)
    report = summarize(records, 5 if args.slowest is None else args.slowest)
    if args.html:
        from . import report_html  # the page's code is loaded only when asked for

        data = report_html.report_data(records, report, slowest=10 if args.slowest is None else args.slowest,
                                       title=f"ttft-relay report: {', '.join(Path(p).name for p in args.logs)}")
        try:
            args.html.write_text(report_html.page(data), encoding="utf8")
        except OSError as e:
            print(f"report: {e}", file=sys.stderr)
            return 1
        print(f"report: wrote {args.html} ({len(records)} records)", file=sys.stderr)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(format_text(report, websocket_counts(records)) if report else "no records")
    return 0
