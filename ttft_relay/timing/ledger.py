"""The requests a relay process died with, recorded by the next one to start.

A relay process killed outright (the OOM killer, `kill -9`, a crash in C) writes no
record for the requests it had in flight: their clients saw the connection reset, and
the timing log says nothing of them. So each process keeps a ledger beside its timing
log (`.<log's name>.inflight`, hidden: not one of the log's rotations): one fixed-size slot per request in flight, filled at its request
head (and again once the request is read, with the model), cleared when its record is
published. Slots are written into a shared mapping of the file: memory writes, no
system call per request, and the kernel keeps them when the process dies.

The ledger is locked while its process lives. A process starting with the same timing
log (a worker restarted by its supervisor, systemd restarting the relay) takes the
lock; if it gets it, the one that held it is gone, and every slot still filled is a
request that process never recorded. Each becomes a record now, with the error
`LOST_ERROR` in phase `relay` (verdict "error in relay") and what was known of it: its
flow id, client request id, time, API, model, upstream. Only its start is known, so a
lost record has no phases. If the lock is held, another live relay writes the same log:
this one keeps no ledger and says so.

The slot format is sans-IO (`encode_slot`, `filled_slots`, `lost_record`); `Ledger` is
the addon around it, and reads the timing log's path and writer from `Timing`.
WebSocket turns are not in the ledger: the upgrade's flow is, until its handshake record.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from mitmproxy import http

from .. import state
from . import record
from .timing import Timing, upstream_name

logger = logging.getLogger(__name__)

SLOT_SIZE = 512
SLOTS = 4096
"""Requests in flight the ledger holds (a 2 MiB file, sparse); beyond, they go unledgered."""
_FILLED = 0x01
_HEADER = 3
"""A slot: one byte (0 free, 1 filled), two bytes big-endian length, then the JSON entry."""
FIELD_MAX = 200
"""Characters kept of the client's strings (model, request id) in a slot."""
LOST_ERROR = "relay process exited with the request in flight (no answer was recorded)"


def encode_slot(entry: dict[str, Any]) -> bytes:
    """One filled slot of exactly `SLOT_SIZE` bytes holding `entry` (JSON-able values).
    The client's strings are cut to `FIELD_MAX`; if the entry is still too long (JSON
    escapes), they are dropped."""
    entry = {key: value[:FIELD_MAX] if key in ("model", "request_id") and isinstance(value, str) else value
             for key, value in entry.items()}
    data = orjson.dumps(entry)
    if len(data) > SLOT_SIZE - _HEADER:
        data = orjson.dumps({**entry, "model": None, "request_id": None})
    return bytes((_FILLED,)) + len(data).to_bytes(2, "big") + data.ljust(SLOT_SIZE - _HEADER, b"\0")


def filled_slots(ledger: bytes) -> Iterator[dict[str, Any]]:
    """The entries of every filled slot of a ledger's bytes; torn or unreadable slots are skipped."""
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
            yield entry


def lost_record(entry: dict[str, Any]) -> record.Record:
    """The record of a request its relay process died with (see the module's docstring)."""
    def text(key: str) -> str | None:
        value = entry.get(key)
        return value if isinstance(value, str) else None

    return record.build_record(
        id=entry["id"], ts=float(entry["ts"]), api=text("api") or "unknown", model=text("model"),
        stream=entry.get("stream") is True, status=None, upstream=text("upstream") or "",
        marks={}, tokens_expected=False, tls_expected=entry.get("tls") is True,
        reused_connection=None, rtt_ms=None, error=LOST_ERROR, error_phase="relay",
        request_id=text("request_id"),
    )


def entry_of(flow: http.HTTPFlow, st: state.FlowState) -> dict[str, Any]:
    return {"id": flow.id, "ts": flow.request.timestamp_start, "api": st.api, "model": st.model,
            "stream": st.stream, "upstream": upstream_name(flow), "tls": flow.request.scheme == "https",
            "request_id": flow.request.headers.get("x-request-id")}


class Ledger:
    """Each in-scope request in flight holds a slot of the timing log's ledger; at
    start, the slots a dead process left filled are recorded as lost (module docstring)."""

    def __init__(self, timings: Timing) -> None:
        self.timings = timings
        self.path: Path | None = None
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._free: list[int] = []
        self._slot_of: dict[str, int] = {}
        """Flow id → its slot's offset."""

    def configure(self, updated: set[str]) -> None:
        # After Timing's configure (relay.py's order): its writer is the log's.
        if "relay_timing_log" in updated:
            log = self.timings.writer.path if self.timings.writer is not None else None
            path = log.with_name(f".{log.name}.inflight") if log is not None else None
            if path != self.path:
                self._close()
                if path is not None:
                    self._open(path)

    def done(self) -> None:
        self._close()

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._fill(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        self._fill(flow)  # again: the model is known now

    def timing_record(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        offset = self._slot_of.pop(flow.id, None)
        if offset is not None and self._map is not None:
            self._map[offset] = 0
            self._free.append(offset)

    def _fill(self, flow: http.HTTPFlow) -> None:
        if self._map is None or (st := state.get(flow)) is None or st.recorded:
            return
        offset = self._slot_of.get(flow.id)
        if offset is None:
            if not self._free:
                return  # more in flight than SLOTS: this one goes unledgered
            offset = self._slot_of[flow.id] = self._free.pop()
        self._map[offset:offset + SLOT_SIZE] = encode_slot(entry_of(flow, st))

    def _open(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            logger.warning("no in-flight ledger (%s): requests a crash takes will go unrecorded", e)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            logger.warning("another relay process is writing %s: this one keeps no in-flight ledger", path.parent)
            return
        with open(fd, "rb", closefd=False) as f:
            left = f.read(SLOTS * SLOT_SIZE)
        lost = [lost_record(entry) for entry in filled_slots(left)]
        if lost and self.timings.writer is not None:
            for rec in lost:
                self.timings.writer.write(rec.as_dict())
            logger.warning("%d request(s) were in flight when the relay process before this one died: "
                           "recorded as lost (%s)", len(lost), ", ".join(rec.request_id or rec.id for rec in lost))
        os.ftruncate(fd, 0)
        os.ftruncate(fd, SLOTS * SLOT_SIZE)  # zeroed, and sparse until slots are written
        self._fd, self.path = fd, path
        self._map = mmap.mmap(fd, SLOTS * SLOT_SIZE)
        self._free = list(range((SLOTS - 1) * SLOT_SIZE, -1, -SLOT_SIZE))
        self._slot_of = {}

    def _close(self) -> None:
        """A clean end: every flow was recorded (Timing's done), nothing is left to find."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)  # releases the lock
            self._fd = None
        self.path = None
