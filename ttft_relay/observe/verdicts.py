"""Verdicts against what the relay learned: the first token a prompt predicts, and prompt cache misses.

Every record is judged (`record.judge`) with what this addon learned from the records
before it: per upstream · model, the upstream's own wait as a function of the prompt's
uncached and cached tokens (`prefill.PrefillRates`), and per conversation whether the
provider had cached its prefix (`conversations.Conversations`). So a long wait reads
`context length` when the prompt explains it (how many tokens, at what ms per 1k),
`upstream queueing` when it is N times what the prompt predicts, `prompt cache miss` when
a repeated prefix was read uncached, and `ok` when it is in line. Then the record's own
sample is learned, unless it failed or is a handshake or prewarm.

The samples persist in a state file in the timing log's directory
(`.ttft-relay.learned`, JSON): loaded when the log is configured, and merged with it
(under an exclusive lock: read, union, write) every SAVE_EVERY_S in a thread and when the
relay stops. Every process logging into that directory (each worker of `ttft-relay run
--workers N`, whether the workers write one log or one each) does the same, so each
learns from all within a minute, and a restart starts from what was learned. Seeded by
nothing but the traffic: a new relay says `upstream wait (prefill/queue)` and how much it
still has to learn until MIN_SAMPLES requests of an upstream · model have been seen.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from mitmproxy import ctx, http

from .. import state
from ..timing import record
from . import conversations, prefill

logger = logging.getLogger(__name__)

SAVE_EVERY_S = 60.0


def state_path(log: Path) -> Path:
    """The state every relay process logging into `log`'s directory shares."""
    return log.with_name(".ttft-relay.learned")


def merge_into(path: Path, samples: Mapping[str, list[prefill.Sample]]) -> dict[str, list[prefill.Sample]]:
    """Merge `samples` with the state file's, write the union back, return it (blocking IO)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        merged = prefill.merge(prefill.decode(os.pread(fd, size, 0) if size else b""), samples)
        data = prefill.encode(merged)
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        return merged
    finally:
        os.close(fd)  # and with it the lock


class Verdicts:
    """Judges each record against the first token its prompt predicts, and learns from it."""

    def __init__(self) -> None:
        self.rates = prefill.PrefillRates()
        self.conversations = conversations.Conversations()
        self.path: Path | None = None
        self.last_save = time.monotonic()
        self.saving: asyncio.Future | None = None

    def configure(self, updated: set[str]) -> None:
        if "relay_timing_log" not in updated:
            return
        log = ctx.options.relay_timing_log
        path = state_path(Path(log)) if log else None
        if path == self.path:
            return
        self.path = path
        if path is not None:
            self._merge_now()

    def done(self) -> None:
        self._merge_now()

    def _merge_now(self) -> None:
        if self.path is None:
            return
        try:
            self.rates.merge(merge_into(self.path, self.rates.snapshot()))
        except OSError as e:
            logger.warning("learned first-token rates not kept in %s: %s", self.path, e)

    def _merge_later(self) -> None:
        """In a thread: merge with the state file, then take in what the others learned."""
        if self.path is None or (self.saving is not None and not self.saving.done()):
            return
        self.last_save = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        path, snapshot = self.path, self.rates.snapshot()
        self.saving = loop.run_in_executor(None, merge_into, path, snapshot)
        self.saving.add_done_callback(self._merged)

    def _merged(self, done: asyncio.Future) -> None:
        try:
            self.rates.merge(done.result())
        except OSError as e:
            logger.warning("learned first-token rates not kept in %s: %s", self.path, e)

    def timing_observe(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        if rec.error or rec.client_aborted:
            return  # its verdict is where it failed, whatever was learned
        key = prefill.model_key(rec.upstream, rec.model)
        prompt = prefill.prompt_of(rec.usage, rec.prompt_tokens)
        if rec.prewarm or record.is_handshake(rec.transport, rec.turn):
            expectation, unlearned = None, None
        elif "first_token" not in rec.marks:
            expectation, unlearned = None, "an answer not streamed: the upstream's wait holds all of it"
        else:
            expectation, unlearned = self.rates.expect(key, prompt)
        record.judge(rec, expectation=expectation, unlearned=unlearned, cache_miss=self._cache_miss(rec, flow))
        if (sample := prefill.sample_of(rec.as_dict())) is not None:
            self.rates.add(key, sample)
        if time.monotonic() - self.last_save >= SAVE_EVERY_S:
            self._merge_later()

    def _cache_miss(self, rec: record.Record, flow: http.HTTPFlow) -> str | None:
        st = state.get(flow)
        if rec.turn or st is None or st.request_json is None or (st.trim or {}).get("trimmed"):
            return None
        peer = flow.client_conn.peername
        return self.conversations.step(st.api, st.request_json, client=str(peer[0]) if peer else "",
                                       model=rec.model, usage=rec.usage, ts=rec.ts)
