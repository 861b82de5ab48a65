"""Attempt groups in the relay's store (`ttft_relay.observe.attempts`, kind "attempt"): every
process logging into one directory sees one group, a group no retry can join leaves the file,
and the previous version's table (`.ttft-relay.attempts`) is read into the store once."""

from __future__ import annotations

import asyncio
import struct
import time
import zlib

from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tflow

from tests.test_observe import attempt_record
from ttft_relay import apis, state, store
from ttft_relay.flows import client_key, note_client_key
from ttft_relay.observe import attempts
from ttft_relay.timing import record

ACCESS_KEY = "sk-relay-test-key"
OLD_SLOT = struct.Struct(">B16sHddB")
"""A slot of the previous version's table (its format, frozen): filled, key digest, attempt,
started, ended, failed; the group id's length and the id; a CRC32 of the rest in its last 4 bytes."""


def old_slot(a: attempts.Attempt) -> bytes:
    group = a.group.encode("utf-8", "replace")[:attempts.GROUP_MAX]
    body = OLD_SLOT.pack(1, a.key, min(a.attempt, 0xFFFF), a.started, a.ended, a.failed) + bytes((len(group),)) + group
    body = body.ljust(attempts.SLOT_SIZE - 4, b"\0")
    return body + zlib.crc32(body).to_bytes(4, "big")


def request_flow(body: bytes = b'{"model": "m"}', session: str = "s1") -> http.HTTPFlow:
    flow = tflow.tflow()
    flow.request.method, flow.request.path, flow.request.content = "POST", "/v1/chat/completions", body
    flow.request.headers["session_id"] = session
    note_client_key(flow, [ACCESS_KEY])
    return flow


def key_of(flow: http.HTTPFlow) -> bytes:
    """The request key `AttemptGroups.observe` reads the flow by."""
    who = attempts.sender(client_key(flow), flow.client_conn.peername[0])
    return attempts.request_key(who, attempts.conversation(flow.request.headers), flow.request.method,
                                flow.request.path, flow.request.raw_content)


def process_on(path) -> attempts.AttemptGroups:
    """A relay process's attempt groups on the store at `path` (as `configure` makes them)."""
    groups = attempts.AttemptGroups()
    groups.shared = store.SharedStore(path, [attempts.KIND])
    return groups


def held_in(path) -> list[store.Entry]:
    """The open groups the store at `path` holds, read as the report reads them."""
    reader = store.SharedStore(path, [attempts.KIND], read_only=True)
    reader.refresh()
    return reader.entries.entries(attempts.KIND_NAME)


def test_two_processes_on_one_log_see_one_attempt_group(tmp_path):
    path = tmp_path / store.FILE_NAME
    one, other = process_on(path), process_on(path)
    now = time.time()
    first = one.observe(attempt_record("a1", now - 10, cut=True, total_ms=2_000), request_flow())
    assert (first.attempt_group, first.attempt) == ("a1", 1)
    one._sync(one.shared)  # the pass its thread runs: written at once
    other._sync(other.shared)  # read, as when the retry's head arrived
    retry = other.observe(attempt_record("b1", now - 5, cut=True, total_ms=1_000), request_flow())
    assert (retry.attempt_group, retry.attempt) == ("a1", 2)
    other._sync(other.shared)
    one._sync(one.shared)
    again = one.observe(attempt_record("a2", now - 2, cut=False, total_ms=500), request_flow())
    assert (again.attempt_group, again.attempt) == ("a1", 3)
    # The success closed the group in the file too: the same request is a new one everywhere.
    one._sync(one.shared)
    other._sync(other.shared)
    assert other.shared.entries.entries(attempts.KIND_NAME) == []
    anew = other.observe(attempt_record("b2", now - 1, cut=True, total_ms=100), request_flow())
    assert (anew.attempt_group, anew.attempt) == ("b2", 1)
    other._sync(other.shared)
    (held,) = held_in(path)
    assert held.value[:2] == ["b2", 1] and held.by == client_key(request_flow()) and held.by
    assert ACCESS_KEY not in path.read_text()
    assert not (tmp_path / attempts.LEGACY_FILE).exists()  # the previous version's table is not written


def test_another_session_or_key_does_not_join_the_group(tmp_path):
    groups = process_on(tmp_path / store.FILE_NAME)
    now = time.time()
    groups.observe(attempt_record("a1", now - 10, cut=True, total_ms=1_000), request_flow())
    other_session = groups.observe(attempt_record("b", now - 5, cut=False, total_ms=100), request_flow(session="s2"))
    other_key = request_flow()
    note_client_key(other_key, ["sk-another-key"])
    other_sender = groups.observe(attempt_record("c", now - 4, cut=False, total_ms=100), other_key)
    assert other_session.attempt is None and other_sender.attempt is None


def test_the_previous_versions_table_is_read_into_the_store_once(tmp_path):
    now = time.time()
    retried, closed = request_flow(), request_flow(b'{"model": "other"}')
    table = bytearray(attempts.SLOTS * attempts.SLOT_SIZE)
    for n, a in enumerate([attempts.Attempt(key_of(retried), "old-1", 2, now - 70, now - 10, True),
                           attempts.Attempt(key_of(closed), "old-2", 3, now - 70, now - 60, False),  # succeeded
                           attempts.Attempt(bytes(range(16)), "old-3", 1, now - 2 * attempts.WINDOW_S,
                                            now - attempts.WINDOW_S - 5, True)]):  # no retry can join it
        table[n * attempts.SLOT_SIZE:(n + 1) * attempts.SLOT_SIZE] = old_slot(a)
    old = tmp_path / attempts.LEGACY_FILE
    old.write_bytes(bytes(table))
    path = tmp_path / store.FILE_NAME

    worker = process_on(path)
    worker._sync(worker.shared)
    assert [e.value[0] for e in worker.shared.entries.entries(attempts.KIND_NAME)] == ["old-1"]
    assert worker.shared.entries.peek(store.IMPORTED.name, attempts.KIND_NAME).value == 1
    joined = worker.observe(attempt_record("r", now - 5, cut=False, total_ms=100), retried)
    assert (joined.attempt_group, joined.attempt) == ("old-1", 3)
    worker._sync(worker.shared)

    # The table again holds an open group: neither another worker nor a restart reads it again.
    table[:attempts.SLOT_SIZE] = old_slot(attempts.Attempt(key_of(retried), "old-4", 1, now - 9, now - 8, True))
    old.write_bytes(bytes(table))
    for later in (process_on(path), process_on(path)):
        later._sync(later.shared)
        assert later.shared.entries.entries(attempts.KIND_NAME) == []
        assert later.observe(attempt_record("s", now - 1, cut=False, total_ms=100), retried).attempt is None


def test_a_group_no_retry_can_join_leaves_the_store(tmp_path):
    path = tmp_path / store.FILE_NAME
    groups = process_on(path)
    now = time.time()
    stale = attempts.Attempt(bytes(16), "stale", 1, now - attempts.WINDOW_S - 60, now - attempts.WINDOW_S - 1, True)
    fresh = attempts.Attempt(bytes(range(16)), "fresh", 1, now - 5, now - 4, True)
    for a in (stale, fresh):
        groups.shared.entries.put(attempts.entry(a))
    asyncio.run(groups.sync())  # written, then the stale one dropped
    asyncio.run(groups.sync())  # and the drop written
    text = path.read_text()
    assert fresh.key.hex() in text and stale.key.hex() not in text
    # A stale line (an old file, a process that stopped) is not read either.
    path.write_bytes(attempts.entry(stale).encode() + b"\n" + attempts.entry(fresh).encode() + b"\n")
    assert [e.value[0] for e in held_in(path)] == ["fresh"]


def test_an_entry_the_relay_could_not_have_kept_is_not_read():
    now = time.time()
    good = attempts.entry(attempts.Attempt(bytes(range(16)), "g", 1, now - 2, now - 1, True))
    assert attempts.KIND.valid(good)
    for key, value in ((good.key.upper(), good.value), ("00 " + good.key[3:], good.value),
                       (good.key, ["g", 10 ** 30, now - 2, now - 1]), (good.key, ["g", 0, now - 2, now - 1]),
                       (good.key, ["", 1, now - 2, now - 1]), (good.key, ["g" * 200, 1, now - 2, now - 1]),
                       (good.key, ["g", 1, now, now - 1]), (good.key, ["g", True, now - 2, now - 1]),
                       (good.key, {"group": "g"})):
        assert not attempts.KIND.valid(store.Entry(attempts.KIND_NAME, key, value, now)), (key, value)


@given(key=st.binary(min_size=16, max_size=16), group=st.text(max_size=200), attempt=st.integers(1, 70_000),
       started=st.floats(0, 2e9), took=st.floats(0, 1e6), failed=st.booleans())
def test_a_slot_of_the_previous_table_reads_back_and_a_torn_slot_reads_as_empty(key, group, attempt, started, took,
                                                                               failed):
    a = attempts.Attempt(key, group, attempt, started, started + took, failed)
    data = old_slot(a)
    got = attempts.decode_slot(data)
    assert got is not None and got.key == key and got.attempt == min(attempt, 0xFFFF) and got.failed == failed
    assert group.encode("utf-8", "replace")[:attempts.GROUP_MAX].decode("utf-8", "replace").startswith(
        got.group.rstrip("\ufffd"))
    torn = data[:40] + bytes(8) + data[48:]
    assert torn == data or attempts.decode_slot(torn) is None
    assert attempts.decode_slot(bytes(attempts.SLOT_SIZE)) is None


def test_a_record_waits_for_the_read_its_requests_head_asked_for(tmp_path):
    # Another process saw the request fail; its retry here is answered before the pass its head
    # asked for has read the store. Its record waits for that pass, and finds the group.
    path = tmp_path / store.FILE_NAME
    one, other = process_on(path), process_on(path)
    now = time.time()
    one.observe(attempt_record("a1", now - 10, cut=True, total_ms=2_000), request_flow())
    one._sync(one.shared)

    async def retried_here() -> tuple[bool, record.Learned]:
        reads = asyncio.Event()
        sync = other.sync

        async def held_sync() -> None:
            await reads.wait()  # the read is slower than the upstream's answer
            await sync()

        other.sync = held_sync  # type: ignore[method-assign]
        await other.running()
        try:
            flow = request_flow()
            state.attach(flow, state.FlowState(api=apis.get(apis.OPENAI_CHAT)))
            other.requestheaders(flow)
            waiting = other.pending(flow)
            assert waiting is not None
            waits = asyncio.ensure_future(waiting)
            await asyncio.sleep(0)
            was_waiting = not waits.done()
            reads.set()
            await asyncio.wait_for(waits, 5)
            assert other.pending(flow) is None  # asked once per request
            return was_waiting, other.observe(attempt_record("b1", now - 5, cut=False, total_ms=100), flow)
        finally:
            other.done()

    was_waiting, retry = asyncio.run(retried_here())
    assert was_waiting
    assert (retry.attempt_group, retry.attempt) == ("a1", 2)


def test_a_request_without_the_stores_syncer_does_not_wait():
    groups = attempts.AttemptGroups()  # no timing log: no store to read
    flow = request_flow()
    state.attach(flow, state.FlowState(api=apis.get(apis.OPENAI_CHAT)))
    groups.requestheaders(flow)
    assert groups.pending(flow) is None
