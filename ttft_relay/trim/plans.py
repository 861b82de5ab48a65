"""Conversations' cuts kept across restarts and shared by workers (`KeptPlans`).

A conversation's plan (`trimming.Plan`: where its cut is) is what keeps its prompt-cache
prefix from one request to the next. Kept only in one process's memory, it is lost on a
restart and unknown to the other workers: the conversation's next request there makes a
new cut — a different prefix, a full-prompt cache miss, and (cut at that request's own
growth) a different depth. `KeptPlans` is the `PlanCache` the trim addon uses: it appends
every new plan to a file beside the timing log (`trim-plans.jsonl`, one short JSON line
each, one write with O_APPEND, so the workers' lines never mix) and reads what the other
processes appended before it looks a plan up, so after a restart, or on another worker,
the same conversation gets the same cut.

The file holds plans, not text: a conversation key and an anchor are digests. It stays
bounded: past `MAX_BYTES` the process that notices rewrites it with the plans it holds
(at most the cache's size) and renames it into place; the others see a new file and
read it anew. A line appended by another worker while that happens may be lost: that
conversation makes one new cut, as without the file.

File work is done by `refresh` and `save`, which the addon calls in its worker thread,
never on the event loop.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson

from .trimming import Plan, PlanCache

logger = logging.getLogger(__name__)

FILE_NAME = "trim-plans.jsonl"
"""Beside the timing log: the plans of the relay processes on that log."""

MAX_BYTES = 2 * 1024 * 1024
"""The file is rewritten with the plans held once it grows past this (a plan is ~130 bytes)."""

MAX_LINE = 512
"""A longer line is not one the relay wrote: skipped."""


class KeptPlans(PlanCache):
    """A `PlanCache` kept in `path` (None: in memory only) and shared with the processes
    appending to it."""

    def __init__(self, path: Path | None = None, maxsize: int = 4096) -> None:
        super().__init__(maxsize)
        self.path = path
        self._unsaved: list[tuple[bytes, Plan]] = []
        self._read_to = 0
        self._inode: int | None = None

    def put(self, key: bytes, plan: Plan) -> None:
        super().put(key, plan)
        if self.path is not None:
            self._unsaved.append((key, plan))

    @property
    def unsaved(self) -> bool:
        return bool(self._unsaved)

    def save(self) -> None:
        """Append the plans made since the last save (one write); rewrite the file if it is too big."""
        if self.path is None or not self._unsaved:
            return
        data = b"".join(_line(key, plan) for key, plan in self._unsaved)
        self._unsaved.clear()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, data)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size > MAX_BYTES:
                self._rewrite()
        except OSError as e:
            logger.warning("cannot keep trim plans in %s (%s): this process alone knows them", self.path, e)

    def refresh(self) -> None:
        """Read what was appended since the last read (a stat when nothing was)."""
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if st.st_ino != self._inode or st.st_size < self._read_to:  # rewritten: read it anew
            self._inode, self._read_to = st.st_ino, 0
        if st.st_size == self._read_to:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                data = f.read(min(st.st_size - self._read_to, 2 * MAX_BYTES))
        except OSError as e:
            logger.warning("cannot read trim plans in %s: %s", self.path, e)
            return
        complete = data.rfind(b"\n") + 1  # a line being appended right now is read next time
        self._read_to += complete
        mine = {key for key, _ in self._unsaved}  # newer than any line of theirs
        for line in data[:complete].splitlines():
            if (found := _parse(line)) is not None and found[0] not in mine:
                PlanCache.put(self, *found)

    def _rewrite(self) -> None:
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(_line(key, plan) for key, plan in self._plans.items()))
        os.replace(tmp, self.path)
        st = os.stat(self.path)
        self._inode, self._read_to = st.st_ino, st.st_size  # what it holds is known here


def _line(key: bytes, plan: Plan) -> bytes:
    return orjson.dumps({"key": key.hex(), "shrunk": plan.shrunk, "cut": plan.cut, "anchor": plan.anchor.hex(),
                         "rounds_to": plan.rounds_to}) + b"\n"


def _parse(line: bytes) -> tuple[bytes, Plan] | None:
    if not line or len(line) > MAX_LINE:
        return None
    try:
        obj = orjson.loads(line)
        key, anchor = bytes.fromhex(obj["key"]), bytes.fromhex(obj["anchor"])
        numbers = obj["shrunk"], obj["cut"], obj["rounds_to"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        return None
    return key, Plan(numbers[0], numbers[1], anchor, numbers[2])
