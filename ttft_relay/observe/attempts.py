"""Attempt groups: the records of one request a client sent again after it failed or was cut.

A user who waits minutes for a first token is usually waiting on retries: the client's
timeout cuts the request, and it sends the same request again, and again. Each attempt
is a record of its own; grouped, they say what the user lived through ("waited 3 min over
3 attempts, each cut by the client at 60 s while the upstream had not answered").

A request is *the same* when the same sender, in the same conversation, sends the same
method, path and body (`request_key`: a digest of them, of the body its length and its
first and last BODY_EDGE bytes). The sender is the access key the request presented (its
digest, `flows.client_key`; the client's address only when it presented none): a team
behind one NAT is as many senders as it has keys. The conversation is what the client names
its session by in its headers (CONVERSATION_HEADERS), so two sessions of one key that send
the same request (a warm-up, a quota probe) are not taken for attempts of one request. It *retries* a request when that request failed or was cut (an error,
an HTTP error status, the client gone) and it starts at most WINDOW_S after that one
ended. The first attempt's record gets `attempt_group` = its own id and `attempt` 1 (it
failed: a retry may follow); each retry the same group and the next number. A request
that succeeds closes its group: the same request sent again after a success is not a retry.

Each relay process looks up and writes the attempts in one table of fixed-size slots,
a file in the timing log's directory (`.ttft-relay.attempts`) shared by every process
that logs there, each worker of `--workers N` among them (a retry on a new connection may
reach another worker): one `pread` and at most one `pwrite` per record. A slot holds only a digest, a record id, a number and two times. Two
requests whose digests fall into one slot evict each other: the table remembers the
latest of them, enough for retries that follow within minutes. Without a timing log
the table is kept in memory.

WebSocket turns are not grouped (their messages are not the flow's request); a
WebSocket handshake is, like any request: a client reconnecting after a failed upgrade
makes its attempts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from mitmproxy import ctx, http

from ..flows import client_key
from ..timing import record

logger = logging.getLogger(__name__)

WINDOW_S = 600.0
"""A retry starts at most this long after the attempt before it ended."""
EARLY_S = 1.0
"""It may start this much before the relay recorded that attempt's end: a client that cuts
its request and sends it again at once can be seen first on its new connection."""
BODY_EDGE = 8 * 1024
"""The body's bytes hashed at each end (and its length): two turns of one conversation differ
in length and in their newest messages, at the end; hashing a 180 KB body whole cost 190 µs."""
SLOTS = 4096
SLOT_SIZE = 128
_LAYOUT = struct.Struct(">B16sHddB")
"""filled (1), key digest, attempt, started, ended, failed; then the group id's length
(1 byte) and the id; the slot's last 4 bytes are a CRC32 of the rest."""
GROUP_MAX = SLOT_SIZE - _LAYOUT.size - 1 - 4


@dataclass(frozen=True, slots=True)
class Attempt:
    """The latest attempt of a request, as a slot holds it."""

    key: bytes
    group: str
    attempt: int
    started: float
    ended: float
    failed: bool


CONVERSATION_HEADERS = ("session_id", "conversation_id", "x-claude-code-session-id")
"""Request headers the coding agents name their session by (Codex: session_id,
conversation_id; Claude Code: x-claude-code-session-id)."""


def sender(key: str, address: str) -> str:
    """Who sent a request: its access key's digest; its address only when it presented no key."""
    return f"key {key}" if key else f"address {address}"


def conversation(headers: http.Headers) -> str:
    """The session the request's headers name ("" when they name none)."""
    return "\0".join(headers.get(name, "") for name in CONVERSATION_HEADERS)


def request_key(who: str, session: str, method: str, path: str, body: bytes | None) -> bytes:
    """What makes two requests the same request (the module docstring): `who` is its `sender`,
    `session` its `conversation`."""
    body = body or b""
    h = hashlib.blake2b(digest_size=16)
    for part in (who.encode("utf-8", "surrogateescape"), session.encode("utf-8", "surrogateescape"), method.encode(),
                 path.encode("utf-8", "surrogateescape"), str(len(body)).encode()):
        h.update(part)
        h.update(b"\0")
    h.update(body[:BODY_EDGE])
    h.update(body[-BODY_EDGE:])
    return h.digest()


def slot_offset(key: bytes) -> int:
    return int.from_bytes(key[:4], "big") % SLOTS * SLOT_SIZE


def encode(a: Attempt) -> bytes:
    group = a.group.encode("utf-8", "replace")[:GROUP_MAX]
    body = _LAYOUT.pack(1, a.key, min(a.attempt, 0xFFFF), a.started, a.ended, a.failed) + bytes((len(group),)) + group
    body = body.ljust(SLOT_SIZE - 4, b"\0")
    return body + zlib.crc32(body).to_bytes(4, "big")


def decode(data: bytes) -> Attempt | None:
    """The slot's attempt; None for an empty slot, or one torn by two processes writing it at once."""
    if len(data) != SLOT_SIZE or not data[0] or zlib.crc32(data[:-4]) != int.from_bytes(data[-4:], "big"):
        return None
    _, key, attempt, started, ended, failed = _LAYOUT.unpack_from(data)
    length = data[_LAYOUT.size]
    group = data[_LAYOUT.size + 1:_LAYOUT.size + 1 + length].decode("utf-8", "replace")
    return Attempt(key, group, attempt, started, ended, bool(failed))


def retried(before: Attempt | None, key: bytes, started: float) -> tuple[str, int] | None:
    """(group, attempt number) when a request with `key` starting at `started` retries the
    attempt a slot holds; else None."""
    if before is None or before.key != key or not before.failed:
        return None
    if not before.ended - EARLY_S <= started <= before.ended + WINDOW_S or started <= before.started:
        return None
    return before.group, before.attempt + 1


def group(rec: record.Record, before: Attempt | None, key: bytes) -> tuple[record.Learned, Attempt | None]:
    """The record's attempt group, from the slot's attempt, and what the slot holds next
    (None: leave it as it is)."""
    failed = bool(rec.error or rec.client_aborted)
    continued = retried(before, key, rec.ts)
    if continued is not None:
        placed = record.Learned(attempt_group=continued[0], attempt=continued[1])
    elif failed:
        placed = record.Learned(attempt_group=rec.id, attempt=1)
    else:
        placed = record.NOTHING_LEARNED
    if not failed and continued is None and (before is None or before.key != key):
        return placed, None  # an ordinary request: nothing to remember
    end = rec.marks.get("end")
    ended = rec.ts + (end / 1000 if end is not None else 0.0)
    return placed, Attempt(key, placed.attempt_group or rec.id, placed.attempt or 1, rec.ts, ended, failed)


# --- the table and the addon --------------------------------------------------------------


class Table:
    """The slots: in memory, or in a file shared by the processes writing one timing log."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._fd: int | None = None
        self._memory = bytearray(SLOTS * SLOT_SIZE)
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(f"{path} is not a regular file")
            self._fd = fd

    def read(self, offset: int) -> bytes:
        if self._fd is None:
            return bytes(self._memory[offset:offset + SLOT_SIZE])
        return os.pread(self._fd, SLOT_SIZE, offset)

    def write(self, offset: int, data: bytes) -> None:
        if self._fd is None:
            self._memory[offset:offset + SLOT_SIZE] = data
        else:
            os.pwrite(self._fd, data, offset)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def table_path(log: Path) -> Path:
    """The table every relay process logging into `log`'s directory shares."""
    return log.with_name(".ttft-relay.attempts")


class AttemptGroups:
    """Says which attempt group each record of a request a client retried after a failure
    belongs to (`Record.attempt_group`, `attempt`), before the record is judged and published
    (one of `Timing`'s observers)."""

    def __init__(self) -> None:
        self.table = Table()

    def configure(self, updated: set[str]) -> None:
        if "relay_timing_log" not in updated:
            return
        self.table.close()
        log = ctx.options.relay_timing_log
        try:
            self.table = Table(table_path(Path(log)) if log else None)
        except OSError as e:
            logger.warning("attempt groups kept in memory, not shared with other relay processes: %s", e)
            self.table = Table()

    def done(self) -> None:
        self.table.close()

    def observe(self, rec: record.Record, flow: http.HTTPFlow) -> record.Learned:
        if rec.turn:  # a WebSocket turn: the flow's request is the socket's upgrade
            return record.NOTHING_LEARNED
        peer = flow.client_conn.peername
        who = sender(client_key(flow), str(peer[0]) if peer else "")
        key = request_key(who, conversation(flow.request.headers), flow.request.method, flow.request.path,
                          flow.request.raw_content)
        offset = slot_offset(key)
        placed = record.NOTHING_LEARNED
        try:
            placed, after = group(rec, decode(self.table.read(offset)), key)
            if after is not None:
                self.table.write(offset, encode(after))
        except OSError as e:
            logger.warning("attempt groups: %s %s; kept in memory from now on", self.table.path, e)
            self.table.close()
            self.table = Table()
        return placed
