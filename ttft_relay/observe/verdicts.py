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
N`, a restarted relay) shares one file of samples there (`.ttft-relay.first-token`, JSON
lines, `SharedLines`): each appends what it learns and reads what the others appended,
every SYNC_EVERY_S in a thread (never on the event loop), so what one worker learns every
worker uses within moments, and a restart starts from what was learned. Past FILE_MAX
bytes a process rewrites it (atomically: a new file renamed over it) with the samples it
holds now. Seeded by nothing but the traffic: while a line is being learned a request is
`ok` unless its wait is out of line with what the line's first requests took
(`phases.judge`'s `learning`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import stat
import uuid
from pathlib import Path

from mitmproxy import ctx, http

from .. import state
from ..timing import record
from . import conversations, prefill

logger = logging.getLogger(__name__)

SYNC_EVERY_S = 0.2
"""How often a process appends its new samples to the shared file and reads the others'."""
FILE_MAX = 4 << 20
"""Bytes of the shared file before it is rewritten with the samples held now (WINDOW samples
of MAX_MODELS lines take about 1.5 MiB)."""
READ_MAX = 2 * FILE_MAX
"""Bytes of it read at once at most: of a longer file (written by something else), its end."""
PENDING_MAX = 4096
"""Samples kept for the file while it cannot be written."""


def store_path(log: Path) -> Path:
    """The samples every relay process logging into `log`'s directory shares."""
    return log.with_name(".ttft-relay.first-token")


class SharedLines:
    """The shared file of samples as one process sees it (blocking IO: run in a thread).

    Appends take a shared lock, a rewrite an exclusive one: an append never lands in a
    file that a rewrite has just replaced (it checks, under the lock, that its file is
    still the one at the path)."""

    def __init__(self, path: Path, writer: str) -> None:
        self.path, self.writer = path, writer
        self.inode: int | None = None
        self.offset = 0
        """Where the rows not read yet begin (the file at `inode`)."""
        self.size = 0

    def _open(self, lock: int) -> int:
        for _ in range(8):
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(f"{self.path} is not a regular file")
                fcntl.flock(fd, lock)
                if os.stat(self.path).st_ino == st.st_ino:
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # replaced by a rewrite meanwhile: the new one
        raise OSError(f"{self.path} keeps being replaced")

    def _read_new(self, fd: int) -> tuple[bool, bytes]:
        """(whole, rows' bytes): the rows appended since the last read, or, for a file not
        read before (a start, a rewrite), all of them."""
        st = os.fstat(fd)
        whole = st.st_ino != self.inode
        start = 0 if whole else min(self.offset, st.st_size)
        skip_partial = st.st_size - start > READ_MAX
        start = max(start, st.st_size - READ_MAX)
        data = os.pread(fd, st.st_size - start, start)
        if skip_partial:
            cut = data.find(b"\n") + 1
            data, start = data[cut:], start + cut
        data = data[:data.rfind(b"\n") + 1]  # a row still being written is read next time
        self.inode, self.offset, self.size = st.st_ino, start + len(data), st.st_size
        return whole, data

    def sync(self, mine: list[prefill.Row], snapshot: list[prefill.Row] | None = None
             ) -> tuple[bool, list[tuple[str, prefill.Row]]]:
        """Read what was appended since the last sync, then append `mine`; with `snapshot`
        (what this process holds now), rewrite the file with it instead when it is still
        over FILE_MAX. Returns (whole, rows): whole: the rows are the whole file but `mine`
        (start from them, then `mine`), else only the ones appended since."""
        if snapshot is not None and (done := self._rewrite(mine, snapshot)) is not None:
            return done
        fd = self._open(fcntl.LOCK_SH)
        try:
            whole, data = self._read_new(fd)
            if mine:
                os.write(fd, prefill.encode_rows(self.writer, mine))  # O_APPEND: one write, whole rows
                self.size = os.fstat(fd).st_size
        finally:
            os.close(fd)  # and with it the lock
        return whole, prefill.decode_rows(data)

    def _rewrite(self, mine: list[prefill.Row], snapshot: list[prefill.Row]
                 ) -> tuple[bool, list[tuple[str, prefill.Row]]] | None:
        fd = self._open(fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size <= FILE_MAX:
                return None  # another process rewrote it first
            whole, data = self._read_new(fd)
            theirs = prefill.decode_rows(data)
            rows = [row for _, row in theirs] + snapshot if whole else \
                snapshot + [row for writer, row in theirs if writer != self.writer]
            rows = sorted(dict.fromkeys(rows), key=lambda row: row.sample[0])[-prefill.MAX_MODELS * prefill.WINDOW:]
            encoded = prefill.encode_rows(self.writer, rows + mine)
            temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            with open(temporary, "wb") as out:
                out.write(encoded)
            os.chmod(temporary, 0o600)
            os.replace(temporary, self.path)
            st = os.stat(self.path)
            self.inode, self.offset, self.size = st.st_ino, len(encoded), len(encoded)
            return True, [(self.writer, row) for row in rows]
        finally:
            os.close(fd)


def _fetch(shared: SharedLines, mine: list[prefill.Row],
           snapshot: list[tuple[str, str, tuple[prefill.Sample, ...]]] | None
           ) -> tuple[prefill.PrefillRates | None, list[prefill.Row]]:
    """`shared.sync` (in a thread; `snapshot`: the lines held, `PrefillRates.snapshot`): (the
    lines learned from the whole file, []) when it was read whole, else (None, the rows the
    other processes appended since)."""
    whole, rows = shared.sync(mine, None if snapshot is None else prefill.rows_of(snapshot))
    if not whole:
        return None, [row for writer, row in rows if writer != shared.writer]
    rates = prefill.PrefillRates()
    for _, row in rows:
        rates.add(*row)
    return rates, []


class Verdicts:
    """Says what first token each record's prompt predicts and whether it missed the prompt
    cache (one of `Timing`'s observers: its verdict is judged against them), and learns from it."""

    def __init__(self) -> None:
        self.rates = prefill.PrefillRates()
        self.conversations = conversations.Conversations()
        self.shared: SharedLines | None = None
        self.pending: list[prefill.Row] = []
        """Samples learned here, not yet in the shared file."""
        self.syncer: asyncio.Task | None = None
        self.failing: str | None = None

    def configure(self, updated: set[str]) -> None:
        if "relay_timing_log" not in updated:
            return
        log = ctx.options.relay_timing_log
        path = store_path(Path(log)) if log else None
        if path == (self.shared.path if self.shared else None):
            return
        self.shared = SharedLines(path, f"{os.getpid()}-{uuid.uuid4().hex[:8]}") if path else None

    async def running(self) -> None:
        if self.syncer is None:
            self.syncer = asyncio.create_task(self._keep_syncing(), name="ttft-relay first-token lines")

    def done(self) -> None:
        if self.syncer is not None:
            self.syncer.cancel()
            self.syncer = None
        if self.shared is not None and self.pending:
            try:  # the relay is stopping: nothing else waits on the loop
                self.shared.sync(self.pending)
                self.pending = []
            except OSError as e:
                logger.warning("learned first-token lines not kept in %s: %s", self.shared.path, e)

    async def _keep_syncing(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(SYNC_EVERY_S)

    async def sync(self) -> None:
        """Append the samples learned here to the shared file, take in the others' (in a thread)."""
        shared = self.shared
        if shared is None:
            return
        mine, self.pending = self.pending, []
        snapshot = self.rates.snapshot() if shared.size > FILE_MAX else None
        try:
            rebuilt, theirs = await asyncio.to_thread(_fetch, shared, mine, snapshot)
        except OSError as e:
            self.pending = (mine + self.pending)[-PENDING_MAX:]
            if str(e) != self.failing:
                logger.warning("learned first-token lines not shared through %s: %s", shared.path, e)
            self.failing = str(e)
            return
        self.failing = None
        if shared is not self.shared:
            return  # the log moved meanwhile
        if rebuilt is not None:  # a start, or the file was rewritten: start from it, then what was learned since
            self.rates = rebuilt
            theirs = mine + self.pending
        for row in theirs:
            self.rates.add(*row)

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
            row = prefill.Row(key, rec.upstream or "?", sample)
            if self.rates.add(*row) and self.shared is not None:
                self.pending.append(row)
                del self.pending[:-PENDING_MAX]
        return learned

    def _cache_miss(self, rec: record.Record, flow: http.HTTPFlow) -> str | None:
        st = state.get(flow)
        if rec.turn or st is None or st.request_json is None or (st.trim or {}).get("trimmed"):
            return None
        peer = flow.client_conn.peername
        return self.conversations.step(st.api, st.request_json, client=str(peer[0]) if peer else "",
                                       model=rec.model, usage=rec.usage, ts=rec.ts)
