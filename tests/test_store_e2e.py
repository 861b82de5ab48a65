"""The store of what the relay learns through `ttft-relay run --workers 2`: a window one worker
learned from a refusal and the cut it made are the other worker's at once, and both survive a
restart of the relay; a request that failed on one worker and was sent again on the other is
one attempt group (one file beside the timing log, `ttft_relay.store`).

A worker is told by the socket it holds (/proc), not by a guess."""

from __future__ import annotations

import time
import uuid

import orjson
import pytest

from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY
from tests.test_first_token_e2e import worker_of
from ttft_relay import store
from ttft_relay.observe import attempts
from ttft_relay.testing import shaped
from ttft_relay.testing.fakes import Behaviour, FakeUpstream
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.harness import RelayWorkers, read_records
from ttft_relay.trim import windows

WINDOW = 60_000
"""The fake's window, in its tokens (a quarter of the body's bytes): the session's requests from
REFUSED on are over it."""
MODEL = "acme-coder-2"
"""A model no table of the relay's names: its window is the provider's word alone."""
REFUSED = 42


def send(conn: HttpConnection, body: dict) -> tuple[int, str]:
    rid = f"store-{uuid.uuid4().hex[:8]}"
    response = conn.request("POST", "/v1/messages", body, {"x-api-key": FAKE_ANTHROPIC_KEY, "x-request-id": rid,
                                                           "anthropic-version": "2023-06-01"})
    response.read()
    return response.status, rid


def owner(conn: HttpConnection, relay: RelayWorkers) -> str:
    """The worker that accepted `conn` (it may take a moment after the connect)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return worker_of(conn, relay)
        except (AssertionError, KeyError):
            assert time.monotonic() < deadline, "no worker accepted the connection"
            time.sleep(0.02)  # polling /proc, bounded by the deadline


def one_connection_per_worker(relay: RelayWorkers) -> list[HttpConnection]:
    """A kept connection on each worker (the kernel gives each new connection to either)."""
    conns: dict[str, HttpConnection] = {}
    for _ in range(40):
        conn = HttpConnection(relay.url())
        worker = owner(conn, relay)
        if worker in conns:
            conn.close()
        else:
            conns[worker] = conn
        if len(conns) == 2:
            return list(conns.values())
    raise AssertionError("every connection went to one worker")


@pytest.mark.slow
def test_two_workers_share_a_learned_window_and_a_cut_at_once_and_both_survive_a_restart(tmp_path):
    log = tmp_path / "timing.jsonl"
    session = [{**body, "model": MODEL, "max_tokens": 8_000}
               for body in shaped.Session(shaped.ANTHROPIC, turns=40).requests()]
    assert all(len(orjson.dumps(body)) // 4 > WINDOW for body in session[REFUSED:REFUSED + 4])
    options = {"relay_timing_log": log, "relay_trim": "true"}
    rids: dict[str, str] = {}
    with FakeUpstream(behaviour=Behaviour(window=WINDOW)) as fake:
        relay = RelayWorkers(fake.base_url, 2, tmp_path, options).start()
        try:
            first, second = one_connection_per_worker(relay)
            before = len(fake.sent)
            status, rids["refused"] = send(first, session[REFUSED])  # refused, learned, resent within it
            assert status == 200
            status, rids["cut"] = send(first, session[REFUSED + 1])  # cut with room for the next turns
            assert status == 200
            status, rids["other worker"] = send(second, session[REFUSED + 2])  # the window and the cut at once
            assert status == 200
            sent = fake.sent[before:]
            assert [s.status for s in sent] == [400, 200, 200, 200], [s.status for s in sent]
            for conn in (first, second):
                conn.close()
        finally:
            relay.stop()
        kept = store.SharedStore(tmp_path / store.FILE_NAME, [windows.KIND], read_only=True)
        kept.refresh()
        (window,) = windows.learned_in(tmp_path / store.FILE_NAME)
        assert (window.model, window.max_input, window.confirmed) == (MODEL, WINDOW, None)
        (entry,) = kept.entries.entries(windows.KIND_NAME)
        assert entry.reply == "400 invalid_request_error" and entry.by == window.key and entry.by
        assert FAKE_ANTHROPIC_KEY not in (tmp_path / store.FILE_NAME).read_text()

        restarted = RelayWorkers(fake.base_url, 2, tmp_path, options).start()
        try:
            conn = HttpConnection(restarted.url())
            before = len(fake.sent)
            status, rids["restarted"] = send(conn, session[REFUSED + 3])
            assert status == 200 and [s.status for s in fake.sent[before:]] == [200]  # no second refusal
            conn.close()
        finally:
            restarted.stop()
        received = [orjson.loads(r.body) for r in fake.received[-3:]]  # cut, on the other worker, restarted
    by_id = {r["request_id"]: r for r in read_records(log)}
    trims = {name: by_id[rid]["trim"] for name, rid in rids.items()}
    assert {name: t["budget_source"] for name, t in trims.items()} == dict.fromkeys(rids, "learned"), trims
    assert trims["refused"]["refused"]["resent"] is True
    # The cut worker one made: the other worker's and, after a restart, the next relay's.
    assert [trims[name]["plan"] for name in ("other worker", "restarted")] == ["kept", "kept"], trims
    cut, on_other, after_restart = received
    for earlier, later in ((cut, on_other), (on_other, after_restart)):
        assert shaped.prefix_share(shaped.ANTHROPIC, earlier, later) >= 0.9


def test_two_workers_see_one_attempt_group(tmp_path):
    # A request fails on one worker; the client sends it again on a new connection, which the
    # kernel gives to the other worker: its record joins the first one's group (the store,
    # not a table of the previous version's, `.ttft-relay.attempts`).
    log = tmp_path / "timing.jsonl"
    payload = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "warm up"}]}
    auth = {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "session_id": "s1"}

    def post(conn: HttpConnection, rid: str, body: dict, status: int = 200) -> None:
        response = conn.request("POST", "/v1/chat/completions", body,
                                auth | {"x-request-id": rid, "x-fake-status": str(status)})
        response.read()
        assert response.status == status

    with FakeUpstream() as fake:
        relay = RelayWorkers(fake.base_url, 2, tmp_path, {"relay_timing_log": log, "relay_trim": "false"}).start()
        try:
            first, second = one_connection_per_worker(relay)
            post(first, "failed", payload, 500)
            deadline = time.monotonic() + 10
            held = store.SharedStore(tmp_path / store.FILE_NAME, [attempts.KIND], read_only=True)
            while not held.refresh():
                assert time.monotonic() < deadline, "the failed attempt never reached the store"
                time.sleep(0.02)  # polling the file, bounded by the deadline
            (group,) = held.entries.entries(attempts.KIND_NAME)
            post(second, "unrelated", {**payload, "messages": [{"role": "user", "content": "other"}]})
            post(second, "retry", payload)
            for conn in (first, second):
                conn.close()
        finally:
            relay.stop()
    by_id = {r["request_id"]: r for r in read_records(log)}
    failed, unrelated, retry = by_id["failed"], by_id["unrelated"], by_id["retry"]
    assert (failed["attempt_group"], failed["attempt"]) == (failed["id"], 1)
    assert (retry["attempt_group"], retry["attempt"]) == (failed["id"], 2)
    assert unrelated["attempt_group"] is None
    assert group.value[:2] == [failed["id"], 1] and group.by  # the access key's digest, never the key
    assert FAKE_OPENAI_KEY not in (tmp_path / store.FILE_NAME).read_text()
    assert not (tmp_path / attempts.LEGACY_FILE).exists()
    held.refresh()
    assert held.entries.entries(attempts.KIND_NAME) == []  # the retry succeeded: the group closed
