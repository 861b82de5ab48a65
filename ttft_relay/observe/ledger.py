"""The requests a relay process died with, recorded by the next one to start.

A relay process killed outright (the OOM killer, `kill -9`, a crash in C) writes no
record for the requests it had in flight: their clients saw the connection reset, and
the timing log says nothing of them. So each process keeps a ledger beside its timing
log (`.<log's name>.inflight`, hidden: not one of the log's rotations; worker N > 0 of
`ttft-relay run --workers`, which all write one log: `.<log's name>.N.inflight`): one fixed-size
slot per request in flight, filled at its request head (and again once the request is
read, with the model), and cleared once its record is in the log file: not when the
record is published but when the writer thread has written it
(`RecordWriter.written`, which wakes the event loop after each batch), so that a kill
in between leaves the slot; a kill between the write and the clearing leaves a slot
whose record is in the log already, so the records at the log's end are looked at
before one is recorded as lost (`RECENT_BYTES`). Each change is
one `pwrite` into a file the process holds open: the kernel keeps it when the process
dies, and a full disk is an error to handle, not a signal.

The ledger is locked while its process lives. A process starting with the same timing
log (a worker restarted by its supervisor, systemd restarting the relay) takes the
lock; if it gets it, the one that held it is gone, and every slot still filled is a
request that process never recorded. Each becomes a record now, with the error
`LOST_ERROR` in phase `relay` (verdict "error in relay") and what was known of it: its
flow id, client request id, time, API, model, upstream. Only its start is known, so a
lost record has no phases. A slot is marked once its answer is complete (`response`:
every byte of the body passed on; its status written in): a process that dies between
that and the record (its figures settling, the writer's batch) leaves a request whose
client had the whole answer, and it is recorded as such (`answered_record`: its status,
no error, verdict `ANSWERED_VERDICT`), never as lost. If the lock is held, another live relay writes the same log:
this one keeps no ledger and says so. A clean stop records everything itself and
empties the ledger (it stays, locked until the process exits, so that a relay starting
meanwhile finds it taken rather than a new file beside it).

It never lies: a filled slot is a request its process has not recorded. A write that
fails (a full disk, a quota) would leave slots that say otherwise, so the ledger is
emptied there and then (truncating frees space, it takes none; where even that fails,
each slot's mark is overwritten in place) and keeps no more slots until the process
ends: its requests go unledgered, never recorded twice. The lock is kept all the same,
so that no relay started meanwhile takes this one's requests in flight for lost.

The slot format is sans-IO (`encode_slot`, `filled_slots`, `lost_record`); `Ledger` is
the addon around it, and reads the timing log's writer from `Timing`. WebSocket turns
are not in the ledger: the upgrade's flow is, until its handshake's record.
"""

from __future__ import annotations

import dataclasses

import asyncio
import errno
import fcntl
import logging
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from mitmproxy import http

from .. import state
from ..text import without_known_secrets
from ..flows import upstream_name
from ..timing import record
from ..timing.addon import Timing
from .metrics import WORKER_ENV

logger = logging.getLogger(__name__)

SLOT_SIZE = 512
SLOTS = 4096
"""Requests in flight the ledger holds (a 2 MiB file, sparse); beyond, they go unledgered."""
_FILLED = 0x01
_HEADER = 3
"""A slot: one byte (0 free, 1 filled), two bytes big-endian length, then the JSON entry."""
_CUT = ("model", "request_id")
"""The client's strings in an entry: cut to `record.REQUEST_ID_MAX`, dropped if still too long."""
LOST_ERROR = "relay process exited with the request in flight (no answer was recorded)"
ANSWERED_VERDICT = "answered; its timing was lost with the relay process"
"""The verdict of a request whose answer was complete when its process died, before its record."""
ANSWERED = "answered"
"""A slot's key once the answer is complete: the response's status."""
RECENT_BYTES = 1024 * 1024
"""How much of the log's end is read for records already written of slots still filled."""


def encode_slot(entry: dict[str, Any]) -> bytes:
    """One filled slot of exactly `SLOT_SIZE` bytes holding `entry` (JSON-able values; a
    string that is not valid UTF-8 is repaired as the record writer repairs it). The
    client's strings are cut; if the entry is still too long (JSON escapes), dropped."""
    entry = {k: v[:record.REQUEST_ID_MAX] if k in _CUT and isinstance(v, str) else v for k, v in entry.items()}
    try:
        data = orjson.dumps(entry)
    except orjson.JSONEncodeError:  # repaired only where needed: this runs twice a request
        entry = record.valid_text(entry)
        data = orjson.dumps(entry)
    if len(data) > SLOT_SIZE - _HEADER:
        data = orjson.dumps({**entry, **dict.fromkeys(_CUT)})
    return bytes((_FILLED,)) + len(data).to_bytes(2, "big") + data.ljust(SLOT_SIZE - _HEADER, b"\0")


def filled_slots(ledger: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    """(offset, entry) of every filled slot of a ledger's bytes; torn or unreadable slots are skipped."""
    for start in range(0, len(ledger) - SLOT_SIZE + 1, SLOT_SIZE):
        if ledger[start] != _FILLED:
            continue
        size = int.from_bytes(ledger[start + 1:start + _HEADER], "big")
        if size > SLOT_SIZE - _HEADER:
            continue
        try:
            entry = orjson.loads(ledger[start + _HEADER:start + _HEADER + size])
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and isinstance(entry.get("ts"), (int, float)):
            yield start, entry


def lost_record(entry: dict[str, Any]) -> record.Record:
    """The record of a request its relay process died with (see the module's docstring)."""
    def text(key: str) -> str | None:
        value = entry.get(key)
        return value if isinstance(value, str) else None

    return record.build_record(record.RecordInput(
        id=entry["id"], ts=float(entry["ts"]), api=text("api") or "unknown", model=text("model"),
        stream=entry.get("stream") is True, status=None, upstream=text("upstream") or "",
        marks={}, tokens_expected=False, tls_expected=entry.get("tls") is True,
        reused_connection=None, rtt_ms=None, error=LOST_ERROR, error_phase="relay",
        request_id=text("request_id"),
    ))


def answered_record(entry: dict[str, Any]) -> record.Record:
    """The record of a request whose whole answer its client had when its process died
    (the slot says `answered`): its status and what was known, no error, no phases."""
    status = entry.get(ANSWERED)
    return dataclasses.replace(lost_record(entry), status=status if isinstance(status, int) and not isinstance(status, bool)
                               else None, error=None, error_phase=None, verdict=ANSWERED_VERDICT, verdict_detail=None)


def left_record(entry: dict[str, Any]) -> record.Record:
    """What a slot left filled becomes: answered, or lost."""
    return answered_record(entry) if ANSWERED in entry else lost_record(entry)


def recorded_ids(tail: bytes) -> set[str]:
    """The flow ids of the records in the end of a log (its first line may be cut)."""
    ids = set()
    for line in tail.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("id"), str):
            ids.add(rec["id"])
    return ids


def ledger_path(log: Path, worker: int = 0) -> Path:
    """The ledger beside the timing log `log` of worker `worker` of `ttft-relay run --workers N`
    (the worker started in its place reads it); the first worker's is the single process's."""
    return log.with_name(f".{log.name}.inflight" if worker == 0 else f".{log.name}.{worker}.inflight")


def left_in(path: Path) -> int:
    """How many requests the ledger at `path` holds (0 if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in filled_slots(f.read(SLOTS * SLOT_SIZE)))
    except OSError:
        return 0


def entry_of(flow: http.HTTPFlow, st: state.FlowState) -> dict[str, Any]:
    """What a slot keeps of a request: what its lost record would say. The client's request
    id passes the relay's key redaction, as the record's does (its header is redacted
    before the record is written, after the ledger read it)."""
    request_id = flow.request.headers.get("x-request-id")
    return {"id": flow.id, "ts": flow.request.timestamp_start, "api": st.api.name, "model": st.model,
            "stream": st.stream, "upstream": upstream_name(flow), "tls": flow.request.scheme == "https",
            "request_id": without_known_secrets(request_id) if request_id else None}


class Ledger:
    """Each in-scope request in flight holds a slot of the timing log's ledger; at start,
    the slots a dead process left filled are recorded as lost (the module's docstring)."""

    def __init__(self, timings: Timing) -> None:
        self.timings = timings
        self.path: Path | None = None
        self._fd: int | None = None
        self._writer: record.RecordWriter | None = None
        self._free: list[int] = []
        self._slot_of: dict[str, int] = {}
        """Flow id → its slot's offset, until its record is published."""
        self._recorded: deque[tuple[int, int]] = deque()
        """(the writer's count of records once this one was queued, slot offset): slots whose
        records are published, cleared once the writer has written that many."""
        self._full_said = False
        self._failed = False
        """A write failed: the ledger is empty and stays so (it keeps its lock)."""

    def configure(self, updated: set[str]) -> None:
        # After Timing's configure (relay.py's order): its writer is the log's.
        if updated & Timing.LOG_OPTIONS:
            writer = self.timings.writer
            path = ledger_path(writer.path, int(os.environ.get(WORKER_ENV, "0"))) if writer is not None else None
            if path != self.path:
                self._close()
                if writer is not None and path is not None:
                    self._open(path, writer)
            elif writer is not self._writer:
                # The same log, a new writer (its rotation changed): the old one wrote all it
                # had before it closed.
                self._clear_written(everything=True)
                self._writer = writer

    def running(self) -> None:
        self._watch_writer()

    def done(self) -> None:
        self._close()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._fill(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        self._fill(flow)  # again: the model is known now

    def response(self, flow: http.HTTPFlow) -> None:
        # Every byte of the answer passed on; its record may be a while coming (the figures settle).
        if (offset := self._slot_of.get(flow.id)) is not None:
            self._mark_answered(flow, offset)

    def timing_record(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        offset = self._slot_of.pop(flow.id, None)
        if offset is not None and self._writer is not None:
            if flow.response is not None and flow.error is None and not rec.error and not rec.client_aborted:
                self._mark_answered(flow, offset)  # its record published first: until written
            self._recorded.append((self._writer.queued, offset))
        self._clear_written()

    def _mark_answered(self, flow: http.HTTPFlow, offset: int) -> None:
        if self._fd is None or self._failed or (st := state.get(flow)) is None or flow.response is None:
            return
        self._pwrite(encode_slot({**entry_of(flow, st), ANSWERED: flow.response.status_code}), offset)

    def _fill(self, flow: http.HTTPFlow) -> None:
        if self._fd is None or self._failed or (st := state.get(flow)) is None or st.recorded:
            return
        self._clear_written()
        slot = encode_slot(entry_of(flow, st))
        offset = self._slot_of.get(flow.id)
        if offset is None:
            if not self._free:
                if not self._full_said:
                    self._full_said = True
                    logger.warning("more than %d requests in flight: the ones beyond go unledgered", SLOTS)
                return
            offset = self._slot_of[flow.id] = self._free.pop()
        self._pwrite(slot, offset)

    def _clear_written(self, everything: bool = False) -> None:
        writer, recorded = self._writer, self._recorded
        while recorded and writer is not None and (everything or recorded[0][0] <= writer.written):
            _, offset = recorded.popleft()
            self._pwrite(b"\0", offset)
            self._free.append(offset)

    def _watch_writer(self) -> None:
        """Clear the slots of what the writer thread wrote as soon as it says so."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not yet: `running` does it
        if self._writer is not None:
            self._writer.on_written = lambda: _call_soon(loop, self._clear_written)

    def _pwrite(self, data: bytes, offset: int) -> None:
        if self._fd is None or self._failed:
            return
        try:
            if os.pwrite(self._fd, data, offset) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:  # a full disk, a quota: the requests go on, unledgered
            logger.warning("in-flight ledger %s: %s; emptied, keeping none until this process ends "
                           "(still locked: no other relay takes its requests for lost)", self.path, e)
            self._failed = True
            self._empty()

    def _empty(self) -> None:
        """No slot filled any more (module docstring: it never lies)."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, 0)
            return
        except OSError as e:
            logger.warning("in-flight ledger %s: cannot empty it (%s); clearing its slots in place", self.path, e)
        for offset in {*self._slot_of.values(), *(offset for _, offset in self._recorded)}:
            try:
                os.pwrite(self._fd, b"\0", offset)  # a byte of a slot written before: no new space
            except OSError:
                pass  # nothing more to try: the next start may take it for lost

    def _open(self, path: Path, writer: record.RecordWriter) -> None:
        fd = None
        try:
            # Not through a link or into a device someone put there: a regular file of our own.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            left = os.pread(fd, SLOTS * SLOT_SIZE, 0)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            if isinstance(e, BlockingIOError):  # the lock
                logger.warning("another relay process is writing %s: this one keeps no in-flight ledger", path.parent)
            else:
                logger.warning("no in-flight ledger (%s): requests a crash takes will go unrecorded", e)
            return
        self._fd, self.path, self._writer = fd, path, writer
        self._slot_of, self._recorded, self._full_said, self._failed = {}, deque(), False, False
        # A lost request's slot stays filled until its record is in the log, as any other's:
        # dying again now would leave it for the next start.
        lost: list[str] = []
        answered: list[str] = []
        left_filled = list(filled_slots(left))
        written = recorded_ids(_tail(writer.path)) if left_filled else set()
        for offset, entry in left_filled:
            if entry["id"] in written:
                self._recorded.append((0, offset))  # in the log already: cleared at once
                continue
            rec = left_record(entry)
            writer.write(rec.as_dict())
            self._recorded.append((writer.queued, offset))
            (answered if rec.error is None else lost).append(rec.request_id or rec.id)
        taken = {offset for _, offset in self._recorded}
        self._free = [offset for offset in range((SLOTS - 1) * SLOT_SIZE, -1, -SLOT_SIZE) if offset not in taken]
        self._watch_writer()
        if lost:
            logger.warning("%d request(s) were in flight when the relay process before this one died, "
                           "recorded as lost: %s", len(lost), ", ".join(lost))
        if answered:
            logger.warning("%d request(s) were answered in full when the relay process before this one died, "
                           "before their records: recorded without their timing: %s", len(answered), ", ".join(answered))

    def _close(self) -> None:
        """Stop keeping the ledger: at the end every flow was recorded (Timing's `done`), or
        the log moved (the flows in flight go unledgered). Emptied, not removed (module docstring)."""
        if self._fd is not None:
            self._empty()
            os.close(self._fd)  # releases the lock
        if self._writer is not None:
            self._writer.on_written = None
        self._fd, self.path, self._writer = None, None, None


def _tail(path: Path) -> bytes:
    """The last RECENT_BYTES of a file; b"" if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - RECENT_BYTES))
            return f.read()
    except OSError:
        return b""


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """From the writer thread: `callback` on the event loop, unless the loop is gone."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass  # closed: the relay is stopping, and its ledger is emptied
