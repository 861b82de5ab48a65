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
the same request (a warm-up, a quota probe) are not taken for attempts of one request. It
*retries* a request when that request failed or was cut (an error, an HTTP error status,
the client gone) and it starts at most WINDOW_S after that one ended. The first attempt's
record gets `attempt_group` = its own id and `attempt` 1 (it failed: a retry may follow);
each retry the same group and the next number. A request that succeeds closes its group:
the same request sent again after a success is not a retry.

The open groups (the latest failed attempt of each request, for WINDOW_S after it ended)
are kept in the relay's store (`ttft_relay.store`, kind "attempt": the file beside the
timing log), one entry per request key, so a retry that reaches another worker of
`--workers N` (a new connection may) or a restarted relay joins its group. A record is
grouped on the event loop against the entries in memory; the file is read and written in a
thread (`AttemptGroups.sync`): at once when a group opens, moves on or closes, when a
request's head arrives and every SYNC_EVERY_S. A request's record (never its answer) waits
for the pass its head asked for (`AttemptGroups.pending`; only a record of an answer quicker
than a read of the file waits): a retry on another worker finds its group. Entries a
retry can no longer join are dropped. The previous version's table
(`.ttft-relay.attempts`) is read into the store once and no longer written.

WebSocket turns are not grouped (their messages are not the flow's request); a
WebSocket handshake is, like any request: a client reconnecting after a failed upgrade
makes its attempts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import struct
import time
import weakref
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mitmproxy import ctx, http

from .. import state, store
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
KIND_NAME = "attempt"
"""The open groups' kind in the store."""
MAX_ENTRIES = 4096
"""Open groups kept (the least recently used go first): as many as the previous version's table."""
GROUP_MAX = 87
"""The longest group id kept (a record's id; the previous version's slot held as many bytes)."""
ATTEMPT_MAX = 0xFFFF
"""The highest attempt number kept (a record field: a number, never an unbounded one from the file)."""
SYNC_EVERY_S = 0.2
"""How often a process reads the store again when nothing asked it to sooner."""
PASS_GAP_S = 0.05
"""At least this between two passes: each may rewrite the whole store, and in a provider's
outage every record is a failure that asks for one."""
PRUNE_EVERY_S = 60.0
"""How often the groups no retry can join any more are dropped from the store."""
LEGACY_FILE = ".ttft-relay.attempts"
"""The previous version's table, beside the timing log: read once into the store."""
SLOTS, SLOT_SIZE = 4096, 128
_SLOT = struct.Struct(">B16sHddB")
"""A slot of the previous version's table: filled (1), key digest, attempt, started, ended,
failed; then the group id's length (1 byte) and the id; its last 4 bytes a CRC32 of the rest."""
_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Attempt:
    """The latest attempt of a request."""

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


def retried(before: Attempt | None, key: bytes, started: float) -> tuple[str, int] | None:
    """(group, attempt number) when a request with `key` starting at `started` retries the
    attempt `before`; else None."""
    if before is None or before.key != key or not before.failed:
        return None
    if not before.ended - EARLY_S <= started <= before.ended + WINDOW_S or started <= before.started:
        return None
    return before.group, before.attempt + 1


def group(rec: record.Record, before: Attempt | None, key: bytes) -> tuple[record.Learned, Attempt | None]:
    """The record's attempt group, from its request's latest attempt before it, and the
    request's latest attempt next (None: leave it as it is)."""
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


# --- in the store -----------------------------------------------------------------------------


def entry(a: Attempt, by: str = "") -> store.Entry:
    """An open group as the store keeps it: keyed by its request, learned when its latest attempt ended."""
    return store.Entry(KIND_NAME, a.key.hex(), [a.group, a.attempt, a.started, a.ended], a.ended, by)


def attempt_of(e: store.Entry) -> Attempt | None:
    """The failed attempt an entry of the store holds, or None if it is not one the relay could have kept."""
    value: Any = e.value
    if not (_KEY.fullmatch(e.key) and isinstance(value, list) and len(value) == 4):
        return None
    group_id, attempt, started, ended = value
    if not (isinstance(group_id, str) and 0 < len(group_id) <= GROUP_MAX
            and type(attempt) is int and 1 <= attempt <= ATTEMPT_MAX
            and all(type(t) in (int, float) for t in (started, ended)) and started <= ended):
        return None
    return Attempt(bytes.fromhex(e.key), group_id, attempt, float(started), float(ended), True)


def joinable(e: store.Entry, now: float) -> bool:
    """Whether a retry may still join the group an entry holds."""
    a = attempt_of(e)
    return a is not None and now <= a.ended + WINDOW_S


def decode_slot(data: bytes) -> Attempt | None:
    """A slot of the previous version's table; None for an empty slot, or one torn by two
    processes writing it at once."""
    if len(data) != SLOT_SIZE or not data[0] or zlib.crc32(data[:-4]) != int.from_bytes(data[-4:], "big"):
        return None
    _, key, attempt, started, ended, failed = _SLOT.unpack_from(data)
    length = data[_SLOT.size]
    group_id = data[_SLOT.size + 1:_SLOT.size + 1 + length].decode("utf-8", "replace")
    return Attempt(key, group_id, attempt, started, ended, bool(failed))


def _legacy(directory: Path) -> list[store.Entry]:
    """The failed attempts of the previous version's table (those a retry may still join are kept)."""
    path = directory / LEGACY_FILE
    if not path.is_file():  # (a FIFO would hold the store's lock)
        return []
    with open(path, "rb") as f:
        data = f.read(SLOTS * SLOT_SIZE)
    slots = (decode_slot(data[at:at + SLOT_SIZE]) for at in range(0, len(data), SLOT_SIZE))
    return [entry(a) for a in slots if a is not None and a.failed and a.group]


KIND = store.Kind(KIND_NAME, MAX_ENTRIES, valid=lambda e: joinable(e, time.time()), legacy=_legacy)
"""Open attempt groups in the store: a group no retry can join any more is not read."""


class AttemptGroups:
    """Says which attempt group each record of a request a client retried after a failure
    belongs to (`Record.attempt_group`, `attempt`), before the record is judged and published
    (one of `Timing`'s observers)."""

    def __init__(self) -> None:
        self.shared = store.SharedStore(None, [KIND])
        self.wanted = asyncio.Event()
        """Set when the store should be read (and this process's changes written) now."""
        self.syncer: asyncio.Task | None = None
        self.passes_started = 0
        self.passes_done = 0
        self.pass_done = asyncio.Condition()
        self.needs_pass: weakref.WeakKeyDictionary[http.HTTPFlow, int] = weakref.WeakKeyDictionary()
        """The pass each request in flight waits for: the first to start after its head."""
        self._prune_at = 0.0
        self._failed = False

    def configure(self, updated: set[str]) -> None:
        if "relay_timing_log" not in updated:
            return
        log = ctx.options.relay_timing_log
        path = Path(log).with_name(store.FILE_NAME) if log else None
        if path != self.shared.path:
            self.shared = store.SharedStore(path, [KIND])

    async def running(self) -> None:
        if self.syncer is None:
            self.syncer = asyncio.create_task(self._keep_syncing(), name="ttft-relay attempt groups")

    def done(self) -> None:
        if self.syncer is not None:
            self.syncer.cancel()
            self.syncer = None
        self._prune(self.shared, self._stale(self.shared))
        self.shared.sync()  # the relay is stopping: nothing else waits on the loop

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if state.get(flow) is not None and self.shared.path is not None:
            # Read the store while the request runs: if it retries an attempt another
            # process saw fail, its record finds the group.
            self.wanted.set()
            if self.syncer is not None:
                self.needs_pass[flow] = self.passes_started + 1

    def pending(self, flow: http.HTTPFlow) -> Awaitable[None] | None:
        """The pass the request's head asked for, if it has not ended yet."""
        needed = self.needs_pass.pop(flow, None)
        if needed is None or self.passes_done >= needed or self.syncer is None:
            return None
        return self._passed(needed)

    async def _passed(self, needed: int) -> None:
        async with self.pass_done:
            await self.pass_done.wait_for(lambda: self.passes_done >= needed)

    async def _keep_syncing(self) -> None:
        while True:
            try:
                async with asyncio.timeout(SYNC_EVERY_S):
                    await self.wanted.wait()
            except TimeoutError:
                pass
            self.wanted.clear()
            self.passes_started += 1
            try:
                await self.sync()
            except Exception:  # said once; the next pass tries again, groups are grouped meanwhile
                if not self._failed:
                    logger.exception("attempt groups: the store not read or written")
                self._failed = True
            async with self.pass_done:
                self.passes_done = self.passes_started
                self.pass_done.notify_all()
            await asyncio.sleep(PASS_GAP_S)

    async def sync(self) -> None:
        """Write the groups changed here and read the others' (the file work in a thread);
        now and then drop the groups no retry can join any more."""
        shared = self.shared
        stale = await asyncio.to_thread(self._sync, shared)
        if stale and shared is self.shared:
            self._prune(shared, stale)
            self.wanted.set()  # written by the next pass

    def _sync(self, shared: store.SharedStore) -> list[store.Entry]:
        shared.sync()
        if time.monotonic() < self._prune_at:
            return []
        self._prune_at = time.monotonic() + PRUNE_EVERY_S
        return self._stale(shared)

    @staticmethod
    def _stale(shared: store.SharedStore) -> list[store.Entry]:
        now = time.time()
        return [e for e in shared.entries.entries(KIND_NAME) if not joinable(e, now)]

    @staticmethod
    def _prune(shared: store.SharedStore, stale: list[store.Entry]) -> None:
        """Drop the stale entries still held (one a record replaced meanwhile stays)."""
        for e in stale:
            if shared.entries.peek(KIND_NAME, e.key) is e:
                shared.entries.remove(KIND_NAME, e.key)

    def observe(self, rec: record.Record, flow: http.HTTPFlow) -> record.Learned:
        if rec.turn:  # a WebSocket turn: the flow's request is the socket's upgrade
            return record.NOTHING_LEARNED
        peer = flow.client_conn.peername
        who = client_key(flow)
        key = request_key(sender(who, str(peer[0]) if peer else ""), conversation(flow.request.headers),
                          flow.request.method, flow.request.path, flow.request.raw_content)
        held = self.shared.entries.get(KIND_NAME, key.hex())
        placed, after = group(rec, attempt_of(held) if held is not None else None, key)
        if after is not None:
            if after.failed:
                self.shared.entries.put(entry(after, who))
            else:  # a success closes its group: nothing left to join
                self.shared.entries.remove(KIND_NAME, key.hex())
            self.wanted.set()
        return placed
