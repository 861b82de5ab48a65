"""The in-flight ledger: slots in and out (pure), and a relay killed with a stream in
flight whose successor records it as lost (real mitmdumps, kill -9)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess

import pytest

from mitmproxy.test import tflow

from ttft_relay import apis, state
from ttft_relay.observe import ledger
from ttft_relay.timing import record
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client

ENTRY = {"id": "f1", "ts": 1700000000.5, "api": "openai.chat", "model": "gpt-4o-mini", "stream": True,
         "upstream": "api.openai.com", "tls": True, "request_id": "req-1"}
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def test_a_slot_keeps_its_entry_and_a_free_or_torn_one_is_skipped():
    slot = ledger.encode_slot(ENTRY)
    assert len(slot) == ledger.SLOT_SIZE
    free = bytes(ledger.SLOT_SIZE)
    torn = slot[:40] + bytes(ledger.SLOT_SIZE - 40)  # the process died mid-write
    second = ledger.encode_slot({**ENTRY, "id": "f2"})
    found = ledger.filled_slots(slot + free + torn + second)
    assert [(offset, e["id"]) for offset, e in found] == [(0, "f1"), (3 * ledger.SLOT_SIZE, "f2")]
    assert next(ledger.filled_slots(slot)) == (0, ENTRY)


def test_long_client_strings_are_cut_to_fit_a_slot():
    entry = {**ENTRY, "model": "m" * 5000, "request_id": "\x01" * 300}  # JSON escapes six times over
    slot = ledger.encode_slot(entry)
    assert len(slot) == ledger.SLOT_SIZE
    ((_, back),) = ledger.filled_slots(slot)
    assert back["id"] == "f1" and back["request_id"] is None and back["model"] is None
    long_model = {**ENTRY, "model": "m" * 5000}
    ((_, cut),) = ledger.filled_slots(ledger.encode_slot(long_model))
    assert cut["model"] == "m" * record.REQUEST_ID_MAX and long_model["model"] == "m" * 5000  # the entry is left as it was
    ((_, escaped),) = ledger.filled_slots(ledger.encode_slot({**ENTRY, "request_id": "r\udcff"}))  # a byte not UTF-8
    assert escaped["request_id"] == "r\ufffd"


def test_a_lost_request_is_an_error_in_the_relay_with_what_was_known():
    data = ledger.lost_record(ENTRY).as_dict()
    assert (data["id"], data["request_id"], data["ts"], data["model"], data["upstream"]) == (
        "f1", "req-1", 1700000000.5, "gpt-4o-mini", "api.openai.com")
    assert data["error"] == ledger.LOST_ERROR and data["error_phase"] == "relay"
    assert data["verdict"] == "error in relay" and data["status"] is None and data["phases"] == {}


class _Writer:
    """What the ledger reads of the timing log's writer; `written` moves when the test says."""

    def __init__(self, path):
        self.path, self.queued, self.written, self.records, self.on_written = path, 0, 0, [], None

    def write(self, rec):
        self.records.append(rec)
        self.queued += 1


class _Timings:
    def __init__(self, writer):
        self.writer = writer


def _flow(recorded=False):
    f = tflow.tflow()
    state.attach(f, state.FlowState(api=apis.get(apis.OPENAI_CHAT), stream=True, recorded=recorded))
    return f


def _ids(path):
    return [entry["id"] for _, entry in ledger.filled_slots(path.read_bytes())]


def test_a_slot_is_cleared_once_its_record_is_in_the_log_not_when_it_is_published(tmp_path):
    writer = _Writer(tmp_path / "timing.jsonl")
    ledger_file = tmp_path / ".timing.jsonl.inflight"
    book = ledger.Ledger(_Timings(writer))
    book.configure({"relay_timing_log"})
    first, second = _flow(), _flow()
    book.requestheaders(first)
    book.request(first)
    book.requestheaders(second)
    book.requestheaders(_flow(recorded=True))  # its record is out already: nothing to keep
    assert _ids(ledger_file) == [first.id, second.id]
    writer.write({"id": first.id})
    book.timing_record(None, first)
    assert _ids(ledger_file) == [first.id, second.id]  # queued, not written: a kill now must find it
    writer.written = 1
    book.timing_record(None, _flow())
    assert _ids(ledger_file) == [second.id]
    book.done()
    assert ledger_file.stat().st_size == 0


def test_a_lost_request_keeps_its_slot_until_its_lost_record_is_written(tmp_path):
    ledger_file = tmp_path / ".timing.jsonl.inflight"
    ledger_file.write_bytes(bytes(ledger.SLOT_SIZE) + ledger.encode_slot(ENTRY))
    writer = _Writer(tmp_path / "timing.jsonl")
    book = ledger.Ledger(_Timings(writer))
    book.configure({"relay_timing_log"})
    assert [(r["id"], r["error"]) for r in writer.records] == [("f1", ledger.LOST_ERROR)]
    fresh = _flow()
    book.requestheaders(fresh)  # takes a free slot, not the lost one's
    assert _ids(ledger_file) == [fresh.id, "f1"]
    writer.written = 1
    book.requestheaders(_flow())
    assert "f1" not in _ids(ledger_file)


def _died(book):
    """As a kill -9 leaves it: the ledger's file as it was, its lock released."""
    os.close(book._fd)
    book._fd = None


@pytest.mark.parametrize("published", [False, True])
def test_a_request_answered_in_full_before_its_process_died_is_recorded_answered_not_lost(tmp_path, caplog,
                                                                                           published):
    """3 requests whose clients had the whole answer were recorded lost after a kill -9 between
    the last byte and the record: the figures settling (`published` False), or the writer's batch
    (True). The slot says the answer was complete, and the next process records it so."""
    writer = _Writer(tmp_path / "timing.jsonl")
    book = ledger.Ledger(_Timings(writer))
    book.configure({"relay_timing_log"})
    answered, cut_off = _flow(), _flow()
    answered.response = tflow.tresp(status_code=201)
    for f in (answered, cut_off):
        book.requestheaders(f)
        book.request(f)
    book.response(answered)  # the last byte passed on
    if published:
        writer.write({"id": answered.id})
        book.timing_record(_record_ok(), answered)
    _died(book)

    after = _Writer(tmp_path / "timing.jsonl")
    ledger.Ledger(_Timings(after)).configure({"relay_timing_log"})
    by_id = {r["id"]: r for r in after.records}
    assert by_id[cut_off.id]["error"] == ledger.LOST_ERROR
    done = by_id[answered.id]
    assert done["error"] is None and done["status"] == 201 and done["verdict"] == ledger.ANSWERED_VERDICT
    assert "1 request(s) were answered in full when the relay process before this one died" in caplog.text
    (lost_line,) = [r.getMessage() for r in caplog.records if "recorded as lost" in r.getMessage()]
    assert cut_off.id in lost_line and answered.id not in lost_line


def _record_ok():
    return record.build_record(record.RecordInput(
        id="x", ts=1.0, api="openai.chat", model="m", stream=True, status=201, upstream="u", marks={},
        tokens_expected=False, tls_expected=False, reused_connection=None, rtt_ms=None, error=None,
        error_phase=None, request_id=None))


def test_a_ledger_path_that_is_not_a_file_of_its_own_means_no_ledger_and_no_error(tmp_path, caplog):
    (tmp_path / ".timing.jsonl.inflight").symlink_to("/dev/null")
    book = ledger.Ledger(_Timings(_Writer(tmp_path / "timing.jsonl")))
    book.configure({"relay_timing_log"})
    book.requestheaders(_flow())
    assert book.path is None and "no in-flight ledger" in caplog.text
    os.mkfifo(tmp_path / ".other.jsonl.inflight")
    book = ledger.Ledger(_Timings(_Writer(tmp_path / "other.jsonl")))
    book.configure({"relay_timing_log"})
    assert book.path is None and "is not a regular file" in caplog.text


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
    second.wait_for_output(r"1 request\(s\) were in flight when the relay process before this one died, "
                           r"recorded as lost: held$")
    (lost,) = second.log.of("held")
    assert lost["error"] == ledger.LOST_ERROR and lost["verdict"] == "error in relay"
    assert lost["model"] == "gpt-4o-mini" and lost["stream"] is True
    second.log.of("done")  # the first one's record stays one

    # A clean stop leaves nothing to find: the ledger is emptied.
    conn, resp = client.request("POST", f"{second.url()}/v1/chat/completions", CHAT, {"x-request-id": "after"})
    with conn:
        resp.read()
    second.log.of("after")
    second.stop()
    assert (tmp_path / ".timing.jsonl.inflight").stat().st_size == 0
    assert [json.loads(line)["request_id"] for line in log.read_bytes().splitlines()].count("held") == 1


def test_a_second_relay_on_the_same_log_keeps_no_ledger(fake, start_relay, tmp_path):
    log = tmp_path / "timing.jsonl"
    start_relay(reverse_to(fake), relay_timing_log=log)
    second = start_relay(reverse_to(fake), relay_timing_log=log)
    second.wait_for_output(r"another relay process is writing .*: this one keeps no in-flight ledger")


def _held_by_another(path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.parametrize("truncate_fails", [False, True])
def test_after_a_write_error_the_ledger_is_empty_and_keeps_its_lock(tmp_path, monkeypatch, caplog, truncate_fails):
    writer = _Writer(tmp_path / "timing.jsonl")
    ledger_file = tmp_path / ".timing.jsonl.inflight"
    book = ledger.Ledger(_Timings(writer))
    book.configure({"relay_timing_log"})
    in_flight = [_flow() for _ in range(8)]
    for f in in_flight:
        book.requestheaders(f)
    assert len(_ids(ledger_file)) == 8
    real_pwrite = os.pwrite

    def disk_full(fd, data, offset):
        if len(data) == ledger.SLOT_SIZE:  # new slots fail; a slot's mark is written in place
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(ledger.os, "pwrite", disk_full)
    if truncate_fails:
        monkeypatch.setattr(ledger.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    book.requestheaders(_flow())  # the ninth: its slot cannot be written
    assert "emptied, keeping none until this process ends" in caplog.text
    assert _ids(ledger_file) == []  # no slot says a request is in flight: none can be taken for lost
    assert _held_by_another(ledger_file)  # a relay started now keeps no ledger rather than take these
    book.requestheaders(_flow())
    assert _ids(ledger_file) == []
    book.done()
    assert _ids(ledger_file) == [] and not _held_by_another(ledger_file)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB filesystem of the test's own (tmpfs; mounting needs root, as CI is)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", f"ttft-test-{os.getpid()}", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs for the full-disk case: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_a_disk_filling_with_streams_in_flight_records_nothing_lost_or_twice(small_disk, fake, start_relay):
    log = small_disk / "timing.jsonl"
    first = start_relay(reverse_to(fake), relay_timing_log=log)
    held = []
    for i in range(9):
        if i == 8:
            fill(small_disk)  # eight slots fill the ledger's first page; the ninth needs a page more
        conn, resp = client.request("POST", f"{first.url()}/v1/chat/completions", CHAT,
                                    {"x-request-id": f"s{i}", "x-fake-stall-after-chunks": "1"}, timeout=30)
        chunks = resp.chunks()
        first_piece = next(chunks).data  # under way, and held
        held.append((conn, first_piece, chunks))
    first.wait_for_output(r"in-flight ledger .*No space left on device")
    # A relay started on the same log meanwhile: the lock is still the first one's, so it takes
    # none of its streams for lost (they were: 8 lost records, then 8 real ones for the same requests).
    second = start_relay(reverse_to(fake), relay_timing_log=log)
    second.wait_for_output(r"another relay process is writing .*: this one keeps no in-flight ledger")
    (small_disk / "filler").unlink()
    fake.release_stalls()
    for conn, first_piece, chunks in held:
        with conn:
            assert (first_piece + b"".join(c.data for c in chunks)).endswith(b"data: [DONE]\n\n")
    for i in range(9):
        first.log.of(f"s{i}")
    first.stop()
    second.stop()
    # A clean stop after the error: the next relay finds nothing to record (it found 8 "lost").
    third = start_relay(reverse_to(fake), relay_timing_log=log)
    conn, resp = client.request("POST", f"{third.url()}/v1/chat/completions", CHAT, {"x-request-id": "after"})
    with conn:
        resp.read()
    third.log.of("after")
    assert not [r for r in third.log.records() if r["error"] == ledger.LOST_ERROR]
    assert "recorded as lost" not in third.text()
