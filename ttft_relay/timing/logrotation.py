"""Rotation of the timing log, by size or by time, with retention: a log that can run for months.

The writer thread (`record.RecordWriter`) asks `Rotation.due` before each record it
appends and, when it is due, renames the log to `<name>.<UTC time>` and opens a
new one, so a record is never split between two files. A background thread then
compresses the rotated file to `.gz` and deletes the oldest rotated files beyond
`keep`. `ttft-relay report 'logs/timing*.jsonl*'` reads current, rotated and
compressed files alike.

Where several processes write one log (the workers of `ttft-relay run --workers N`),
each writer decides under a lock the others take too, from the size and time of the
file at the log's path: one of them rotates, and the others write to the new file
from their next record on (`RecordWriter`'s docstring).

logrotate works too (rename, then SIGHUP: `ttft_relay/reload.py` reopens the log; the
writers also find the renamed log on their own at their next record); use one or the
other, not both.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
STAMP_FORMAT = "%Y%m%dT%H%M%S"
COMPRESSED_SUFFIX = ".gz"


def parse_duration(text: str) -> int:
    """"90s", "30m", "6h", "1d" → seconds; "" or "0" → 0 (off)."""
    text = text.strip()
    if text in ("", "0"):
        return 0
    if not (m := _DURATION.match(text)):
        raise ValueError(f"expected a duration like 30m, 6h or 1d, got {text!r}")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


@dataclass(frozen=True)
class Rotation:
    """When the log rotates and how many rotated files stay (pure policy)."""

    max_bytes: int = 0
    """Rotate before a record that would take the log past this size; 0: never by size."""
    every_s: int = 0
    """Rotate when a record arrives in another UTC period of this length (1d: at midnight
    UTC) than the log's last write; 0: never by time."""
    keep: int = 0
    """Rotated files kept, newest first; 0: all."""

    @property
    def active(self) -> bool:
        return bool(self.max_bytes or self.every_s)

    def due(self, size: int, incoming: int, last_write: float, now: float) -> bool:
        """Whether to rotate a log of `size` bytes, last written at `last_write`,
        before appending `incoming` bytes at `now`. An empty log never rotates."""
        if size == 0:
            return False
        if self.max_bytes and size + incoming > self.max_bytes:
            return True
        return bool(self.every_s) and int(now // self.every_s) != int(last_write // self.every_s)


def rotated_name(path: Path, now: float, taken: set[str]) -> Path:
    """`timing.jsonl` → `timing.jsonl.20261201T083700.250Z` (plus `-N` when that name, or
    its compressed form, is taken: several rotations within one millisecond)."""
    base = f"{path.name}.{time.strftime(STAMP_FORMAT, time.gmtime(now))}.{int(now * 1000) % 1000:03d}Z"
    name, n = base, 1
    while name in taken or name + COMPRESSED_SUFFIX in taken:
        n += 1
        name = f"{base}-{n}"
    return path.with_name(name)


def rotated_pattern(path: Path) -> re.Pattern[str]:
    """Names this module gives `path`'s rotated files (not logrotate's)."""
    return re.compile(re.escape(path.name) + r"\.\d{8}T\d{6}\.\d{3}Z(-\d+)?(\.gz)?$")


def expired(rotated: list[tuple[float, str]], keep: int) -> list[str]:
    """Of the rotated files as (mtime, name), those beyond the `keep` newest."""
    if keep <= 0:
        return []
    newest_first = sorted(rotated, reverse=True)
    return [name for _, name in newest_first[keep:]]


# --- file work (the writer's threads) -----------------------------------------------------


def rotate(path: Path, now: float) -> Path:
    """Rename the log to its rotated name (under the writers' lock); returns that name."""
    taken = {p.name for p in path.parent.glob(path.name + ".*")}
    target = rotated_name(path, now, taken)
    os.rename(path, target)
    return target


def compress(path: Path) -> Path:
    """`path` → `path.gz` (same mtime), then `path` removed. The partial file has a
    hidden name, so a reader's glob never sees half a file."""
    target = path.with_name(path.name + COMPRESSED_SUFFIX)
    partial = path.with_name(f".{target.name}.partial")
    with open(path, "rb") as src, gzip.open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    stat = path.stat()
    os.utime(partial, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(partial, target)
    # Another writer of the log may have expired it meanwhile (a small `keep`): its
    # compressed copy goes with the next expiry.
    path.unlink(missing_ok=True)
    return target


def remove_expired(path: Path, keep: int) -> list[str]:
    """Delete `path`'s rotated files beyond the `keep` newest; returns their names."""
    pattern = rotated_pattern(path)
    rotated = [(p.stat().st_mtime, p.name) for p in path.parent.iterdir() if pattern.match(p.name)]
    names = expired(rotated, keep)
    for name in names:
        (path.parent / name).unlink(missing_ok=True)
    return names
