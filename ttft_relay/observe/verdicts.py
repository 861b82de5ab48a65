"""Verdicts against what the relay learned: the first token a prompt predicts, and prompt cache misses.

Every record is judged (`record.judged`, once, by `Timing`) with what this addon learned from
the records before it (its `observe` says it): per first-token line (upstream · model · the request's prefill traits, as its
API reads them: `prefill.model_key`), the upstream's own wait as a function of the
prompt's uncached and cached tokens (`prefill.PrefillRates`), and per conversation whether
the provider had cached its prefix (`conversations.Conversations`). So a long wait reads
`context length` when the prompt explains it (how many tokens, at what ms per 1k),
`upstream queueing` when it is N times what the prompt predicts, `prompt cache miss` when
a repeated prefix was read uncached, and `ok` when it is in line. Then the record's own
sample is learned (with its source: `state.source_of`), unless it failed or is a handshake
or prewarm.

Every relay process logging into one directory (each worker of `ttft-relay run --workers
N`, a restarted relay) shares the lines through the relay's store (`ttft_relay.store`, the
file beside the timing log; kind "first-token", one entry per line: its samples, as
`prefill.line_value`): every SYNC_EVERY_S, in a thread (never on the event loop), a
process puts the lines it learned on into the store and takes in the samples the others
learned (two processes' words on one line are merged as one line keeps samples: each
source a bounded share), so what one worker learns every worker uses within moments, and
a restart starts from what was learned. The previous version's `.ttft-relay.first-token`
is read into the store once. Seeded by nothing but the traffic: while a line is being
learned a request is `ok` unless its wait is out of line with what the line's first
requests took (`phases.judge`'s `learning`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from mitmproxy import ctx, http

from .. import state, store
from ..timing import record
from . import conversations, prefill

logger = logging.getLogger(__name__)

SYNC_EVERY_S = 0.2
"""How often a process puts what it learned into the store and takes in the others' words."""
KIND_NAME = "first-token"
"""The lines' kind in the store."""
LEGACY_FILE = ".ttft-relay.first-token"
"""Where the previous version kept the samples, beside the timing log: read once into the store."""
LEGACY_READ_MAX = 8 << 20
"""Of the previous version's file only its last this many bytes are read (it rewrote it past 4 MiB)."""


def _entry(key: str, line: prefill.Line) -> store.Entry:
    """A line as the store keeps it: learned when its newest sample was."""
    return store.Entry(KIND_NAME, key, prefill.line_value(line), line.samples[-1][0] if line.samples else 0.0)


def _merge(theirs: store.Entry, mine: store.Entry) -> store.Entry:
    return store.Entry(KIND_NAME, mine.key, prefill.merged_line(theirs.value, mine.value), max(theirs.ts, mine.ts))


def _legacy(directory: Path) -> list[store.Entry]:
    """The lines the previous version's processes shared through `.ttft-relay.first-token`."""
    path = directory / LEGACY_FILE
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - LEGACY_READ_MAX))
        data = f.read(LEGACY_READ_MAX)
    rates = prefill.PrefillRates()
    for _, row in prefill.decode_rows(data):
        rates.add(*row)
    return [_entry(key, line) for key, line in rates.lines.items()]


def _valid(entry: store.Entry) -> bool:
    return len(entry.key) <= prefill.KEY_MAX and prefill.line_of(entry.value) is not None


KIND = store.Kind(KIND_NAME, prefill.MAX_MODELS, valid=_valid,
                  rank=lambda entry: len(entry.value["samples"]) >= prefill.MIN_SAMPLES,
                  merge=_merge, legacy=_legacy)
"""First-token lines in the store: lines still learning evicted before proven ones."""


def learned_lines(path: Path) -> list[store.Entry]:
    """The first-token lines the store at `path` holds, read only (the report, the metrics)."""
    shared = store.SharedStore(path, [KIND], read_only=True)
    shared.refresh()
    return shared.entries.entries(KIND_NAME)


class Verdicts:
    """Says what first token each record's prompt predicts and whether it missed the prompt
    cache (one of `Timing`'s observers: its verdict is judged against them), and learns from it."""

    def __init__(self) -> None:
        self.rates = prefill.PrefillRates()
        self.conversations = conversations.Conversations()
        self.shared: store.SharedStore | None = None
        self.changed: set[str] = set()
        """The lines learned on here since they were last put into the store."""
        self.syncer: asyncio.Task | None = None

    def configure(self, updated: set[str]) -> None:
        if "relay_timing_log" not in updated:
            return
        log = ctx.options.relay_timing_log
        path = Path(log).with_name(store.FILE_NAME) if log else None
        if path == (self.shared.path if self.shared else None):
            return
        self.shared = store.SharedStore(path, [KIND]) if path else None
        self.changed = set(self.rates.lines) if path else set()

    async def running(self) -> None:
        if self.syncer is None:
            self.syncer = asyncio.create_task(self._keep_syncing(), name="ttft-relay first-token lines")

    def done(self) -> None:
        if self.syncer is not None:
            self.syncer.cancel()
            self.syncer = None
        if self.shared is not None:
            self._put_changed(self.shared)
            self.shared.sync()  # the relay is stopping: nothing else waits on the loop

    async def _keep_syncing(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(SYNC_EVERY_S)

    def _put_changed(self, shared: store.SharedStore) -> None:
        for key in self.changed:
            if (line := self.rates.lines.get(key)) is not None:
                shared.entries.put(_entry(key, line))
        self.changed = set()

    async def sync(self) -> None:
        """Put the lines learned on here into the store and take in the others' (the file work in a thread)."""
        shared = self.shared
        if shared is None:
            return
        self._put_changed(shared)
        changed = await asyncio.to_thread(shared.sync)
        if shared is not self.shared:
            return  # the log moved meanwhile
        for kind, key in changed:
            if kind == KIND_NAME and (entry := shared.entries.peek(KIND_NAME, key)) is not None:
                self._take(key, entry.value)

    def _take(self, key: str, value: Any) -> None:
        if (line := prefill.line_of(value)) is not None:
            self.rates.take(key, *line)

    def pending(self, flow: http.HTTPFlow) -> None:
        """Nothing: the lines and windows are this process's and the store's as last read."""
        return None

    def observe(self, rec: record.Record, flow: http.HTTPFlow) -> record.Learned:
        if rec.error or rec.client_aborted:
            return record.NOTHING_LEARNED  # its verdict is where it failed, whatever was learned
        st = state.get(flow)
        key = prefill.model_key(rec.upstream, rec.model, st.prefill_traits if st is not None else "")
        prompt = prefill.prompt_of(rec.usage, rec.prompt_tokens)
        if rec.prewarm or record.is_handshake(rec.transport, rec.turn):
            prediction = prefill.Prediction(None, None, False)
        elif "first_token" not in rec.marks:
            prediction = prefill.Prediction(None, "an answer not streamed: the upstream's wait holds all of it", False)
        else:
            prediction = self.rates.expect(key, prompt)
        learned = record.Learned(expectation=prediction.expectation, unlearned=prediction.unlearned,
                                 learning=prediction.learning, cache_miss=self._cache_miss(rec, flow))
        if (sample := prefill.sample_of(rec.as_dict(), state.source_of(flow))) is not None:
            if self.rates.add(key, rec.upstream or "?", sample) and self.shared is not None:
                self.changed.add(key[:prefill.KEY_MAX])
        return learned

    def _cache_miss(self, rec: record.Record, flow: http.HTTPFlow) -> str | None:
        st = state.get(flow)
        if rec.turn or st is None or st.request_json is None or (st.trim or {}).get("trimmed"):
            return None
        peer = flow.client_conn.peername
        return self.conversations.step(st.api, st.request_json, client=str(peer[0]) if peer else "",
                                       model=rec.model, usage=rec.usage, ts=rec.ts)
