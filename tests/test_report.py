"""ttft-relay report: reading logs, percentiles, grouping, the prompt-size fit."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from ttft_relay import store
from ttft_relay.observe import attempts, prefill, verdicts
from ttft_relay.timing import record
from ttft_relay.trim import plans, policy, windows
from ttft_relay.report import summary

REPO = Path(__file__).resolve().parent.parent


def rec(i: int, *, model="gpt-x", upstream="api.example.com", prompt=1000, wait=None, error=None, ts=1000.0,
        route=None):
    wait = 100 + 0.5 * prompt if wait is None else wait  # 100 ms base + 500 ms per 1k tokens
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 2.0 + wait, "first_byte": 2.0 + wait,
             "first_token": 2.0 + wait, "last_token": 50.0 + wait, "end": 51.0 + wait}
    if error:
        marks = {"request_body": 1.0, "forwarded": 2.0, "end": 9.0}
    return record.build_record(record.RecordInput(
        id=f"f{i}", ts=ts + i, api="openai.chat", model=model, stream=True, status=None if error else 200,
        upstream=upstream, marks=marks, tokens_expected=True, tls_expected=True, reused_connection=True,
        rtt_ms=None, prompt_tokens=prompt, error=error, route=route,
    )).as_dict()


def write_log(path: Path, records) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def test_percentile_interpolates():
    assert summary.percentile([], 50) is None
    assert summary.percentile([5.0], 99) == 5.0
    assert summary.percentile([1, 2, 3, 4], 50) == 2.5
    assert summary.percentile(list(range(101)), 90) == 90


def test_the_first_token_model_is_the_relays_median_fit():
    prompts = [500, 1000, 4000, 8000, 16000, 2000, 12000, 6000, 3000, 10000]
    fit = summary.first_token_model([rec(i, prompt=p) for i, p in enumerate(prompts)])
    assert fit.per_1k_uncached == pytest.approx(500.0, rel=0.001)
    assert fit.base_ms == pytest.approx(100.0, abs=1)
    # A queue spike on a few requests moves a median fit no more than any point above the line.
    spiked = [rec(i, prompt=p, wait=100 + 0.5 * p + (1500 if i % 4 == 0 else 0)) for i, p in enumerate(prompts)]
    assert summary.first_token_model(spiked).per_1k_uncached == pytest.approx(500.0, rel=0.05)


def test_the_model_needs_enough_requests_and_spread():
    assert summary.first_token_model([rec(i, prompt=1000) for i in range(7)]) is None
    alike = summary.first_token_model([rec(i, prompt=1000) for i in range(10)])
    assert alike.per_1k_uncached is None and alike.base_ms == pytest.approx(600.0)
    assert "prompt sizes too alike for a rate" in summary.model_text(alike.as_dict())


def test_the_model_takes_the_round_trip_out():
    far = [r | {"rtt_ms": 300.0} for r in (rec(i, prompt=p, wait=300 + 0.5 * p)
                                          for i, p in enumerate(range(1000, 11000, 1000)))]
    assert summary.first_token_model(far).base_ms == pytest.approx(0.0, abs=1)


def test_queueing_outliers_are_listed_worst_first():
    records = [rec(i) | {"verdict": "upstream queueing", "expected_ttft_ms": 300.0, "ttft_ms": 600.0 + 100 * i}
               for i in range(8)] + [rec(9)]
    n, worst = summary.queueing_outliers(records)
    assert n == 8 and [w["id"] for w in worst] == ["f7", "f6", "f5", "f4", "f3"]
    text = summary.format_text({"k": summary.summarize_group(records)})
    assert "8 requests beyond what their prompt predicts (upstream queueing), the worst:" in text
    assert "4.3× the 300 ms expected" in text


def attempt(i: int, group: str, n: int, ts: float, *, cut: bool, total: float = 60_000.0) -> dict:
    marks = {"request_body": 1.0, "forwarded": 2.0, "end": total}
    if not cut:
        marks |= {"response_head": total - 500, "first_byte": total - 499, "first_token": total - 400}
    r = record.build_record(record.RecordInput(id=f"a{i}", ts=ts, api="openai.chat", model="m", stream=True,
                                               status=None if cut else 200, upstream="u", marks=marks, tokens_expected=True,
                                               tls_expected=False, reused_connection=True, rtt_ms=None, client_aborted=cut,
                                               error="Client disconnected." if cut else None))
    return r.as_dict() | {"attempt_group": group, "attempt": n}


def test_attempt_groups_say_how_long_the_user_waited_and_why_each_attempt_ended():
    records = [attempt(1, "a1", 1, 1000.0, cut=True), attempt(2, "a1", 2, 1060.2, cut=True),
               attempt(3, "a1", 3, 1120.4, cut=False, total=4000.0), attempt(4, "a4", 1, 2000.0, cut=True),
               rec(9)]
    (group,) = summary.attempt_groups(records)  # a4 was never retried: not a group of attempts
    assert group["attempts"] == 3 and group["ids"] == ["a1", "a2", "a3"] and group["succeeded"]
    assert group["waited_ms"] == pytest.approx((1120.4 - 1000.0) * 1000 + 3600, abs=1)
    assert group["ended"][0] == "cut by the client after 60.0 s in upstream wait while the upstream had not answered"
    assert group["ended"][2].endswith(", first token after 3600 ms")
    text = "\n".join(summary.format_attempts([group]))
    assert "a1: waited 2.1 min over 3 attempts" in text and "  3. " in text
def test_read_filters_and_skips_broken_lines(tmp_path):
    log = write_log(tmp_path / "a.jsonl", [rec(0, ts=100), rec(1, ts=200, model="other")])
    with open(log, "ab") as f:
        f.write(b'{"cut short\n')
        f.write(b'["window","k",1.0,"","",1]\n')  # a line of the store beside the log ('logs/*.jsonl')
    records, bad = summary.read_records([log])
    assert len(records) == 2 and bad == 2
    assert [r["id"] for r in summary.read_records([log], since=150)[0]] == ["f1"]
    assert [r["id"] for r in summary.read_records([log], model="gpt-x")[0]] == ["f0"]


def test_since_accepts_durations_and_iso():
    assert summary.parse_since("2h", now=10_000) == 10_000 - 7200
    assert summary.parse_since("2024-01-01T00:00:00+00:00") == 1704067200
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        summary.parse_since("yesterday")


def test_summary_groups_by_upstream_and_model():
    records = [rec(i) for i in range(10)] + [rec(10, error="connection refused"), rec(11, upstream="b.example", model="m")]
    out = summary.summarize(records, slowest=3)
    assert list(out) == ["api.example.com · gpt-x", "b.example · m"]
    g = out["api.example.com · gpt-x"]
    assert g["requests"] == 11 and g["errors"] == 1
    assert g["errors_by_phase"] == {"upstream_wait": 1}
    assert g["stats"]["ttft"]["p50"] == pytest.approx(602.0)
    assert len(g["slowest"]) == 3 and g["slowest"][0]["verdict"] == "upstream wait (prefill/queue)"


def test_cli_text_and_json(tmp_path):
    log = write_log(tmp_path / "t.jsonl", [rec(i, prompt=500 * (i + 1)) for i in range(10)])
    command = [sys.executable, "-m", "ttft_relay", "report"]
    text = subprocess.run([*command, log], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "api.example.com · gpt-x: 10 requests" in text
    assert "first token learned: 100 ms + 500.0 ms per 1k uncached tokens (median fit of 10 requests" in text
    js = subprocess.run([*command, log, "--json"], capture_output=True, check=True, cwd=REPO).stdout
    assert orjson.loads(js)["api.example.com · gpt-x"]["requests"] == 10


def test_what_the_store_beside_the_log_holds_is_said(tmp_path):
    log = write_log(tmp_path / "t.jsonl", [rec(i, prompt=500 * (i + 1)) for i in range(10)])
    windows.LearnedWindows(tmp_path / store.FILE_NAME).keep(windows.Learned(
        "api.anthropic.com", "acme-coder-2", 60_000, None, 1.0, 1_700_000_000.0, 400, "invalid_request_error", "ab12"))
    kept = plans.KeptPlans(tmp_path / store.FILE_NAME)
    for n, by in enumerate(("ab12", "cd34", "cd34")):
        kept.by = by
        kept.put(bytes([n]) * 16, policy.Plan(((0, 1),), 2, bytes(16)))
    kept.save()
    line = prefill.Line("api.example.com")
    for t in range(3):
        line.add((1_700_000_000.0 + t, 1000, 0, 300.0, f"source-{t % 2}"))
    shared = store.SharedStore(tmp_path / store.FILE_NAME, [verdicts.KIND, attempts.KIND])
    shared.entries.put(store.Entry(verdicts.KIND_NAME, "api.example.com · gpt-x", prefill.line_value(line),
                                   1_700_000_002.0))
    now = time.time()
    for n in range(2):  # a failed request each, waiting on a retry
        failed = attempts.Attempt(bytes([n]) * 16, f"r{n}", 1, now - 5, now - 4, True)
        shared.entries.put(attempts.entry(failed, "ab12"))
    shared.sync()
    command = [sys.executable, "-m", "ttft_relay", "report"]
    text = subprocess.run([*command, log], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "What the relay learned (learned.jsonl beside the log):" in text
    assert "   context windows: 1, the newest learned 2023-11-14T" in text and "from 1 access key(s)" in text
    assert "   trim plans (conversations' cuts): 3, the newest learned " in text and "from 2 access key(s)" in text
    assert "     api.example.com · gpt-x: 3 samples from 2 source(s), the newest 2023-11-14T" in text
    assert "   open attempt groups (failed requests a retry may still join): 2, the newest learned " in text
    assert "from a 400 invalid_request_error to key ab12" in text
    held = orjson.loads(subprocess.run([*command, log, "--json"], capture_output=True, check=True, cwd=REPO).stdout)
    assert {kind: what["entries"] for kind, what in held["learned"].items()} == {
        "window": 1, "plan": 3, "first-token": 1, "attempt": 2}


def test_websocket_turns_and_failed_handshakes_are_counted_apart():
    turns = [rec(i, prompt=1000 * (i + 1)) | {"transport": "websocket", "turn": i + 1, "prewarm": False} for i in range(4)]
    prewarm = rec(9, wait=50_000) | {"transport": "websocket", "turn": 5, "prewarm": True}
    handshakes = [rec(10) | {"transport": "websocket", "turn": 0},
                  rec(11, error="websocket handshake timed out") | {"transport": "websocket", "turn": 0,
                                                                     "verdict": "websocket handshake failed"}]
    http_requests = [rec(20 + i) | {"transport": "http", "turn": None} for i in range(3)]
    g = summary.summarize(turns + [prewarm] + handshakes + http_requests)["api.example.com · gpt-x"]
    assert g["requests"] == 10
    assert g["websocket"] == {"turns": 5, "prewarm": 1, "handshakes": 2, "failed_handshakes": 1}
    assert g["stats"]["ttft"]["n"] == 7  # neither the prewarm turn nor the handshakes wait for a token
    assert all(s["id"] not in ("f9", "f10", "f11") for s in g["slowest"])
    assert g["verdicts"]["websocket handshake failed"] == 1
    text = summary.format_text({"k": g})
    assert "WebSocket: 5 turns (1 prewarm), 2 handshakes (1 failed)" in text
    assert summary.summarize(http_requests)["api.example.com · gpt-x"]["websocket"] is None
    everything = turns + [prewarm] + handshakes + http_requests
    assert summary.format_text({}, summary.websocket_counts(everything)).startswith(
        "WebSocket, all upstreams: 5 turns (1 prewarm), 2 handshakes (1 failed)")


def routed(i: int, member: str, reason: str, *failed: tuple[str, str], **kw):
    """A record of group api.example.com (members api.example.com, b), served by `member`
    after the failovers `failed` ((member, cause) each)."""
    route = {"group": "api.example.com", "upstream": member, "why": "…", "reason": reason,
             "expected_ms": {"api.example.com": 300.0, "b": None}}
    if failed:
        route["failed_over"] = [{"upstream": m, "error": "…", "cause": cause, "after_ms": 50.0} for m, cause in failed]
    upstream = "api.example.com" if member == "api.example.com" else "b.example"
    return rec(i, upstream=upstream, route=route, **kw)


def test_upstream_groups_say_per_member_what_was_chosen_why_its_first_tokens_and_its_failovers_cost(capsys,
                                                                                                   tmp_path):
    records = [routed(i, "api.example.com", "lowest", prompt=1000 * (i + 1)) for i in range(3)]  # ttft 602, 1102, 1602
    records += [routed(3, "b", "exploring", prompt=1000),
                routed(4, "b", "sticky", ("api.example.com", "5xx"), prompt=2000),
                routed(5, "b", "lowest", error="connection refused"),
                rec(6)]  # another listener's: no group
    (name, group), = summary.upstream_groups(records).items()
    assert name == "api.example.com"
    assert (group["requests"], group["failed_over"], group["duplicated_prompt_tokens"]) == (6, 1, 2000)
    own, b = group["members"]["api.example.com"], group["members"]["b"]
    assert list(group["members"]) == ["api.example.com", "b"]
    assert (own["chosen"], own["served"], own["reasons"]) == (4, 3, {"lowest": 3, "sticky": 1})
    assert own["failovers"] == {"5xx": 1} and own["duplicated_prompt_tokens"] == 2000
    assert own["ttft"] == {"p50": 1102.0, "p90": 1502.0, "p99": 1592.0, "n": 3}
    # b's own first tokens: not the failed-over one (it holds the 503's wait), not the failure.
    assert (b["chosen"], b["served"], b["reasons"]) == (2, 3, {"exploring": 1, "lowest": 1})
    assert b["ttft"] == {"p50": 602.0, "p90": 602.0, "p99": 602.0, "n": 1} and b["failovers"] == {}

    assert summary.main([str(write_log(tmp_path / "t.jsonl", records))]) == 0
    text = capsys.readouterr().out
    assert "Upstream group api.example.com: 6 requests, 1 failed over before the head (2000 prompt tokens sent again)" in text
    assert "5xx 1; lowest 3, sticky 1" in text and "none; exploring 1, lowest 1" in text


def test_upstream_groups_count_the_hedges_of_a_members_late_heads_and_their_prompts(capsys, tmp_path):
    second_won = routed(0, "b", "lowest", prompt=1000)
    second_won["route"]["hedged"] = {"from": "api.example.com", "upstream": "b", "after_ms": 300.0, "won": "b"}
    first_won = routed(1, "api.example.com", "lowest", prompt=500)
    first_won["route"]["hedged"] = {"from": "api.example.com", "upstream": "b", "after_ms": 300.0,
                                    "won": "api.example.com"}
    (group,) = summary.upstream_groups([second_won, first_won]).values()
    assert (group["requests"], group["hedged"], group["failed_over"], group["duplicated_prompt_tokens"]) == (2, 2, 0, 1500)
    own, b = group["members"]["api.example.com"], group["members"]["b"]
    assert own["chosen"] == 2 and own["hedges"] == {"second": 1, "first": 1} and own["duplicated_prompt_tokens"] == 1500
    assert own["ttft"]["n"] == 1 and b["ttft"] is None  # b's answer waited for a's bound first
    assert summary.main([str(write_log(tmp_path / "t.jsonl", [second_won, first_won]))]) == 0
    text = capsys.readouterr().out
    assert "2 requests, 0 failed over before the head, 2 hedged (1500 prompt tokens sent again)" in text
    assert "hedged 1 (second head first), hedged 1 (first head first)" in text


def test_upstream_groups_count_a_members_late_heads_waited_for_by_what_was_not_done(capsys, tmp_path):
    """No other member expected sooner than the late one's remaining wait: no hedge, no give-up at its slow head."""
    records = [routed(i, "api.example.com", "lowest", prompt=1000) for i in range(3)]
    records[0]["route"]["not_hedged"] = records[1]["route"]["not_given_up"] = "b expected 1.6 s, api.example.com 0.3 s more"
    records[2]["route"]["not_given_up"] = "b expected 1.6 s, api.example.com 0.4 s more"
    (group,) = summary.upstream_groups(records).values()
    own, b = group["members"]["api.example.com"], group["members"]["b"]
    assert (group["waited"], own["waited"], b["waited"]) == (3, {"slow_head": 2, "hedge": 1}, {})
    assert group["duplicated_prompt_tokens"] == 0  # nothing sent again
    assert summary.main([str(write_log(tmp_path / "t.jsonl", records)), "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out)["upstream_groups"]["api.example.com"]["members"][
        "api.example.com"]["waited"] == {"slow_head": 2, "hedge": 1}
    assert summary.main([str(write_log(tmp_path / "t.jsonl", records))]) == 0
    text = capsys.readouterr().out
    assert "3 requests, 0 failed over before the head, 3 late heads waited for (no member expected sooner)" in text
    assert "waited 2 (no slow_head), waited 1 (no hedge); lowest 3" in text
