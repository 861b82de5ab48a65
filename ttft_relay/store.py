"""One store for what the relay learns: context windows, trim plans, first-token lines, open attempt groups.

What the relay learns from the traffic is shared by every client, by every worker of
`ttft-relay run --workers N` and by the next relay after a restart, so it is kept in one
place with one set of rules (each kind's owner adds its own guards before it keeps anything):

- an **entry** is one kind's current word on one key (`Entry`: the kind, the key, the value,
  when it was learned, the digest of the access key that taught it, `flows.client_key`, and
  the upstream reply it came from); a new entry for a key replaces the old one;
- each **kind** is bounded (`Kind.max_entries`): past it, the least recently used entries
  go first (of the lowest `Kind.rank` first: a kind may keep its proven entries over new ones);
- `Entries` is all of that in memory, without IO (sans-IO: unit-tested alone): it holds the
  entries of the kinds it owns, the changes not yet written, and turns the file's bytes into
  entries (`load`) and back (`dump`), one JSON array per line
  (`[kind, key, ts, by, reply, value]`), the lines of the relay's other kinds kept as they came.

`SharedStore` is the thin IO part: one file beside the timing log (FILE_NAME), rewritten
whole (a temporary file renamed over it, under an exclusive lock beside it) when a process
has changes, and read again when another process changed it (a stat when none did). A
reader therefore always sees a whole file, an old one or a new one. Its methods block: the
relay calls them off the event loop only (the trim addon's worker thread, a thread of
`asyncio.to_thread`); on the loop, it reads `Entries` in memory.

Files of the previous version (`learned-windows.jsonl`, `trim-plans.jsonl`,
`.ttft-relay.first-token`, `.ttft-relay.attempts`) are read once, by the first process that writes the store
while it does not exist yet (each kind's `legacy` reader), and are no longer written; the
log says how many entries each gave.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

logger = logging.getLogger(__name__)

FILE_NAME = "learned.jsonl"
"""Beside the timing log: what the relay processes on that log learned."""

RELAY_KINDS = frozenset({b"window", b"plan", b"first-token", b"attempt", b"imported"})
"""The kinds the relay's owners keep (`trim/windows.py`, `trim/plans.py`, `observe/verdicts.py`,
`observe/attempts.py` and the store's own): a line of another kind (a hand edit, another version) is dropped, not
carried along by every process's rewrite."""
MAX_LINE = 64 * 1024
"""A longer line is not one the relay wrote: dropped (the longest, a first-token line of 256
samples, takes about 16 KiB)."""
MAX_FILE = 16 * 1024 * 1024
"""Of a longer file only this much is read: the relay never writes one (its kinds' bounds
keep it to a few MiB)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One kind's current word on one key, and where it came from."""

    kind: str
    key: str
    value: Any
    """What was learned, as JSON (the kind's owner reads it)."""
    ts: float
    """When it was learned (epoch seconds)."""
    by: str = ""
    """The digest of the access key whose request taught it (`flows.client_key`); "" for none."""
    reply: str = ""
    """The upstream reply it was learned from, in a few words ("400 invalid_request_error"); ""
    for what the relay worked out itself (a trim plan)."""

    def encode(self) -> bytes:
        return orjson.dumps([self.kind, self.key, self.ts, self.by, self.reply, self.value])


def decode(line: bytes) -> Entry | None:
    """The entry of one line of the file, or None for a line that is not one."""
    if not line or len(line) > MAX_LINE:
        return None
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(row, list) and len(row) == 6):
        return None
    kind, key, ts, by, reply, value = row
    if not (isinstance(kind, str) and isinstance(key, str) and isinstance(by, str) and isinstance(reply, str)
            and isinstance(ts, (int, float)) and not isinstance(ts, bool)):
        return None
    return Entry(kind, key, value, float(ts), by, reply)


def _kind_of(line: bytes) -> bytes | None:
    """The kind a line names, read without decoding it (`["kind", ...`); None: not a line of the store."""
    if not line.startswith(b'["') or not line.endswith(b"]") or len(line) > MAX_LINE:
        return None
    end = line.find(b'"', 2)
    return line[2:end] if end > 2 else None


@dataclass(frozen=True, slots=True)
class Kind:
    """What the store keeps of one kind and how."""

    name: str
    max_entries: int
    """Entries kept; past it, the least recently used of the lowest rank go first."""
    valid: Callable[[Entry], bool] = lambda entry: True
    """Whether an entry read from the file is one the relay could have written (else dropped)."""
    rank: Callable[[Entry], int] = lambda entry: 0
    """Entries of a lower rank are evicted before any of a higher one."""
    merge: Callable[[Entry, Entry], Entry] | None = None
    """(the file's entry, this process's change) → what the file keeps when this process
    changed a key the file holds (its own earlier word, or another process's: merging must
    not count a word twice); None: this process's change, the newer word."""
    legacy: Callable[[Path], Iterable[Entry]] | None = None
    """Reads the previous version's file in this directory into entries (read once, see the module)."""


_REMOVED = object()
"""A pending change that removes the key."""

IMPORTED = Kind("imported", 64)
"""Every store's own kind: per kind, that the previous version's file was read (its value: the file's name)."""


class Entries:
    """The store in memory (no IO): per owned kind its entries, least recently used first,
    and this process's changes not yet in the file. Thread-safe: the owners' threads and the
    event loop may read and change it at once."""

    def __init__(self, kinds: Iterable[Kind]) -> None:
        self.kinds = {kind.name: kind for kind in [*kinds, IMPORTED]}
        self._owned = {name.encode() for name in self.kinds}
        self._by_kind: dict[str, OrderedDict[str, Entry]] = {name: OrderedDict() for name in self.kinds}
        self._pending: dict[tuple[str, str], Entry | object] = {}
        """Changes made here since the last write: the entry put, or _REMOVED."""
        self._dumped: dict[tuple[str, str], Entry | object] = {}
        """The pending changes as the last `dump` wrote them."""
        self._dumped_lines: dict[bytes, Entry] = {}
        """The owned lines the last `dump` wrote."""
        self._owned_lines: list[bytes] = []
        """The file's lines of the owned kinds, in order, as last loaded or written: the same
        again (another owner changed only its own) leaves what is held as it is."""
        self._touched: dict[tuple[str, str], None] = {}
        """Keys used here since the last load: they count as recently used in the next."""
        self._lines: dict[bytes, Entry] = {}
        """The owned lines of the file as last loaded, decoded: a line loaded again is not decoded again."""
        self._foreign: list[bytes] = []
        """The file's lines of kinds this process does not own, kept as they came."""
        self._lock = threading.RLock()
        self._generations = dict.fromkeys(self.kinds, 0)

    def __len__(self) -> int:
        return sum(len(held) for held in self._by_kind.values())

    def generation(self, kind: str) -> int:
        """Counts the changes to the kind's entries: an owner's view built from them is current
        while it is the same."""
        return self._generations[kind]

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def get(self, kind: str, key: str) -> Entry | None:
        """The current entry of `key`, counted as used."""
        with self._lock:
            held = self._by_kind[kind]
            entry = held.get(key)
            if entry is not None:
                held.move_to_end(key)
                self._touched[(kind, key)] = None
            return entry

    def peek(self, kind: str, key: str) -> Entry | None:
        """The current entry of `key`, not counted as used."""
        return self._by_kind[kind].get(key)

    def entries(self, kind: str) -> list[Entry]:
        """The kind's entries, least recently used first."""
        with self._lock:
            return list(self._by_kind[kind].values())

    def put(self, entry: Entry) -> None:
        """Keep `entry` as its key's current one (and write it with the next write)."""
        with self._lock:
            self._apply(entry.kind, entry.key, entry)
            self._pending[(entry.kind, entry.key)] = entry
            self._generations[entry.kind] += 1

    def remove(self, kind: str, key: str) -> None:
        with self._lock:
            self._apply(kind, key, _REMOVED)
            self._pending[(kind, key)] = _REMOVED
            self._generations[kind] += 1

    def _apply(self, kind: str, key: str, change: Entry | object) -> None:
        held = self._by_kind[kind]
        if change is _REMOVED:
            held.pop(key, None)
            return
        assert isinstance(change, Entry)
        held[key] = change
        held.move_to_end(key)
        self._bound(self.kinds[kind], held)

    @staticmethod
    def _bound(kind: Kind, held: OrderedDict[str, Entry]) -> None:
        """Past the kind's bound, the least recently used of the lowest rank go (in one pass:
        a file of many entries is bounded as fast as one over by one)."""
        excess = len(held) - kind.max_entries
        if excess <= 0:
            return
        if excess == 1:
            lowest = min(kind.rank(entry) for entry in held.values())
            del held[next(key for key, entry in held.items() if kind.rank(entry) == lowest)]
            return
        ranked = sorted((kind.rank(entry), i, key) for i, (key, entry) in enumerate(held.items()))
        for _, _, key in ranked[:excess]:
            del held[key]

    def load(self, data: bytes) -> set[tuple[str, str]]:
        """Take the file's bytes as what every process learned, this process's changes not yet
        written put back on top (a kind's `merge` deciding where both changed a key); returns
        the (kind, key)s whose entry changed."""
        foreign: list[bytes] = []
        owned: list[bytes] = []
        for line in data.split(b"\n"):
            named = _kind_of(line)
            if named is None:
                continue
            if named in self._owned:
                owned.append(line)
            elif named in RELAY_KINDS:
                foreign.append(line)  # another owner's (the trim addon's, the verdicts', the attempt groups')
        with self._lock:
            if owned == self._owned_lines and not self._pending:
                self._foreign = foreign  # only other owners' kinds changed: what is held stands
                return set()
        decoded: dict[bytes, Entry] = {}
        loaded: dict[str, list[Entry]] = {name: [] for name in self.kinds}
        for line in owned:
            entry = decoded.get(line) or self._lines.get(line)  # a line seen before was checked then
            if entry is None:
                entry = decode(line)
                if entry is None or entry.kind not in loaded or not self.kinds[entry.kind].valid(entry):
                    continue
            decoded[line] = entry
            loaded[entry.kind].append(entry)
        with self._lock:
            changed = set()
            for name, entries in loaded.items():
                before = self._by_kind[name]
                held: OrderedDict[str, Entry] = OrderedDict((e.key, e) for e in entries)
                for key in [key for kind, key in self._touched if kind == name and key in held]:
                    held.move_to_end(key)
                for (kind, key), change in self._pending.items():
                    if kind != name:
                        continue
                    theirs = held.get(key)
                    merge = self.kinds[name].merge
                    if isinstance(change, Entry) and theirs is not None and merge is not None:
                        change = merge(theirs, change)  # the file's word counts too
                        self._pending[(kind, key)] = change
                    if change is _REMOVED:
                        held.pop(key, None)
                    else:
                        assert isinstance(change, Entry)
                        held[key] = change
                        held.move_to_end(key)
                self._bound(self.kinds[name], held)
                kind_changed = {key for key in held.keys() | before.keys()
                                if (new := held.get(key)) is not (old := before.get(key)) and new != old}
                changed |= {(name, key) for key in kind_changed}
                if kind_changed:
                    self._generations[name] += 1
                self._by_kind[name] = held
            self._lines, self._foreign, self._owned_lines = decoded, foreign, owned
            self._touched.clear()
            return changed

    def dump(self) -> bytes:
        """The file's bytes: the foreign lines as they came, then the owned entries, least recently used first."""
        with self._lock:
            lines = list(self._foreign)
            by_entry = {id(entry): line for line, entry in self._lines.items()}
            owned = {}
            for held in self._by_kind.values():
                for entry in held.values():
                    line = by_entry.get(id(entry)) or entry.encode()
                    owned[line] = entry
            lines += owned
            self._dumped = dict(self._pending)
            self._dumped_lines = owned
        return b"".join(line + b"\n" for line in lines)

    def written(self) -> None:
        """What the last `dump` gave is now the file: the changes in it are no longer pending
        (those made since stay), and its lines are known as the file's."""
        with self._lock:
            for key, change in self._dumped.items():
                if self._pending.get(key) is change:
                    del self._pending[key]
            self._lines, self._dumped, self._dumped_lines = self._dumped_lines, {}, {}
            self._owned_lines = list(self._lines)


class SharedStore:
    """`Entries` kept in `path` (None: in memory only) and shared with every process on it.
    `refresh`, `sync` block on the file: call them off the event loop."""

    def __init__(self, path: Path | None, kinds: Iterable[Kind], *, read_only: bool = False) -> None:
        self.path = path
        self.entries = Entries(kinds)
        self.read_only = read_only
        """Only read the file, never write it (the report, the metrics' scrape)."""
        self._seen: tuple[int, int, int] | None = None
        """(inode, size, mtime_ns) of the file as last read or written."""
        self._legacy_tried = read_only or path is None or all(k.legacy is None for k in self.entries.kinds.values())
        self._failed: str | None = None

    def refresh(self) -> set[tuple[str, str]]:
        """Read the file again if another process changed it (a stat when none did); returns
        the (kind, key)s whose entry changed. The first call reads the previous version's
        files (`sync`) if the store does not say it did."""
        if self.path is None:
            return set()
        try:
            data, seen = self._read_if_changed()
        except OSError as e:
            self._warn_once(f"cannot read what the relay learned from {self.path}: {e}")
            return set()
        changed = self.entries.load(data) if data is not None else set()
        self._seen = seen
        if not self._legacy_tried:
            changed |= self.sync()
        return changed

    def sync(self) -> set[tuple[str, str]]:
        """Write this process's changes (with what the others wrote since: read, changed,
        renamed over the file under its lock), or only `refresh` when there are none."""
        if self.path is None or self.read_only or (self._legacy_tried and not self.entries.pending):
            return self.refresh()
        try:
            with _Locked(self.path):
                data, seen = self._read_if_changed()
                changed = self.entries.load(data) if data is not None else set()
                self._seen = seen
                if not self._legacy_tried:
                    self._legacy_tried = True
                    changed |= self._import_legacy()
                if not self.entries.pending:
                    return changed
                data = self.entries.dump()
                _write(self.path, data)
                st = os.stat(self.path)
            self.entries.written()
            self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            self._failed = None
            return changed
        except OSError as e:
            self._warn_once(f"cannot keep what the relay learned in {self.path} ({e}): this process alone knows it")
            return set()

    def _read_if_changed(self) -> tuple[bytes | None, tuple[int, int, int] | None]:
        """(the file's bytes, or None when unchanged since the last read; its stat, None when there is none)."""
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                seen = (st.st_ino, st.st_size, st.st_mtime_ns)
                if seen == self._seen:
                    return None, seen
                data = f.read(MAX_FILE + 1)
        except FileNotFoundError:
            return (b"" if self._seen is not None else None), None
        if len(data) > MAX_FILE:
            logger.warning("%s is longer than the relay writes it: only its first %d bytes are read", self.path,
                           MAX_FILE)
            data = data[:data.rfind(b"\n", 0, MAX_FILE) + 1]
        return data, seen

    def _import_legacy(self) -> set[tuple[str, str]]:
        """The previous version's files of the kinds the store does not say were read: read
        now (under the lock, so by one process), and marked read (IMPORTED) when they held
        anything: read once."""
        assert self.path is not None
        changed = set()
        for kind in self.entries.kinds.values():
            if kind.legacy is None or self.entries.peek(IMPORTED.name, kind.name) is not None:
                continue
            try:
                found = [entry for entry in kind.legacy(self.path.parent) if kind.valid(entry)]
            except OSError as e:
                found = []
                logger.warning("the previous version's %s entries not read: %s", kind.name, e)
            taken = [entry for entry in found if self.entries.peek(entry.kind, entry.key) is None]
            for entry in taken:
                self.entries.put(entry)
            changed |= {(entry.kind, entry.key) for entry in taken}
            if found:
                self.entries.put(Entry(IMPORTED.name, kind.name, len(taken), time.time()))
                logger.info("%d %s entries read once from the previous version's file in %s; it is no longer "
                            "read or written", len(taken), kind.name, self.path.parent)
        return changed

    def _warn_once(self, message: str) -> None:
        if message != self._failed:
            logger.warning("%s", message)
        self._failed = message


class _Locked:
    """The store's lock (a file beside it), held while a process reads, changes and rewrites it."""

    def __init__(self, path: Path) -> None:
        self.lock = path.with_name(f".{path.name}.lock")

    def __enter__(self) -> None:
        self.fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the lock


def _write(path: Path, data: bytes) -> None:
    """The whole file anew, renamed over the old one: a reader sees the old or the new, whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)
