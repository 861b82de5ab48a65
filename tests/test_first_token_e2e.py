"""The learned first-token line through the real relay: with `ttft-relay run --workers 2` the first
requests are not blamed on the provider and what one worker learned the other uses at once (no
minute merge), and one client's slow requests leave every other client's verdicts as they were.

The fake's first token takes PREFILL_MS; a queue holds its head QUEUE_MS. Verdicts are counted,
not timed; a worker is told by the socket it holds (/proc), not by a guess.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import reverse_to
from ttft_relay import store
from ttft_relay.observe import prefill, verdicts
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.ws_client import WebSocketClient
from ttft_relay.testing.harness import RECORD_WAIT_S, RelayWorkers, TimingLog

PREFILL_MS = 160
QUEUE_MS = 800
CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi " * 50}]}
BLAMES_THE_PROVIDER = ("upstream wait (prefill/queue)", "upstream queueing", "context length", "prompt cache miss")


def post(conn: HttpConnection, key: str, rid: str, **knobs: object) -> None:
    headers = {"authorization": f"Bearer {key}", "x-request-id": rid, "x-fake-prefill-ms": str(PREFILL_MS)}
    headers |= {f"x-fake-{k.replace('_', '-')}": str(v) for k, v in knobs.items()}
    response = conn.request("POST", CHAT, BODY, headers)
    assert response.status == 200, response.read()[:300]
    response.read()


def worker_of(conn: HttpConnection, workers: RelayWorkers) -> str:
    """Which worker holds the relay's end of `conn` (its socket, found in /proc)."""
    client_port = conn.sock.getsockname()[1]
    owner = {}
    for name, pid in workers.processes().items():
        for fd in os.listdir(f"/proc/{pid}/fd") if name != "supervisor" else ():
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = name
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote, inode = (fields := line.split())[1], fields[2], fields[9]
            if int(local.rsplit(":", 1)[1], 16) == workers.port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                return owner[inode]
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def samples_in(path: Path) -> int:
    """The first-token samples the store at `path` holds, on every line."""
    return sum(len(line.value["samples"]) for line in verdicts.learned_lines(path))


def wait_until(done, what: str, timeout: float = RECORD_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polling a file the relay writes, bounded by the deadline


def test_two_workers_blame_no_one_while_learning_and_use_each_others_samples_at_once(fake, tmp_path):
    log = tmp_path / "timing.jsonl"
    workers = RelayWorkers(fake.base_url, 2, tmp_path, {"relay_timing_log": log, "relay_trim": "false"}).start()
    conns: dict[str, HttpConnection] = {}
    served = {"worker 1": 0, "worker 2": 0}
    sent: list[tuple[str, str]] = []  # (request id, worker)
    try:
        # One kept connection on each worker (the kernel gives each new connection to either).
        for _ in range(12):
            conn = HttpConnection(workers.url())
            rid = f"first-{uuid.uuid4().hex[:8]}"
            post(conn, "sk-team-0123456789abcdef", rid)
            worker = worker_of(conn, workers)
            served[worker] += 1
            sent.append((rid, worker))
            if worker in conns:
                conn.close()
            else:
                conns[worker] = conn
            if len(conns) == 2:
                break
        assert len(conns) == 2, f"every connection went to one worker: {served}"
        a, b = sorted(conns, key=served.__getitem__, reverse=True)
        # Worker a learns the line alone.
        while served[a] < prefill.MIN_SAMPLES:
            rid = f"a-{uuid.uuid4().hex[:8]}"
            post(conns[a], "sk-team-0123456789abcdef", rid)
            served[a] += 1
            sent.append((rid, a))
        shared = log.with_name(store.FILE_NAME)
        wait_until(lambda: samples_in(shared) >= prefill.MIN_SAMPLES, "worker a's samples in the store")
        # Worker b, which served at most a few itself, judges against the line a learned.
        assert served[b] + 4 < prefill.MIN_SAMPLES, served
        b_ids = []
        for _ in range(4):
            rid = f"b-{uuid.uuid4().hex[:8]}"
            post(conns[b], "sk-team-0123456789abcdef", rid)
            b_ids.append(rid)
            sent.append((rid, b))
        records = {r["request_id"]: r for r in TimingLog(log).wait(len(sent))}
    finally:
        for conn in conns.values():
            conn.close()
        workers.stop()
    table = [(rid, worker, records[rid]["verdict"], records[rid]["expected_ttft_ms"]) for rid, worker in sent]
    # Never blamed on the provider, learning or not: every first token took the same 160 ms.
    assert not [row for row in table if row[2] in BLAMES_THE_PROVIDER], table
    learning = [records[rid] for rid, _ in sent[:prefill.MIN_SAMPLES - 1]]
    assert all("learning this upstream · model" in r["verdict_detail"] for r in learning if r["verdict"] == "ok"), table
    # b predicted from a's samples before it could have learned alone.
    assert any(records[rid]["expected_ttft_ms"] is not None for rid in b_ids), table
    assert sum(records[rid]["verdict"] == "ok" for rid in b_ids) >= 3, table


@pytest.mark.slow
def test_one_clients_slow_first_tokens_leave_the_others_verdicts_unchanged(fake, start_relay):
    relay = start_relay(reverse_to(fake), relay_trim="false")
    team = ["sk-team-a-0123456789abcdef", "sk-team-b-0123456789abcdef"]
    with HttpConnection(relay.url()) as conn:
        for i in range(prefill.MIN_SAMPLES):  # the team's own traffic: the line
            post(conn, team[i % 2], f"team-{i}")

    def poison(n: int) -> None:  # one client, its every first token QUEUE_MS late (its own effort, say)
        with HttpConnection(relay.url()) as conn:
            for _ in range(n):
                post(conn, "sk-poison-0123456789abcdef", "poison", head_delay_ms=QUEUE_MS)

    with ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(poison, 10) for _ in range(4)]:
            done.result()
    with HttpConnection(relay.url()) as conn:
        post(conn, team[0], "queued", head_delay_ms=QUEUE_MS)  # a real provider queue
        post(conn, team[1], "healthy")
    poisoned = relay.log.of("poison", 40)
    queued, healthy = relay.log.of("queued")[0], relay.log.of("healthy")[0]
    assert queued["verdict"] == "upstream queueing", queued
    assert healthy["verdict"] == "ok" and healthy["expected_ttft_ms"] == pytest.approx(healthy["ttft_ms"], rel=0.5), \
        healthy
    # The poisoner's own are held against the team's line: queueing, as far as the relay can tell.
    assert sum(r["verdict"] == "upstream queueing" for r in poisoned) >= 36, [r["verdict"] for r in poisoned]


def test_80_junk_model_names_do_not_send_the_real_model_back_to_learning(fake, start_relay):
    relay = start_relay(reverse_to(fake), relay_trim="false")
    with HttpConnection(relay.url()) as conn:
        for i in range(prefill.MIN_SAMPLES):
            post(conn, "sk-team-0123456789abcdef", f"real-{i}")
        for i in range(80):  # the upstream answers any name (a proxy to one of the client's choosing does)
            headers = {"authorization": "Bearer sk-junk-0123456789abcdef", "x-request-id": "junk"}
            response = conn.request("POST", CHAT, {**BODY, "model": f"junk-{i}-{uuid.uuid4().hex}"}, headers)
            assert response.status == 200
            response.read()
        post(conn, "sk-team-0123456789abcdef", "real-after")
    relay.log.of("junk", 80)
    after = relay.log.of("real-after")[0]
    assert after["expected_ttft_ms"] is not None and after["verdict"] == "ok", after


def test_codex_turns_over_websocket_learn_the_line_of_their_reasoning_effort(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), relay_trim="false")
    headers = {"authorization": "Bearer sk-team-0123456789abcdef", "x-request-id": "ws",
               "openai-beta": "responses_websockets=2026-02-06"}
    with WebSocketClient(relay.url().replace("http://", "ws://") + "/v1/responses", headers=headers) as client:
        for effort in ("high", "low"):
            client.send_text(json.dumps({"type": "response.create", "model": "gpt-5.1-codex",
                                         "reasoning": {"effort": effort}, "input": "hi"}))
            while (msg := client.receive(RECORD_WAIT_S)) is not None and json.loads(msg.text)["type"] not in (
                    "response.completed", "response.failed", "error"):
                pass
    relay.log.of("ws", 3)  # the handshake and two turns
    shared = tmp_path / store.FILE_NAME
    wait_until(lambda: samples_in(shared) >= 2, "the turns' samples")
    lines = verdicts.learned_lines(shared)
    keys = {line.key for line in lines}
    assert keys == {f"{line_upstream} · gpt-5.1-codex · effort {e}" for e in ("high", "low")
                    for line_upstream in {line.value["upstream"] for line in lines}}, keys
