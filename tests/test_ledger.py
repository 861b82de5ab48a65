"""The in-flight ledger: slots in and out (pure), and a relay killed with a stream in
flight whose successor records it as lost (real mitmdumps, kill -9)."""

from __future__ import annotations

import json
import os
import signal

from ttft_relay.timing import ledger
from tests.conftest import reverse_to
from tests.fakes import client

ENTRY = {"id": "f1", "ts": 1700000000.5, "api": "openai.chat", "model": "gpt-4o-mini", "stream": True,
         "upstream": "api.openai.com", "tls": True, "request_id": "req-1"}
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def test_a_slot_keeps_its_entry_and_a_free_or_torn_one_is_skipped():
    slot = ledger.encode_slot(ENTRY)
    assert len(slot) == ledger.SLOT_SIZE
    free = bytes(ledger.SLOT_SIZE)
    torn = slot[:40] + bytes(ledger.SLOT_SIZE - 40)  # the process died mid-write
    second = ledger.encode_slot({**ENTRY, "id": "f2"})
    assert [e["id"] for e in ledger.filled_slots(slot + free + torn + second)] == ["f1", "f2"]
    assert next(ledger.filled_slots(slot)) == ENTRY


def test_long_client_strings_are_cut_to_fit_a_slot():
    entry = {**ENTRY, "model": "m" * 5000, "request_id": "\x01" * 300}  # JSON escapes six times over
    slot = ledger.encode_slot(entry)
    assert len(slot) == ledger.SLOT_SIZE
    (back,) = ledger.filled_slots(slot)
    assert back["id"] == "f1" and back["request_id"] is None and back["model"] is None
    long_model = {**ENTRY, "model": "m" * 5000}
    (cut,) = ledger.filled_slots(ledger.encode_slot(long_model))
    assert cut["model"] == "m" * ledger.FIELD_MAX and long_model["model"] == "m" * 5000  # the entry is left as it was


def test_a_lost_request_is_an_error_in_the_relay_with_what_was_known():
    data = ledger.lost_record(ENTRY).as_dict()
    assert (data["id"], data["request_id"], data["ts"], data["model"], data["upstream"]) == (
        "f1", "req-1", 1700000000.5, "gpt-4o-mini", "api.openai.com")
    assert data["error"] == ledger.LOST_ERROR and data["error_phase"] == "relay"
    assert data["verdict"] == "error in relay" and data["status"] is None and data["phases"] == {}


def test_a_relay_killed_mid_stream_has_its_request_recorded_by_the_next_one(fake, start_relay, tmp_path):
    log = tmp_path / "timing.jsonl"
    first = start_relay(reverse_to(fake), relay_timing_log=log)
    conn, resp = client.request("POST", f"{first.url()}/v1/chat/completions", CHAT,
                                {"x-request-id": "held", "x-fake-stall-after-chunks": "1"}, timeout=20)
    with conn:
        next(resp.chunks())  # the stream is under way, the relay holds it
        other, answer = client.request("POST", f"{first.url()}/v1/chat/completions", CHAT, {"x-request-id": "done"})
        with other:
            answer.read()
        first.log.of("done")
        assert (tmp_path / ".timing.jsonl.inflight").exists()
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
    assert not [r for r in first.log.records() if r["request_id"] == "held"]  # it died without one

    second = start_relay(reverse_to(fake), relay_timing_log=log)
    second.wait_for_output(r"1 request\(s\) were in flight when the relay process before this one died: "
                           r"recorded as lost \(held\)")
    (lost,) = second.log.of("held")
    assert lost["error"] == ledger.LOST_ERROR and lost["verdict"] == "error in relay"
    assert lost["model"] == "gpt-4o-mini" and lost["stream"] is True
    second.log.of("done")  # the first one's record stays one

    # A clean stop leaves nothing to find: the ledger goes with the relay.
    conn, resp = client.request("POST", f"{second.url()}/v1/chat/completions", CHAT, {"x-request-id": "after"})
    with conn:
        resp.read()
    second.log.of("after")
    second.stop()
    assert not (tmp_path / ".timing.jsonl.inflight").exists()
    assert [json.loads(line)["request_id"] for line in log.read_bytes().splitlines()].count("held") == 1


def test_a_second_relay_on_the_same_log_keeps_no_ledger(fake, start_relay, tmp_path):
    log = tmp_path / "timing.jsonl"
    start_relay(reverse_to(fake), relay_timing_log=log)
    second = start_relay(reverse_to(fake), relay_timing_log=log)
    second.wait_for_output(r"another relay process is writing .*: this one keeps no in-flight ledger")
