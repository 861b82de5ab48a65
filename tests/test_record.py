"""The record schema, its text forms and the JSONL writer."""

import re
import threading

import orjson

from ttft_relay import text
from ttft_relay.timing import phases, record
from ttft_relay.testing.harness import REPO

MARKS = {
    "request_body": 1.0, "forwarded": 2.0, "upstream_connect_start": 2.5, "upstream_tcp": 3.0,
    "upstream_tls": 203.0, "response_head": 450.0, "first_byte": 451.0, "first_event": 451.0,
    "first_token": 460.0, "last_token": 1460.0, "end": 1461.0,
}


def make(**overrides):
    return record.build_record(record.RecordInput(**make_kwargs(**overrides))).as_dict()


def make_kwargs(**overrides):
    kwargs = dict(
        id="f1", ts=1700000000.12345, api="openai.chat", model="gpt-x", stream=True, status=200,
        upstream="api.example.com", marks=MARKS, tokens_expected=True, tls_expected=True,
        reused_connection=False, rtt_ms=200.0, max_gap_ms=30.0, chunks=120, bytes=9000,
        token_events=100, prompt_tokens=1234,
        usage={"input_tokens": 1234, "output_tokens": 200, "cached_tokens": 0, "reasoning_tokens": 0},
    )
    kwargs.update(overrides)
    return kwargs


def test_a_websocket_handshake_has_no_first_token_and_its_failure_names_the_transport():
    marks = {"request_body": 0.5, "forwarded": 1.0, "response_head": 30.0, "end": 30.0}
    ok = make(transport=record.WEBSOCKET, turn=0, marks=marks, tokens_expected=False, stream=False, status=101)
    assert ok["ttft_ms"] is None and "ttft" not in ok["phases"] and ok["phases"]["upstream_wait"] == 29.0
    assert not ok["verdict"].startswith(record.WEBSOCKET_HANDSHAKE_FAILED)
    failed = make(transport=record.WEBSOCKET, turn=0, marks=marks, tokens_expected=False, status=404,
                  error="HTTP 404", error_phase="upstream_wait")
    assert failed["verdict"] == f"{record.WEBSOCKET_HANDSHAKE_FAILED}: upstream refused: not found (404)"
    hung = make(transport=record.WEBSOCKET, turn=0, marks={"request_body": 0.5, "forwarded": 1.0, "end": 15000.0},
                tokens_expected=False, status=None, client_aborted=True)
    assert hung["verdict"] == f"{record.WEBSOCKET_HANDSHAKE_FAILED}: client aborted in upstream wait"
    assert hung["phases"]["total"] == 15000.0  # the time it cost
    turn = make(transport=record.WEBSOCKET, turn=1)
    assert turn["ttft_ms"] == 460.0 and turn["turn"] == 1


def test_the_upstreams_own_processing_time_splits_its_wait_from_the_network():
    # 440 ms from sending to the head; the upstream says it worked 40 ms of them: the rest is network.
    far = make(upstream_processing_ms=40.0, rtt_ms=None, reused_connection=True,
               marks={"request_body": 1.0, "forwarded": 2.0, "response_head": 442.0, "first_token": 443.0})
    assert far["verdict"] == phases.UPSTREAM_NETWORK
    busy = make(upstream_processing_ms=430.0, rtt_ms=None, reused_connection=True,
                marks={"request_body": 1.0, "forwarded": 2.0, "response_head": 442.0, "first_token": 443.0})
    assert busy["verdict"] == phases.UPSTREAM_WAIT
    assert make(upstream_request_id="req_" + "x" * 500)["upstream_request_id"] == ("req_" + "x" * 500)[:128]


def readme_record_keys() -> list[str]:
    """The keys docs/records.md's "Record schema" table names, in its order."""
    text = (REPO / "docs" / "records.md").read_text()
    section = text[text.index("## Record schema"):]
    section = section[:section.index("\n#", 1)]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [key for cell in rows for key in re.findall(r"`([a-z_]+)`", cell)]


def test_readme_documents_the_records_fields_in_their_order():
    assert readme_record_keys() == list(record.FIELDS)
    assert f"## Record schema (`schema: {record.SCHEMA}`)" in (REPO / "docs" / "records.md").read_text()


def test_a_json_line_is_the_records_fields_in_order():
    rec = record.build_record(record.RecordInput(**(dict(
        id="f1", ts=1700000000.12345, api="openai.chat", model="gpt-x", stream=True, status=200,
        upstream="api.example.com", marks=MARKS, tokens_expected=True, tls_expected=True,
        reused_connection=False, rtt_ms=200.0, links={"loop_lag_ms": 3.0}))))
    line = orjson.dumps(rec.as_dict())  # what RecordWriter writes
    assert line == orjson.dumps(rec)  # the dataclass itself serialises the same
    assert list(orjson.loads(line)) == list(record.FIELDS)
    assert record.LINK_KEYS == ("loop_lag_ms", "gc_pause_ms", "client_rtt_ms", "client_retransmits", "upstream_tcp_rtt_ms",
                                "upstream_retransmits", "client_min_rtt_ms", "client_retransmit_ms",
                                "client_out_of_order", "upstream_retransmit_ms", "upstream_out_of_order")


def test_record_has_every_key_and_plain_json_values():
    rec = make()
    assert list(rec) == list(record.FIELDS)
    assert rec["schema"] == record.SCHEMA
    assert orjson.loads(orjson.dumps(rec)) == rec
    assert rec["ts"] == 1700000000.123
    assert rec["ttft_ms"] == 460.0
    assert rec["phases"]["upstream_tls"] == 200.0
    assert rec["output_tokens_per_s"] == 200.0  # 200 tokens over one second
    # The link to a far upstream: its TLS handshake and the request's round trip, one hop.
    assert rec["verdict"] == phases.UPSTREAM_NETWORK


def test_rate_falls_back_to_token_events():
    assert make(usage=None)["output_tokens_per_s"] == 100.0


def test_error_phase_is_derived_when_not_given():
    rec = make(marks={"request_body": 1.0, "forwarded": 2.0, "upstream_connect_start": 2.5, "upstream_tcp": 3.0},
               status=None, error="TLS handshake failed")
    assert rec["error_phase"] == "upstream_tls"
    assert rec["verdict"] == "error in upstream TLS"
    assert rec["ttft_ms"] is None


def test_client_abort_mid_stream():
    marks = {k: v for k, v in MARKS.items() if k not in ("last_token", "end")}
    rec = make(marks=marks, client_aborted=True, error="Client disconnected.")
    assert rec["verdict"] == "client aborted in stream"


def test_long_errors_are_cut():
    assert len(make(error="x" * 5000)["error"]) == text.ERROR_MAX


LINK_COMMENT = ("upstream network (round trip): the link to the upstream 400 ms, 87% of the 460 ms to the first "
                "token (connect 0 ms, TLS 200 ms, round trips 200 ms).")


def test_summary_line_and_comment():
    rec = make()
    line = record.summary_line(rec)
    # The verdict and its number first, then the first token and its phases; the upstream last.
    assert line == ("upstream network (round trip) 400 ms · ttft 460 ms [upstream_wait 247, upstream_tls 200] · "
                    "gpt-x 200 → api.example.com")
    trimmed = {**rec, "trim": {"trimmed": True, "tokens_before": 79440, "tokens_after": 39912, "budget": 40000},
               "model": "claude-sonnet-4-5", "phases": {**rec["phases"], "client_upload": 5.0}}
    # Within a terminal's width: the smallest phases give way, all of them if need be (every phase is
    # in the record and mitmweb).
    assert record.summary_line(trimmed) == ("upstream network (round trip) 400 ms · ttft 460 ms · "
                                            "claude-sonnet-4-5 200 → api.example.com · trimmed 79440→39912")
    assert len(record.summary_line(trimmed)) <= record.CONSOLE_WIDTH
    text = record.comment(rec)
    # mitmweb's Comment column shows the start: the verdict and its number first, as on the console.
    assert text.splitlines()[:2] == ["upstream network (round trip) 400 ms · ttft 460 ms.", LINK_COMMENT]
    assert "upstream_wait 247" in text.splitlines()[2]
    assert "Connection new, rtt 200 ms; 120 chunks" in text
    assert record.comment(rec, slow=True).splitlines()[0] == "upstream network (round trip) 400 ms · SLOW: ttft 460 ms."
    judged = make(marks={**MARKS, "upstream_tls": 4.0, "response_head": 2300.0, "first_token": 2310.0,
                         "last_token": 3000.0, "end": 3001.0})
    judged_rec = record.build_record(record.RecordInput(**make_kwargs(marks=judged["marks"])), record.Learned(
        expectation=phases.Expectation(own_ms=300.0, tolerance_ms=250.0, prompt_ms=100.0,
                                       uncached_tokens=1234, cached_tokens=0, ms_per_1k=81.0, learned_from=9)))
    assert record.summary_line(judged_rec.as_dict()).startswith("upstream queueing 4.6× predicted · ttft 2310 ms [")
    assert record.headline({"verdict": "context length", "verdict_detail": "first token 1.0 s: 9.2k prompt tokens "
                            "(0 cached) at 100 ms per 1k explain 924 ms of it"}) == "context length 9.2k tokens"
    assert record.headline({"verdict": "ok", "verdict_detail": "first token 310 ms, nothing out of line"}) == "ok"
    text = record.comment(judged_rec.as_dict())
    assert text.splitlines()[0] == "upstream queueing 4.6× predicted · ttft 2310 ms, expected 504 ms."
    assert text.splitlines()[1].startswith("upstream queueing: first token 2.3 s, 4.6× the 504 ms this prompt predicts")
    assert record.turn_line(judged_rec.as_dict() | {"turn": 3}, slow=True).startswith(
        "upstream queueing (turn 3, SLOW): first token 2.3 s, 4.6× ")


def test_writer_appends_lines_creates_parents_and_loses_nothing_on_close(tmp_path):
    path = tmp_path / "deep" / "er" / "timing.jsonl"
    writer = record.RecordWriter(path)
    threads = [
        threading.Thread(target=lambda n=n: [writer.write({"n": n, "i": i}) for i in range(500)])
        for n in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert len(lines) == 2000
    assert {(x["n"], x["i"]) for x in lines} == {(n, i) for n in range(4) for i in range(500)}
    # Appends, never truncates.
    writer = record.RecordWriter(path)
    writer.write({"n": -1})
    writer.close()
    assert len(path.read_bytes().splitlines()) == 2001


def test_writer_writes_a_record_whose_header_value_is_not_utf8(tmp_path):
    path = tmp_path / "timing.jsonl"
    writer = record.RecordWriter(path)
    writer.write({"request_id": "r\udcff1", "nested": {"error": ["x\udc80"]}})  # mitmproxy's surrogateescape
    writer.close()
    assert orjson.loads(path.read_bytes()) == {"request_id": "r\ufffd1", "nested": {"error": ["x\ufffd"]}}
    assert writer.queued == writer.written == 1


def test_links_fill_their_keys_and_a_saturated_relay_gets_advice():
    rec = make(marks={**MARKS, "client_arrived": -900.0},
               links={"loop_lag_ms": 850.0, "client_rtt_ms": 0.1, "client_retransmits": 0, "ignored": 1})
    assert rec["loop_lag_ms"] == 850.0 and rec["upstream_retransmits"] is None and "ignored" not in rec
    assert rec["verdict"] == phases.RELAY_SATURATED
    assert rec["ttft_ms"] == 1360.0
    assert "900 ms in its own queues" in record.comment(rec) and "850 ms late" in record.comment(rec)
    assert "--workers" not in record.comment(make())


def test_cut_text_says_how_long_the_text_was_and_cuts_once():
    assert text.cut_text("short") == "short"
    cut = text.cut_text("z" * 8_000_000)
    assert len(cut) <= text.ERROR_MAX and cut.endswith("… (8000000 characters)") and cut.startswith("zzz")
    assert text.cut_text(cut) == cut  # the reply, the console and the record cut it alike


def test_the_console_line_says_what_trimming_did_and_when_it_went_into_the_newest_turn():
    trim = {"trimmed": True, "tokens_before": 42618, "tokens_after": 15612, "budget": 16000, "budget_source": "user",
            "window": None, "over_budget": False, "dropped_rounds": 0, "cut_results": 0}
    assert record.summary_line(make() | {"trim": trim}).endswith(" · trimmed 42618→15612")
    over = record.summary_line(make() | {"trim": trim | {"over_budget": True, "dropped_rounds": 31}})
    assert over.endswith(" · trimmed 42618→15612 over budget (rounds -31, results cut 0)")
    untouched = record.summary_line(make() | {"trim": trim | {"trimmed": False, "over_budget": True}})
    assert untouched.endswith(" · over budget 16000")
