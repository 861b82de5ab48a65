"""Timing records shaped like a relay's day of traffic, for the report's tests and benchmark.

Built with the relay's own `record.build_record`, so they carry exactly the fields
and phases a real log does: three upstream · model groups, prompt sizes from tiny
to long with a wait that grows with them, an evening peak that slows the upstream,
some reused connections, stalls, errors, client aborts, and WebSocket turns
(prewarm among them) with their handshakes, one of which fails.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from ttft_relay.timing import record

DAY_START = 1_780_000_000.0
GROUPS = (
    ("api.openai.com", "gpt-4o-mini", 180.0, 0.08),  # upstream, model, base wait ms, ms per prompt token
    ("api.anthropic.com", "claude-sonnet-4", 420.0, 0.05),
    ("api.openai.com", "gpt-5", 650.0, 0.12),
)


LEARNING = 8
"""A relay's first requests to each upstream · model, judged while it learns their line (`ok`
unless far out of line); the day's later ones against nothing learned (these samples carry no
learned line), the model's wait then named as such."""


def one(rng: random.Random, i: int, ts: float, *, peak: float) -> dict[str, Any]:
    upstream, model, base, per_token = GROUPS[i % len(GROUPS)]
    prompt = int(rng.lognormvariate(7.5, 1.2))
    new_connection = rng.random() < 0.15
    rtt = 30.0
    m = {"request_body": rng.uniform(0.5, 4), "forwarded": 0.0}
    m["forwarded"] = m["request_body"] + rng.uniform(0.3, 2)
    at = m["forwarded"]
    if new_connection:
        m["upstream_connect_start"] = at + 0.2
        m["upstream_tcp"] = at + 0.2 + rtt
        m["upstream_tls"] = at + 0.2 + 2 * rtt
        at = m["upstream_tls"]
    wait = (base + per_token * prompt) * peak * rng.lognormvariate(0, 0.25) + rtt
    m["response_head"] = at + wait
    m["first_byte"] = m["response_head"] + rng.uniform(0, 3)
    m["first_event"] = m["first_byte"]
    m["first_token"] = m["first_byte"] + rng.uniform(5, 60)
    stream_ms = rng.uniform(300, 6000)
    m["last_token"] = m["first_token"] + stream_ms
    m["end"] = m["last_token"] + rng.uniform(1, 10)
    max_gap = rng.uniform(20, 120) if rng.random() > 0.02 else rng.uniform(2000, 6000)
    error = client_aborted = None
    roll = rng.random()
    if roll < 0.01:
        error = "HTTP 529"
        m = {k: m[k] for k in ("request_body", "forwarded", "response_head")} | {"end": m["response_head"] + 2}
    elif roll < 0.015:
        client_aborted = True
        m = {k: v for k, v in m.items() if k not in ("last_token", "end")} | {"end": m["first_token"] + 500}
    extra = {}
    if model == "gpt-5" and rng.random() < 0.3:
        extra = {"transport": "websocket", "turn": 1 + i % 7, "prewarm": rng.random() < 0.1}
    flow_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))  # as long as mitmproxy's flow ids
    return build(flow_id, ts, upstream, model, m, prompt=prompt, rtt=rtt, max_gap=max_gap,
                 new_connection=new_connection, error=error, client_aborted=bool(client_aborted),
                 learning=i < LEARNING * len(GROUPS)) | extra


def build(id: str, ts: float, upstream: str, model: str | None, marks: dict[str, float], *, prompt: int | None = None,
          rtt: float | None = None, max_gap: float | None = None, new_connection: bool = False,
          error: str | None = None, client_aborted: bool = False, learning: bool = False) -> dict[str, Any]:
    tokens = "first_token" in marks or not error
    return record.build_record(record.RecordInput(
        id=id, ts=ts, api="openai.chat", model=model, stream=True, status=None if error else 200,
        upstream=upstream, marks={k: round(v, 3) for k, v in marks.items()}, tokens_expected=tokens,
        tls_expected=True, reused_connection=not new_connection, rtt_ms=rtt, max_gap_ms=max_gap,
        chunks=120 if "last_token" in marks else None, bytes=9000, token_events=100, prompt_tokens=prompt,
        usage={"input_tokens": prompt, "output_tokens": 100} if prompt else None,
        error=error, client_aborted=client_aborted,
    ), record.Learned(learning=learning)).as_dict()


def handshake(id: str, ts: float, *, failed: bool) -> dict[str, Any]:
    marks = {"request_body": 0.2, "forwarded": 0.5, "upstream_connect_start": 0.6, "upstream_tcp": 30.0,
             "upstream_tls": 61.0}
    if failed:
        marks["end"] = 15061.0
    else:
        marks |= {"response_head": 95.0, "end": 95.0}
    rec = build(id, ts, "api.openai.com", "gpt-5", marks, new_connection=True,
                error="websocket handshake timed out after 15 s" if failed else None)
    return rec | {"transport": "websocket", "turn": 0, "prewarm": False,
                  "verdict": "websocket handshake failed" if failed else rec["verdict"]}


def day(n: int, seed: int = 7) -> list[dict[str, Any]]:
    """`n` records spread over 24 h, slower from 18:00 to 22:00 (the "evening peak")."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts = DAY_START + 86400 * i / n
        hour = (ts % 86400) / 3600
        out.append(one(rng, i, ts, peak=2.5 if 18 <= hour < 22 else 1.0))
    out.append(handshake("hs-ok", DAY_START + 3600, failed=False))
    out.append(handshake("hs-failed", DAY_START + 7200, failed=True))
    return out
