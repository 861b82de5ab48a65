"""Summarise ttft-relay timing logs (JSONL, one record per request).

Grouped by upstream host and model: p50/p90/p99 of every phase and of ttft,
error counts, the slowest requests with their verdict, the first token as the relay
learns it (a median fit of the upstream's own wait against uncached and cached prompt
tokens, `ttft_relay/observe/prefill.py`: ms per 1k tokens plus a base), and the
requests that waited beyond what their prompt predicts (upstream queueing). Above the
groups, the requests clients sent again after a failure or a cut (`attempt_group`):
how long the user waited over how many attempts, and why each one ended; what the
relay learned and keeps in its store beside the logs (`learned.jsonl`: context windows,
trim plans, first-token lines, open attempt groups: how many, the newest when, from how
many access keys);
each context window learned from a provider's refusal: when, from which reply,
which access key's digest, and whether another key or an accepted request confirmed it;
and each upstream group (`relay_upstream_groups`): per member, how often it was chosen and
why, its own first tokens' percentiles, the failovers and hedges from it and the prompt
tokens they sent again, and its late heads waited for (no other member expected sooner).
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
import dataclasses
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

from .. import store
from ..observe import attempts, prefill, verdicts
from ..text import printable
from ..timing import phases, record
from ..trim import plans, windows

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
                if not isinstance(rec, dict):
                    bad += 1  # not a record: e.g. the store of what the relay learned, matched by 'logs/*.jsonl'
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
    return prefill.own_wait(rec)


def is_handshake(rec: Mapping[str, Any]) -> bool:
    """The record of a WebSocket's opening handshake (turn 0), not of a turn."""
    return record.is_handshake(rec.get("transport"), rec.get("turn"))


def is_prewarm(rec: Mapping[str, Any]) -> bool:
    """A Responses turn with `generate: false`: it asks for no token."""
    return bool(rec.get("prewarm"))


def counts_as_first_token(rec: Mapping[str, Any]) -> bool:
    """A request or WebSocket turn that waited for a first token."""
    return not is_handshake(rec) and not is_prewarm(rec)


def group_key(rec: Mapping[str, Any]) -> str:
    return printable(f"{rec.get('upstream')} · {rec.get('model') or '?'}")  # one line, whatever the model


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


FIT_POINTS = 2048
"""A group's first-token model is fitted to at most this many of its requests, spread over the log."""
OUTLIERS = 5


def first_token_model(records: Sequence[Mapping[str, Any]]) -> prefill.Fit | None:
    """The first token's time against the prompt's uncached and cached tokens, as the relay
    learns it (`prefill.fit`, a median fit), over the group's requests in the log but those
    the relay judged `upstream queueing` (listed apart, `queueing_outliers`: a log whose
    spikes all hit short prompts would lift the line there); None with fewer than
    `prefill.MIN_SAMPLES` of them."""
    samples = sorted(s for rec in records
                     if rec.get("verdict") != phases.UPSTREAM_QUEUEING and (s := prefill.sample_of(rec)) is not None)
    step = -(-len(samples) // FIT_POINTS) or 1
    return prefill.fit(samples[::step])


def queueing_outliers(records: Iterable[Mapping[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """How many requests waited beyond what their prompt predicts (`upstream queueing`), and
    the worst of them by how many times their expected first token."""
    queued = [r for r in records if r.get("verdict") == phases.UPSTREAM_QUEUEING and r.get("expected_ttft_ms")
              and r.get("ttft_ms") is not None]
    queued.sort(key=lambda r: -r["ttft_ms"] / r["expected_ttft_ms"])
    return len(queued), [{k: r.get(k) for k in ("id", "ts", "ttft_ms", "expected_ttft_ms", "verdict_detail")}
                         for r in queued[:OUTLIERS]]


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
        "first_token_model": (fit.as_dict() if (fit := first_token_model(timed)) is not None else None),
        "queueing": (outliers := queueing_outliers(timed))[0],
        "queueing_worst": outliers[1],
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
        if fit := g["first_token_model"]:
            out.append(f"   first token learned: {model_text(fit)}")
        if g["queueing"]:
            out.append(f"   {g['queueing']} requests beyond what their prompt predicts (upstream queueing), the worst:")
            for r in g["queueing_worst"]:
                out.append(f"     {r['ttft_ms']:>9.0f} ms  {r['ttft_ms'] / r['expected_ttft_ms']:4.1f}× the "
                           f"{r['expected_ttft_ms']:.0f} ms expected  {_when(r.get('ts'))}  {r['id']}")
        out.append("   verdicts: " + ", ".join(f"{k} {v}" for k, v in g["verdicts"].items()))
        if g["slowest"]:
            out.append("   slowest:")
            for r in g["slowest"]:
                out.append(f"     {r['ttft_ms']:>9.0f} ms  {_when(r.get('ts'))}  {r['id']}  → {r['verdict']}")
        out.append("")
    return "\n".join(out)


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).isoformat(timespec="seconds") if ts else "?"


def model_text(fit: Mapping[str, Any]) -> str:
    """A learned first-token model in words: its base, its rates, what it stands on."""
    parts = [f"{fit['base_ms']:.0f} ms"]
    for key, what in (("ms_per_1k_uncached", "uncached"), ("ms_per_1k_cached", "cached")):
        if fit[key] is not None:
            parts.append(f"{fit[key]:.1f} ms per 1k {what} tokens")
    alike = "" if fit["ms_per_1k_uncached"] is not None else "; prompt sizes too alike for a rate"
    return f"{' + '.join(parts)} (median fit of {fit['n']} requests, spread {fit['spread_ms']:.0f} ms{alike})"


# --- upstream groups -----------------------------------------------------------------------


def upstream_groups(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per upstream group (the records with `route`, `ttft_relay/route/`), its requests, those
    failed over, those hedged, and the prompt tokens their abandoned or losing attempts cost
    (sent again: duplicated); per member, in the group's order: the requests sent to it first
    (`chosen`) and why (`reasons`), those that ended on it (`served`), its own first tokens'
    percentiles (successful answers with no failover or winning hedge before them: their wait
    holds the other attempt's), the failovers from it by cause and the hedges of its late heads
    by whose head came first (`hedges`: first, second), with their prompt tokens, and its late
    heads waited for, no other member expected sooner (`waited`: by what was not done,
    `record.WAITED_INSTEAD_OF`: hedge, slow_head; the group's `waited` counts them all)."""
    groups: dict[str, dict[str, Any]] = {}

    def member(group: dict[str, Any], name: Any) -> dict[str, Any]:
        return group["members"].setdefault(str(name), {
            "chosen": 0, "reasons": Counter(), "served": 0, "ttft": [], "failovers": Counter(), "hedges": Counter(),
            "waited": Counter(), "duplicated_prompt_tokens": 0})

    for rec in records:
        if not isinstance(route := rec.get("route"), dict):
            continue
        group = groups.setdefault(printable(str(route.get("group") or "?")), {
            "requests": 0, "failed_over": 0, "hedged": 0, "waited": 0, "duplicated_prompt_tokens": 0, "members": {}})
        for name in route.get("expected_ms") or ():  # every member, in the group's order
            member(group, name)
        failed = route.get("failed_over") or []
        hedged = route.get("hedged") or {}
        first = member(group, failed[0].get("upstream") if failed else hedged.get("from") or route.get("upstream"))
        first["chosen"] += 1
        first["reasons"][route.get("reason") or "?"] += 1
        served = member(group, route.get("upstream"))
        served["served"] += 1
        group["requests"] += 1
        prompt = prompt_tokens(rec) or 0
        for attempt in failed:
            left = member(group, attempt.get("upstream"))
            left["failovers"][attempt.get("cause") or "?"] += 1
            left["duplicated_prompt_tokens"] += prompt
            group["duplicated_prompt_tokens"] += prompt
        group["failed_over"] += bool(failed)
        if hedged.get("won"):
            late = member(group, hedged.get("from"))
            late["hedges"]["second" if hedged["won"] == hedged.get("upstream") else "first"] += 1
            late["duplicated_prompt_tokens"] += prompt
            group["duplicated_prompt_tokens"] += prompt
            group["hedged"] += 1
        for field, instead_of in record.WAITED_INSTEAD_OF.items():
            if route.get(field):  # the late head is the first chosen member's (the bound is only its)
                first["waited"][instead_of] += 1
                group["waited"] += 1
        if (not phases.waited_for_another(route) and counts_as_first_token(rec) and (ttft := rec.get("ttft_ms")) is not None
                and not rec.get("error") and not rec.get("client_aborted")):
            served["ttft"].append(ttft)
    for group in groups.values():
        for m in group["members"].values():
            ttfts = m.pop("ttft")
            m["ttft"] = ({f"p{q}": round(x, 1) for q in QUANTILES if (x := percentile(ttfts, q)) is not None}
                         | {"n": len(ttfts)}) if ttfts else None
            m["reasons"] = dict(m["reasons"].most_common())
            m["failovers"] = dict(m["failovers"].most_common())
            m["hedges"] = dict(m["hedges"].most_common())
            m["waited"] = dict(m["waited"].most_common())
    return groups


def format_upstream_groups(groups: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = []
    for name, g in groups.items():
        hedged = f", {g['hedged']} hedged" if g["hedged"] else ""
        waited = f", {g['waited']} late heads waited for (no member expected sooner)" if g["waited"] else ""
        out += [f"Upstream group {name}: {g['requests']} requests, {g['failed_over']} failed over before the head"
                f"{hedged}{waited} ({g['duplicated_prompt_tokens']} prompt tokens sent again)",
                f"   {'member':<24}{'chosen':>8}{'served':>8}{'ttft p50':>10}{'p90':>8}{'p99':>8}{'n':>6}"
                f"{'tokens again':>14}  failed over, hedged, waited; chosen why"]
        for member, m in g["members"].items():
            ttft = m["ttft"] or {}
            quantiles = "".join(f"{ttft[q]:>{w}.0f}" if q in ttft else f"{'–':>{w}}"
                                for q, w in (("p50", 10), ("p90", 8), ("p99", 8)))
            failovers = ", ".join([*(f"{cause} {n}" for cause, n in m["failovers"].items()),
                                   *(f"hedged {n} ({won} head first)" for won, n in m["hedges"].items()),
                                   *(f"waited {n} (no {what})" for what, n in m["waited"].items())]) or "none"
            reasons = ", ".join(f"{reason} {n}" for reason, n in m["reasons"].items()) or "–"
            out.append(f"   {printable(member):<24}{m['chosen']:>8}{m['served']:>8}{quantiles}{ttft.get('n', 0):>6}"
                       f"{m['duplicated_prompt_tokens']:>14}  {failovers}; {reasons}")
        out.append("")
    return out


# --- attempt groups ------------------------------------------------------------------------


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s" if ms < 120_000 else f"{ms / 60_000:.1f} min"


def attempt_ended(rec: Mapping[str, Any]) -> str:
    """Why an attempt ended, in a few words."""
    marks, p = rec.get("marks") or {}, rec.get("phases") or {}
    took = _duration(p.get("total", marks.get("end", 0.0)))
    where = phases.PHASE_WORDS.get(rec.get("error_phase") or "", rec.get("error_phase") or "?")
    unanswered = " while the upstream had not answered" if "response_head" not in marks else ""
    if rec.get("client_aborted"):
        return f"cut by the client after {took} in {where}{unanswered}"
    if rec.get("error"):
        return printable(f"{rec['error']} after {took} in {where}{unanswered}")
    ttft = rec.get("ttft_ms")
    return f"{rec.get('verdict')}, first token after {_duration(ttft)}" if ttft is not None else f"{rec.get('verdict')}"


def attempt_groups(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The requests a client sent more than once (`attempt_group`), oldest first: how long the
    user waited from the first attempt to the last one's first token (or end), and why each
    attempt ended."""
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for rec in records:
        if (g := rec.get("attempt_group")) is not None:
            groups[g].append(rec)
    out = []
    for g, recs in groups.items():
        if len(recs) < 2:
            continue
        recs = sorted(recs, key=lambda r: (r.get("attempt") or 0, r.get("ts") or 0))
        last, p = recs[-1], recs[-1].get("phases") or {}
        ended = (last.get("ts") or 0) + (last.get("ttft_ms") or p.get("total") or 0.0) / 1000
        out.append({
            "group": g,
            "ts": recs[0].get("ts"),
            "attempts": len(recs),
            "waited_ms": round((ended - (recs[0].get("ts") or 0)) * 1000, 1),
            "succeeded": not (last.get("error") or last.get("client_aborted")),
            "ended": [attempt_ended(r) for r in recs],
            "ids": [r.get("id") for r in recs],
        })
    return sorted(out, key=lambda a: a["ts"] or 0)


def format_attempts(groups: Sequence[Mapping[str, Any]], shown: int = 10) -> list[str]:
    if not groups:
        return []
    out = [f"Retried requests: {len(groups)} sent again after failing or being cut (the worst {min(shown, len(groups))}):"]
    for a in sorted(groups, key=lambda a: -a["waited_ms"])[:shown]:
        out.append(f"   {_when(a['ts'])}  {a['group']}: waited {_duration(a['waited_ms'])} over {a['attempts']} "
                   f"attempts{'' if a['succeeded'] else ', none answered'}")
        out += [f"     {i}. {why}" for i, why in enumerate(a["ended"], 1)]
    return [*out, ""]


def learned_windows(logs: Iterable[str]) -> list[dict[str, Any]]:
    """The windows learned by the relays writing `logs` (the file beside each log's directory)."""
    found: dict[tuple[str, str], windows.Learned] = {}
    for path in sorted({Path(log).with_name(store.FILE_NAME) for log in logs}):
        found |= {(e.upstream, e.model): e for e in windows.learned_in(path)}
    return [dataclasses.asdict(e) for e in found.values()]


STORED_KINDS = {windows.KIND_NAME: "context windows", plans.KIND_NAME: "trim plans (conversations' cuts)",
                verdicts.KIND_NAME: "first-token lines",
                attempts.KIND_NAME: "open attempt groups (failed requests a retry may still join)"}


def learned_store(logs: Iterable[str]) -> dict[str, Any]:
    """What the store beside the logs holds (`ttft_relay.store`), per kind: how many entries,
    when the newest was learned, from how many access keys; and each first-token line."""
    held: dict[str, dict[str, store.Entry]] = {kind: {} for kind in STORED_KINDS}
    for path in sorted({Path(log).with_name(store.FILE_NAME) for log in logs}):
        shared = store.SharedStore(path, [windows.KIND, plans.KIND, verdicts.KIND, attempts.KIND], read_only=True)
        shared.refresh()
        for kind in STORED_KINDS:
            held[kind] |= {entry.key: entry for entry in shared.entries.entries(kind)}
    out: dict[str, Any] = {}
    for kind, entries in held.items():
        if not entries:
            continue
        out[kind] = {"entries": len(entries), "newest": max(e.ts for e in entries.values()),
                     "access_keys": len({e.by for e in entries.values() if e.by})}
    if lines := held[verdicts.KIND_NAME]:
        out[verdicts.KIND_NAME]["lines"] = [
            {"line": e.key, "samples": len(e.value["samples"]), "sources": len({s[4] for s in e.value["samples"]}),
             "newest": e.ts} for e in sorted(lines.values(), key=lambda e: e.key)]
    return out


def format_store(held: Mapping[str, Any]) -> list[str]:
    if not held:
        return []
    out = [f"What the relay learned ({store.FILE_NAME} beside the log):"]
    for kind, what in held.items():
        keys = f", from {what['access_keys']} access key(s)" if what["access_keys"] else ""
        out.append(f"   {STORED_KINDS[kind]}: {what['entries']}, the newest learned {_when(what['newest'])}{keys}")
        for line in what.get("lines", ()):
            out.append(f"     {printable(line['line'])}: {line['samples']} samples from {line['sources']} "
                       f"source(s), the newest {_when(line['newest'])}")
    return [*out, ""]


def format_learned(learned: Sequence[Mapping[str, Any]]) -> list[str]:
    if not learned:
        return []
    out = ["Context windows learned from the providers' refusals (the operator's relay_context_windows wins):"]
    for e in sorted(learned, key=lambda e: (e["upstream"], e["model"])):
        limit = f"at most {e['max_input']} prompt tokens" if e["max_input"] else f"a window of {e['window']} tokens"
        confirmed = e["confirmed"]
        by = ("by an accepted request the window before would have cut" if confirmed == windows.ACCEPTED
              else f"by key {confirmed}'s refusal")
        used = f"confirmed {_when(e['confirmed_ts'])} {by}" if confirmed else "used for that key only until confirmed"
        out.append(f"   {printable(e['upstream'])} {printable(e['model'])}: {limit} (ratio {e['ratio']}), learned "
                   f"{_when(e['ts'])} from a {e['status']} {printable(e['error'])} to key {e['key'] or '(none)'}; "
                   f"{used}")
    return [*out, ""]


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
    retried = attempt_groups(records)
    routed = upstream_groups(records)
    learned = learned_windows(expand_globs(args.logs))
    held = learned_store(expand_globs(args.logs))
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report | ({"attempt_groups": retried} if retried else {})
                                             | ({"upstream_groups": routed} if routed else {})
                                             | ({"learned_windows": learned} if learned else {})
                                             | ({"learned": held} if held else {}),
                                             option=orjson.OPT_INDENT_2) + b"\n")
    else:
        # The requests first (an upstream group's members, then each upstream · model); what
        # the relay learned and the retries after them. Each part ends with a blank line.
        parts = format_upstream_groups(routed) + [format_text(report, websocket_counts(records)), ""]
        parts += format_store(held) + format_learned(learned) + format_attempts(retried)
        print("\n".join(parts[:-1]) if report else "no records")
    return 0
