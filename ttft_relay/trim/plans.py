"""Conversations' cuts kept across restarts and shared by workers (`KeptPlans`).

A conversation's plan (`policy.Plan`: where its cut is) is what keeps its prompt-cache
prefix from one request to the next. Kept only in one process's memory, it is lost on a
restart and unknown to the other workers: the conversation's next request there makes a
new cut — a different prefix, a full-prompt cache miss, and (cut at that request's own
growth) a different depth. `KeptPlans` is the `PlanCache` the trim addon uses: it keeps
every plan in the relay's store (`ttft_relay.store`, kind "plan": the file beside the
timing log every worker shares), so after a restart, or on another worker, the same
conversation gets the same cut.

The store holds plans, not text: a conversation key and an anchor are digests; with each,
when it was made and the digest of the access key whose request made it. It stays bounded:
past MAX_PLANS plans, the least recently used go. The previous version's
`trim-plans.jsonl` is read into the store once.

File work is done by `refresh` and `save`, which the addon calls in its worker thread,
never on the event loop.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TypeGuard

import orjson

from .. import store
from .policy import MOST_SHRUNK_SPANS, Plan, PlanCache, Spans

KIND_NAME = "plan"
"""The plans' kind in the store."""
LEGACY_FILE = "trim-plans.jsonl"
"""Where the previous version kept them, beside the timing log: read once into the store."""

MAX_PLANS = 4096
"""Conversations whose plan is kept (a plan takes about 150 bytes of the file)."""
LEGACY_MAX_BYTES = 4 * 1024 * 1024
"""Of the previous version's file only this much is read (it rewrote it past 2 MiB)."""


def _value(plan: Plan) -> list:
    value = [[list(span) for span in plan.shrunk], plan.cut, plan.anchor.hex(), plan.rounds_to]
    return [*value, [list(span) for span in plan.dropped]] if plan.dropped else value


def _index(n: object) -> TypeGuard[int]:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _spans(value: object) -> Spans | None:
    """A plan's shrunk (or dropped) items as stored: ranges, ascending and apart (the previous
    version's plans: one index, the items before it)."""
    if _index(value):
        return ((0, value),) if value else ()
    if not (isinstance(value, list) and len(value) <= MOST_SHRUNK_SPANS):
        return None
    found: list[tuple[int, int]] = []
    for span in value:
        if not (isinstance(span, list) and len(span) == 2 and _index(span[0]) and _index(span[1])):
            return None
        start, end = span
        if not (found[-1][1] if found else 0) <= start < end:
            return None
        found.append((start, end))
    return tuple(found)


def _plan(entry: store.Entry) -> Plan | None:
    """The plan an entry holds, or None if it is not one the relay could have made."""
    value = entry.value
    if not (isinstance(value, list) and len(value) in (4, 5) and isinstance(value[2], str)):
        return None
    shrunk, cut, anchor, rounds_to, *more = value
    spans = _spans(shrunk)
    dropped = (_spans(more[0]) if isinstance(more[0], list) else None) if more else ()
    if spans is None or dropped is None or (more and not dropped) or not (_index(cut) and _index(rounds_to)):
        return None
    try:
        bytes.fromhex(entry.key)
        return Plan(spans, cut, bytes.fromhex(anchor), rounds_to, dropped)
    except ValueError:
        return None


def _legacy(directory: Path) -> list[store.Entry]:
    """The plans the previous version kept in `trim-plans.jsonl` (its lines as it wrote them), the newest per key."""
    path = directory / LEGACY_FILE
    if not path.exists():
        return []
    with open(path, "rb") as f:
        data = f.read(LEGACY_MAX_BYTES)
    found: dict[str, store.Entry] = {}
    for line in data.split(b"\n"):
        try:
            obj = orjson.loads(line) if line else None
            entry = store.Entry(KIND_NAME, obj["key"], [obj["shrunk"], obj["cut"], obj["anchor"], obj["rounds_to"]],
                                0.0) if obj is not None else None
        except (orjson.JSONDecodeError, KeyError, TypeError):
            continue
        if entry is not None and isinstance(entry.key, str) and _plan(entry) is not None:
            found.pop(entry.key, None)
            found[entry.key] = entry
    return list(found.values())[-MAX_PLANS:]


KIND = store.Kind(KIND_NAME, MAX_PLANS, valid=lambda entry: _plan(entry) is not None, legacy=_legacy)


class KeptPlans(PlanCache):
    """A `PlanCache` kept in the store (`shared`: the trim addon's, or a file of its own, or
    None: in memory only) and shared with every process on it. `get` and `put` touch memory
    only; `refresh` and `save` the file."""

    def __init__(self, shared: store.SharedStore | Path | None = None, maxsize: int = MAX_PLANS) -> None:
        super().__init__(maxsize)
        self.shared = (shared if isinstance(shared, store.SharedStore)
                       else store.SharedStore(shared, [dataclasses.replace(KIND, max_entries=maxsize)]))
        self.by = ""
        """The digest of the access key whose request is being trimmed: who made the plans put now."""

    def __len__(self) -> int:
        return len(self.shared.entries.entries(KIND_NAME))

    def get(self, key: bytes) -> Plan | None:
        entry = self.shared.entries.get(KIND_NAME, key.hex())
        return None if entry is None else _plan(entry)

    def put(self, key: bytes, plan: Plan) -> None:
        self.shared.entries.put(store.Entry(KIND_NAME, key.hex(), _value(plan), round(time.time(), 3), self.by))

    @property
    def unsaved(self) -> bool:
        return self.shared.entries.pending

    def save(self) -> None:
        """Write the plans made since the last save (with everything else the store learned here)."""
        self.shared.sync()

    def refresh(self) -> None:
        """Read the plans the other processes made (a stat when they made none)."""
        self.shared.refresh()
