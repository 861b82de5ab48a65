"""ttft_relay/report/report_html.py without a browser: bar offsets, time buckets, columns, a safe page."""

import orjson
import pytest

from ttft_relay.timing import phases
from ttft_relay.report import report_html, summary
from ttft_relay.testing import report_samples


def test_bars_start_where_the_phases_end_at_the_first_token():
    rec = report_samples.build("a", 1000.0, "up", "m", {
        "client_connect": -40.0, "client_arrived": -40.0, "upstream_connect_start": -39.0, "upstream_tcp": -20.0,
        "upstream_tls": -1.0, "request_body": 0.5, "forwarded": 1.0, "response_head": 200.0, "first_byte": 201.0,
        "first_token": 250.0, "last_token": 900.0, "end": 901.0}, new_connection=True)
    start = report_html.bar_start(rec)
    assert start == pytest.approx(-40.0)  # the request was in the kernel from the accept on (eager connect)
    critical = sum(rec["phases"].get(p, 0) for p in phases.CRITICAL_PHASES)
    assert start + critical == pytest.approx(rec["marks"]["first_token"])


def test_a_failed_request_starts_at_zero():
    rec = report_samples.build("e", 1000.0, "up", "m", {"request_body": 1.0, "forwarded": 2.0, "end": 5.0}, error="boom")
    assert rec["ttft_ms"] is None and report_html.bar_start(rec) == 0.0
    held = report_samples.build("h", 1000.0, "up", "m", {"client_arrived": -30.0, "request_body": 1.0, "forwarded": 2.0,
                                                         "end": 5.0}, error="boom")
    assert report_html.bar_start(held) == -30.0  # its phases add up to its total, from its first byte


def test_time_buckets_hold_the_medians_of_each_phase():
    recs = [report_samples.build(f"r{i}", 1000.0 + 60 * i, "up", "m", {
        "request_body": 1.0, "forwarded": 2.0, "response_head": 2.0 + w, "first_byte": 2.0 + w,
        "first_token": 12.0 + w, "last_token": 50.0 + w, "end": 51.0 + w}) for i, w in enumerate([100, 300, 200, 5000])]
    buckets = report_html.time_buckets(recs, 1000.0)
    assert buckets["size_s"] == 60 and buckets["start"] == [0, 60, 120, 180] and buckets["n"] == [1, 1, 1, 1]
    wait = phases.CRITICAL_PHASES.index("upstream_wait")
    assert [row[wait] for row in buckets["medians"]] == [100, 300, 200, 5000]
    assert report_html.bucket_size(86400) == 1800  # a day in at most 48 buckets
    assert report_html.bucket_size(600) == 60


def test_columns_keep_every_record_and_mark_websocket_kinds():
    recs = report_samples.day(30)
    data = report_html.columns(recs, recs[0]["ts"])
    col = data["col"]
    assert len(col["id"]) == len(recs)
    assert len(col["ph"]) == len(recs) * len(report_html.BAR_PHASES)
    assert len(col["mk"]) == len(recs) * len(report_html.TICK_MARKS)
    kinds = dict(zip(col["id"], col["kind"]))
    assert kinds["hs-failed"] == kinds["hs-ok"] == "handshake"
    assert {kinds[r["id"]] for r in recs if r.get("prewarm")} <= {"prewarm"}
    failed = col["id"].index("hs-failed")
    assert data["verdicts"][col["v"][failed]] == "websocket handshake failed"
    assert "timed out" in data["errors"][failed]


def test_slowest_leave_out_prewarm_turns_and_handshakes():
    recs = report_samples.day(60)
    recs[0] |= {"prewarm": True, "ttft_ms": 10**6}
    data = report_html.report_data(recs, summary.summarize(recs), slowest=5)
    picked = [recs[i]["id"] for i in data["slowest"]]
    assert recs[0]["id"] not in picked and "hs-failed" not in picked and len(picked) == 5
    ttfts = [recs[i]["ttft_ms"] for i in data["slowest"]]
    assert ttfts == sorted(ttfts, reverse=True)


def test_the_page_is_one_file_whose_data_cannot_close_its_script():
    recs = report_samples.day(10)
    recs[0]["error"] = "</script><script>alert(1)</script>"
    data = report_html.report_data(recs, summary.summarize(recs), slowest=3)
    page = report_html.page(data)
    assert page.count("</script>") == 2  # the data's and the code's own
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    payload = page.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    assert orjson.loads(payload)["errors"]["0"] == recs[0]["error"]
