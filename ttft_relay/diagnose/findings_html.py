"""`ttft-relay diagnose --html`: the probes and the relay's records of them as the report's
waterfalls (`report/report_html.py` draws the page; this makes its rows, pure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..report.report_html import TICK_MARKS, columns
from ..timing import phases
from . import findings as findings_module


def probe_rows(evidence, probe_phases: Sequence[str]) -> list[dict[str, Any]]:
    """Each probe as a record-like row (its own phases, marks from its start), each followed
    by the relay's record of it, shifted to start when the probe's request was sent."""
    rows: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    kinds = {kind: i for i, kind in enumerate(dict.fromkeys(p.kind for p in evidence.probes))}
    for p in sorted(evidence.probes, key=lambda p: kinds[p.kind]):  # stable: each kind's tries in order
        seen[p.kind] = seen.get(p.kind, 0) + 1
        ph = p.phases()
        marks = {"end": p.marks["end"]} | ({"first_token": p.marks["first_token"]} if "first_token" in p.marks else {})
        if "first_token" in p.marks and "end" in p.marks:
            ph["stream"] = max(0.0, p.marks["end"] - p.marks["first_token"])
        transport = " (WebSocket)" if p.transport == "websocket" else ""
        rows.append({
            "id": f"{p.kind} #{seen[p.kind]}{transport}", "ts": 0, "upstream": p.path, "model": p.prompt,
            "phases": {k: v for k, v in ph.items() if k in probe_phases or k == "stream"}, "marks": marks,
            "ttft_ms": p.marks.get("first_token"), "status": p.status, "prompt_tokens": p.prompt_tokens,
            "verdict": "ok" if p.ok else f"error in {p.error_phase}", "error": p.error, "error_phase": p.error_phase,
        })
        rec = evidence.records.get(p.request_id)
        if rec and "sent" in p.marks:
            shift = p.marks["sent"]
            rows.append({
                "id": "  ↳ the relay's record of it", "ts": 0, "upstream": p.path, "model": p.prompt,
                "phases": rec.get("phases") or {}, "marks": {k: v + shift for k, v in (rec.get("marks") or {}).items()},
                "ttft_ms": rec.get("ttft_ms"), "status": rec.get("status"), "prompt_tokens": rec.get("prompt_tokens"),
                "verdict": rec.get("verdict"), "error": rec.get("error"), "error_phase": rec.get("error_phase"),
            })
    return rows


def diagnose_data(evidence, diagnosis) -> dict[str, Any]:
    """What `ttft-relay diagnose --html` shows: its findings and every probe's waterfall."""
    probe_phases = [name for name, _ in findings_module.PROBE_STEPS]
    # One order that keeps both kinds of row in timeline order: the probe's steps up to its
    # first token run where the relay's record has its upstream wait; both end alike.
    crit, wait = list(phases.CRITICAL_PHASES), phases.CRITICAL_PHASES.index("upstream_wait")
    bar_phases = [*crit[:wait], *probe_phases[:-1], *crit[wait:], "stream"]
    assert probe_phases[-1] == "head_to_first_token" in crit[wait:]
    rows = probe_rows(evidence, probe_phases)
    verdict = diagnosis.verdict
    return columns(rows, 0.0, bar_phases) | {
        "title": "ttft-relay diagnosis",
        "kind": "diagnose",
        "t0": 0,
        "phases": bar_phases,
        "marks": list(TICK_MARKS),
        "verdict": None if verdict is None else f"verdict: {verdict.cause}" + ("" if verdict.fatal else f" ({verdict.ms:.0f} ms)"),
        "advice": verdict.advice if verdict else None,
        "findings": [f.as_dict() for f in diagnosis.findings],
    }

