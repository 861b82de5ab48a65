"""The client's x-request-id lands in the timing record (capped), so ttft-relay diagnose can join its probes."""

import orjson
from mitmproxy.test import taddons, tflow

from ttft_relay import apis, state
from ttft_relay.timing import addon as timing
from ttft_relay.timing import record


def test_build_record_keeps_a_request_id_cut_to_its_cap():
    rec = record.build_record(record.RecordInput(
        id="f1", ts=1.0, api="openai.chat", model=None, stream=False, status=200, upstream="u",
        marks={}, tokens_expected=False, tls_expected=True, reused_connection=None, rtt_ms=None,
        request_id="x" * 500,
    ))
    assert rec.request_id == "x" * record.REQUEST_ID_MAX
    assert record.build_record(record.RecordInput(
        id="f1", ts=1.0, api="openai.chat", model=None, stream=False, status=200, upstream="u",
        marks={}, tokens_expected=False, tls_expected=True, reused_connection=None, rtt_ms=None,
    )).request_id is None


def test_timing_addon_records_the_x_request_id_header(tmp_path):
    addon = timing.Timing()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, relay_timing_log=str(tmp_path / "t.jsonl"), relay_timing_console=False)
        f = tflow.tflow(resp=True)
        f.request.headers["x-request-id"] = "ttft-diag-1234"
        state.attach(f, state.FlowState(api=apis.get(apis.OPENAI_CHAT)))
        addon.response(f)
        addon.writer.close()
    (rec,) = [orjson.loads(line) for line in (tmp_path / "t.jsonl").read_bytes().splitlines()]
    assert rec["request_id"] == "ttft-diag-1234"
    assert f.metadata[timing.METADATA_KEY]["request_id"] == "ttft-diag-1234"
