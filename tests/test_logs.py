"""Timing logs that run for months: rotation by size and time with retention, SIGHUP
after logrotate's rename, and ttft-relay report reading rotated and compressed files.

Unit tests of the pure rotation policy, the writer under concurrent writes across many
rotations, then a real mitmdump whose log logrotate-style renaming moves away.
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time

import orjson
import pytest

from ttft_relay.timing import logrotation, record
from ttft_relay.report import summary
from tests.conftest import reverse_to
from ttft_relay.testing.harness import REPO
from ttft_relay.testing.fakes import client

CHAT = b'{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}'


# --- policy (pure) ----------------------------------------------------------------------


def test_rotation_is_due_by_size_before_the_record_that_would_cross_it():
    r = logrotation.Rotation(max_bytes=100)
    assert not r.due(0, 500, 0, 0)  # an empty log never rotates, even for a record bigger than the limit
    assert not r.due(60, 40, 0, 0)
    assert r.due(60, 41, 0, 0)
    assert not logrotation.Rotation().due(10**12, 1, 0, 10**9)  # no rotation configured


def test_rotation_is_due_by_time_at_each_utc_boundary():
    day = logrotation.Rotation(every_s=86400)
    midnight = 1_764_547_200  # 2025-12-01T00:00:00Z
    assert not day.due(10, 1, midnight - 3600, midnight - 1)
    assert day.due(10, 1, midnight - 1, midnight)
    assert not day.due(0, 1, midnight - 1, midnight)


@pytest.mark.parametrize(("text", "seconds"), [("", 0), ("0", 0), ("90s", 90), ("30m", 1800), ("6h", 21600),
                                               ("1d", 86400)])
def test_parse_duration(text, seconds):
    assert logrotation.parse_duration(text) == seconds


def test_parse_duration_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="like 30m"):
        logrotation.parse_duration("daily")


def test_rotated_names_sort_by_time_and_never_collide(tmp_path):
    path = tmp_path / "timing.jsonl"
    now = 1_764_547_200.5
    first = logrotation.rotated_name(path, now, set())
    assert first.name == "timing.jsonl.20251201T000000.500Z"
    assert logrotation.rotated_name(path, now, {first.name + ".gz"}).name == "timing.jsonl.20251201T000000.500Z-2"
    pattern = logrotation.rotated_pattern(path)
    assert pattern.match(first.name) and pattern.match(first.name + "-2.gz")
    assert not pattern.match("timing.jsonl.1") and not pattern.match("timing.0.jsonl.20251201T000000.500Z")


def test_retention_keeps_the_newest():
    rotated = [(3.0, "c"), (1.0, "a"), (2.0, "b")]
    assert logrotation.expired(rotated, 2) == ["a"]
    assert logrotation.expired(rotated, 0) == []


# --- the writer ------------------------------------------------------------------------


def _lines_of(paths) -> list[bytes]:
    out = []
    for p in paths:
        data = gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes()
        assert data == b"" or data.endswith(b"\n"), f"{p.name} ends inside a record"
        out += data.splitlines()
    return out


def test_concurrent_writes_across_rotations_lose_and_split_nothing(tmp_path):
    path = tmp_path / "timing.jsonl"
    rotation = logrotation.Rotation(max_bytes=4096, keep=0)
    writer = record.RecordWriter(path, rotation)
    padding = "x" * 200  # ~250-byte records: a rotation every ~16 records
    threads = [threading.Thread(target=lambda n=n: [writer.write({"n": n, "i": i, "pad": padding})
                                                      for i in range(300)]) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden == [".timing.jsonl.lock"]  # no partial left behind; the writers' lock stays
    files = sorted(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    rotated = [p for p in files if p.name.endswith(".gz")]
    assert len(rotated) > 10
    recs = [orjson.loads(line) for line in _lines_of(files)]  # each line whole JSON: no split record
    assert sorted((r["n"], r["i"]) for r in recs) == [(n, i) for n in range(4) for i in range(300)]
    for p in rotated:
        # A record that would cross the limit starts a new file, so files stay within it.
        assert len(gzip.decompress(p.read_bytes())) <= rotation.max_bytes


_WRITER_PROCESS = """
import sys
from ttft_relay.timing import logrotation, record
n, path = int(sys.argv[1]), sys.argv[2]
writer = record.RecordWriter(path, logrotation.Rotation(max_bytes=256 * 1024, keep=0))
for i in range(1500):
    # now and then a record far beyond PIPE_BUF and the writer's batches' usual size
    writer.write({"n": n, "i": i, "pad": ("z" * 150_000) if i % 250 == 0 else "x" * (i % 300)})
writer.close()
"""


def test_processes_writing_one_log_across_rotations_lose_split_and_repeat_nothing(tmp_path):
    # The workers of `ttft-relay run --workers N` append to one log, and rotate it by turns.
    path = tmp_path / "timing.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER_PROCESS, str(n), str(path)], cwd=REPO)
             for n in range(4)]
    assert [proc.wait(120) for proc in procs] == [0] * 4
    files = sorted(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert len([p for p in files if p.name.endswith(".gz")]) > 5  # rotated, and compressed by whoever rotated
    recs = [orjson.loads(line) for line in _lines_of(files)]  # each line whole JSON: none torn or interleaved
    assert sorted((r["n"], r["i"]) for r in recs) == [(n, i) for n in range(4) for i in range(1500)]


def _written(path, text: bytes) -> None:
    """Wait until the writer thread has put `text` into the file at `path`."""
    deadline = time.monotonic() + 10
    while not (path.exists() and text in path.read_bytes()):
        assert time.monotonic() < deadline, f"{text!r} never reached {path}"
        time.sleep(0.01)


def test_retention_deletes_the_oldest_rotated_files(tmp_path):
    path = tmp_path / "timing.jsonl"
    writer = record.RecordWriter(path, logrotation.Rotation(max_bytes=64, keep=3))
    for i in range(12):
        writer.write({"i": i, "pad": "y" * 40})
        # ~60-byte records against a 64-byte limit: one file per record
    writer.close()
    rotated = sorted((p for p in tmp_path.iterdir() if p.name.endswith(".gz")), key=lambda p: p.stat().st_mtime)
    assert len(rotated) == 3
    kept = [orjson.loads(line)["i"] for line in _lines_of([*rotated, path])]
    assert kept == [8, 9, 10, 11]  # the newest three rotated files and the current log


def test_a_renamed_or_removed_log_is_followed_to_a_new_file(tmp_path):
    path = tmp_path / "timing.jsonl"
    writer = record.RecordWriter(path)
    writer.write({"i": 0})
    renamed = tmp_path / "timing.jsonl.1"
    _written(path, b'{"i":0}')
    path.rename(renamed)  # logrotate's rename, or another writer's rotation
    writer.write({"i": 1})  # the writer holds the renamed file open, and looks at the path first
    _written(path, b'{"i":1}')
    path.unlink()
    writer.write({"i": 2})
    writer.reopen()  # SIGHUP's: at once, after what was queued
    writer.write({"i": 3})
    writer.close()
    assert [orjson.loads(x)["i"] for x in renamed.read_bytes().splitlines()] == [0]
    assert [orjson.loads(x)["i"] for x in path.read_bytes().splitlines()] == [2, 3]


# --- ttft-relay report --------------------------------------------------------------------------


def test_report_reads_rotated_and_compressed_logs(tmp_path):
    recs = [{"ts": 1000 + i, "model": "m", "id": str(i)} for i in range(3)]
    (tmp_path / "timing.jsonl").write_bytes(orjson.dumps(recs[0]) + b"\n")
    (tmp_path / "timing.jsonl.1").write_bytes(orjson.dumps(recs[1]) + b"\n")  # logrotate's name
    (tmp_path / "timing.jsonl.20251201T000000.000Z.gz").write_bytes(gzip.compress(orjson.dumps(recs[2]) + b"\n"))
    paths = summary.expand_globs([str(tmp_path / "timing.jsonl*")])
    got, bad = summary.read_records(paths)
    assert bad == 0 and sorted(r["id"] for r in got) == ["0", "1", "2"]


# --- a real relay: logrotate's rename, then SIGHUP --------------------------------------------


def _post(relay) -> None:
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", CHAT,
                                headers={"content-type": "application/json"})
    with conn:
        resp.read()
    assert resp.status == 200


def _ids(path) -> list[str]:
    return [orjson.loads(line)["id"] for line in path.read_bytes().splitlines()]


def _started(relay):
    # "listening" can come before the relay's addons are configured on a busy machine.
    relay.wait_for_output("tokenizer ready")
    return relay


def test_sighup_after_logrotates_rename_sends_records_to_the_new_log(fake, start_relay, tmp_path):
    relay = _started(start_relay(reverse_to(fake)))
    log = tmp_path / "timing.jsonl"
    _post(relay)
    rotated = tmp_path / "timing.jsonl.1"
    _written(log, b"\n")
    log.rename(rotated)  # logrotate without copytruncate
    _post(relay)  # before the signal: the writer finds the new path on its own
    relay.proc.send_signal(1)  # SIGHUP, as logrotate's postrotate does
    relay.wait_for_output("reloaded on SIGHUP")
    _post(relay)
    _post(relay)
    output = relay.stop()
    assert "Traceback" not in output, output[output.find("Traceback") - 1500:][:4000]
    assert len(_ids(rotated)) == 1 and len(_ids(log)) == 3
    assert len(set(_ids(rotated) + _ids(log))) == 4  # every request once, none lost


def test_the_relay_rotates_its_own_log(fake, start_relay, tmp_path):
    relay = _started(start_relay(reverse_to(fake), relay_timing_log_max_size="1k", relay_timing_log_keep=0))
    for _ in range(8):
        _post(relay)
    relay.stop()
    files = sorted(tmp_path.glob("timing.jsonl*"))
    assert len(files) > 2
    recs = [orjson.loads(line) for line in _lines_of(files)]
    assert len({r["id"] for r in recs}) == len(recs) == 8
    got, bad = summary.read_records(summary.expand_globs([str(tmp_path / "timing.jsonl*")]))
    assert bad == 0 and len(got) == 8


def test_bad_rotation_options_are_refused(fake, start_relay):
    with pytest.raises(RuntimeError, match="like 30m"):
        start_relay(reverse_to(fake), relay_timing_log_rotate_every="daily")
