"""Verdicts on real far and lossy links: a real relay, a real TCP stack on both ends.

Loopback cannot show a link: its round trips are microseconds and nothing is ever
lost. `ttft_relay/testing/fakes/link.py` builds two network namespaces joined by a userspace
packet forwarder that delays and drops IP packets (`FarLink`), so the kernels on
both sides see a real round trip, a real TCP handshake and real retransmits. Here
the relay runs in `far` and its client in `near` (the client's link), or the relay
and its client in `near` and the upstream in `far` (the upstream's link).

What the client measures is the truth the records are held to: its own time from
connect (a fresh connection) or from sending (a kept-alive one) to the first token
must be what the record accounts for — its connection set-up (the TCP handshake
included), the client link's round trip and its retransmission timeouts, and the
request's own phases — unless the record names the loss that cost the difference.
"""

from __future__ import annotations

import glob
import os
import socket
import ssl
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx2
import orjson
import pytest

from ttft_relay.testing.fakes import link
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.link import FAR, NEAR, FarLink
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.fakes.ws_client import WebSocketClient
from ttft_relay.observe import prefill
from ttft_relay.testing.harness import REPO, MitmdumpProcess, read_records
from ttft_relay.timing import phases

pytestmark = pytest.mark.skipif(link.unavailable() is not None, reason=f"no far link here: {link.unavailable()}")

BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}
CLIENT_ONE_WAY_MS = 75  # a 150 ms round trip: a client across a continent from its VPS
CLIENT_LOSS = 0.02
FRESH, KEPT = 16, 16
TOLERANCE, TOLERANCE_MS = 0.15, 25
"""How far a record's account of one request may be from what the client measured: two clocks
read by processes that a loaded machine schedules late."""
RELAY_PORT = 8443
"""Inside the test's own namespace, where nothing else listens (the workers' relay needs a port it knows)."""
CLIENT_LINK = (phases.CLIENT_NETWORK, phases.CLIENT_UPLOAD)
"""The verdicts that name the client's link: its round trip, or a body it was slow (lossy) to send."""
RELAY_OPTIONS = {
    # Plain HTTP off loopback, open: the test's private namespace is the firewall.
    "relay_client_tls": "optional", "relay_allow_open_proxy": True,
    "relay_timing_console": False, "relay_metrics_listen": "", "flow_detail": 0,
}


def relay_in(side: link.Side, modes: list[str], confdir: Path, log: Path, **options: object) -> MitmdumpProcess:
    """The relay as `ttft-relay run` starts it, in `side`'s namespace, listening on all its addresses."""
    from ttft_relay import config

    relay = MitmdumpProcess(modes, confdir, options={**config.MITMPROXY_DEFAULTS, **RELAY_OPTIONS,
                                                    "relay_timing_log": log, **options})
    relay.args[relay.args.index("--listen-host") + 1] = "0.0.0.0"
    relay.args = side.adopt(relay.args)
    return relay.start()


class Workers:
    """`ttft-relay run --workers N` in a namespace, on RELAY_PORT; records in `log`'s directory."""

    def __init__(self, side: link.Side, n: int, upstream: str, confdir: Path, log: Path, **options: object) -> None:
        from ttft_relay import config

        args = [sys.executable, "-m", "ttft_relay", "run", "--workers", str(n),
                "--mode", f"reverse:{upstream}@{RELAY_PORT}", "--listen-host", "0.0.0.0"]
        for name, value in {**config.MITMPROXY_DEFAULTS, **RELAY_OPTIONS, "confdir": confdir,
                            "relay_timing_log": log, **options}.items():
            args += ["--set", f"{name}={str(value).lower() if isinstance(value, bool) else value}"]
        self.log = log
        self.proc = subprocess.Popen(side.adopt(args), cwd=REPO, env={**os.environ, "TTFT_RELAY_CONF": ""},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def records(self) -> list[dict]:
        """Every worker's records (one log each, or one log for all)."""
        stem = self.log.with_suffix("")
        return [r for path in sorted(glob.glob(f"{stem}*.jsonl")) for r in read_records(Path(path))]

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def wait_until_serving(side: link.Side, address: tuple[str, int], proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Poll with a request until the relay answers one (bounded): its startup prints differ by design."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with side.entered():
                conn = HttpConnection(f"http://{address[0]}:{address[1]}", timeout=5)
            with conn:
                response = conn.request("POST", "/v1/chat/completions", BODY, {"x-request-id": "warm-up"})
                response.read()
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the relay is still starting: polling its port, bounded by the deadline


class Seen:
    """What the client measured of one request: from connect and from sending to the first token."""

    def __init__(self, request_id: str, fresh: bool, local_port: int, began: float, sent: float, first: float,
                 done: float) -> None:
        self.request_id, self.fresh, self.local_port = request_id, fresh, local_port
        self.began, self.sent, self.first, self.done = began, sent, first, done

    @property
    def waited_ms(self) -> float:
        """The client's wait for its first token: from its connect on a fresh connection, else from sending."""
        return (self.first - (self.began if self.fresh else self.sent)) * 1000

    @property
    def connect_ms(self) -> float:
        return (self.sent - self.began) * 1000


def one_request(conn: HttpConnection, fresh: bool, began: float) -> Seen:
    rid = uuid.uuid4().hex
    sent = time.time()
    response = conn.request("POST", "/v1/chat/completions", BODY, {"x-request-id": rid})
    assert response.status == 200, response.read()
    first = None
    for chunk in response.chunks():
        if first is None and b"Hello" in chunk.data:
            first = chunk.at
    assert first is not None
    return Seen(rid, fresh, conn.sock.getsockname()[1], began, sent, first, time.time())


def client_requests(near: link.Side, address: tuple[str, int]) -> list[Seen]:
    """FRESH requests each on a connection of its own, then KEPT on one kept-alive connection."""
    seen = []
    origin = f"http://{address[0]}:{address[1]}"
    for _ in range(FRESH):
        began = time.time()
        with near.entered():
            conn = HttpConnection(origin)
        with conn:
            seen.append(one_request(conn, True, began))
    with near.entered():
        conn = HttpConnection(origin)
    with conn:
        for _ in range(KEPT):
            seen.append(one_request(conn, False, time.time()))
    return seen


def accounted_ms(rec: dict, fresh: bool) -> float:
    """The client's wait as its record tells it: set-up (fresh), the client link, the request's first token."""
    link_ms = (rec["client_min_rtt_ms"] or 0.0) + (rec["client_retransmit_ms"] or 0.0)
    setup = rec["phases"].get(phases.SETUP_PHASE, 0.0) if fresh else 0.0
    return setup + link_ms + rec["ttft_ms"]


def check_client_link(seen: list[Seen], records: dict[str, dict], drops: list[link.Drop], relay_port: int) -> None:
    table = {s.request_id[:6]: (("fresh" if s.fresh else "kept"), round(s.waited_ms), round(accounted_ms(r, s.fresh)),
                                r["client_min_rtt_ms"], r["client_retransmits"], r["client_out_of_order"],
                                r["verdict"])
             for s in seen if (r := records.get(s.request_id))}
    assert all(s.request_id in records for s in seen), (table, sorted(records)[:5])
    mine = [records[s.request_id] for s in seen]
    # The client's link is seen: its round trip, from the kernel of the socket the client connected to.
    assert all(r["client_min_rtt_ms"] is not None and r["client_min_rtt_ms"] >= 1.8 * CLIENT_ONE_WAY_MS
               for r in mine), table
    # ... and named: the client's round trip, on fresh and on kept-alive connections alike.
    assert all(r["verdict"] in CLIENT_LINK for r in mine), \
        [(r["verdict"], r["phases"], r["loop_lag_ms"]) for r in mine if r["verdict"] not in CLIENT_LINK]
    for fresh in (True, False):
        named = [records[s.request_id]["verdict"] for s in seen if s.fresh == fresh]
        assert named.count(phases.CLIENT_NETWORK) >= 0.8 * len(named), table
    # Every wait is accounted for: the record's set-up, link and first token add up to what
    # the client saw, unless the record names the loss that cost the rest. A client's SYN
    # lost on the way is the one loss no server can see (its connect took a second or more).
    misses = {}
    for s in seen:
        rec = records[s.request_id]
        off = s.waited_ms - accounted_ms(rec, s.fresh)
        named_loss = rec["client_retransmits"] or rec["client_out_of_order"]
        lost_syn = s.fresh and s.connect_ms >= 900
        if abs(off) > TOLERANCE * s.waited_ms + TOLERANCE_MS and not named_loss and not lost_syn:
            misses[s.request_id[:6]] = round(off)
    assert not misses, (misses, table)
    typical = [s.waited_ms - accounted_ms(records[s.request_id], s.fresh) for s in seen]
    assert abs(statistics.median(typical)) <= 15, table
    # Every data segment the link dropped on its way to the client was retransmitted by the
    # relay's kernel, and counted in the record of the request it carried.
    # (The warm-up request that found the relay serving crossed the same link before them.)
    lost_to_client = [d for d in drops if d.to == NEAR and d.sport == relay_port and d.length > 0
                      and d.at >= min(s.sent for s in seen)]
    assert lost_to_client, f"the link dropped nothing the relay sent: nothing to count ({len(drops)} drops)"
    for drop in lost_to_client:
        carried = [s for s in seen if s.sent <= drop.at <= s.done and (not s.fresh or s.local_port == drop.dport)]
        assert carried, (drop, table)
        assert all(records[s.request_id]["client_retransmits"] >= 1 for s in carried), (drop, table)


def test_the_link_delays_and_drops_both_ways_and_leaves_nothing_behind():
    with FarLink(delay_ms=40, far_loss=0.5, near_loss=0.0, seed=3) as far:
        with far.far.entered():
            listener = socket.create_server(("0.0.0.0", 0))
        port = listener.getsockname()[1]
        with far.near.entered():
            client = socket.socket()
        with listener, client:
            client.settimeout(30)
            started = time.monotonic()
            client.connect((far.far.ip, port))  # SYNs lost half the time: retried after 1 s
            server, _ = listener.accept()
            with server:
                client.sendall(b"x" * 20000)
                got = b""
                while len(got) < 20000:
                    got += server.recv(65536)
            took = time.monotonic() - started
        drops, stats = far.drops(), far.stats()
        names = (far.near.name, far.far.name)
        assert all((link.NETNS_DIR / name).exists() for name in names)
    assert took >= 0.08  # at least the handshake's round trip
    assert stats[FAR]["dropped"] >= 1 and stats[NEAR]["dropped"] == 0
    assert all(d.to == FAR for d in drops) and len(drops) == stats[FAR]["dropped"]
    assert not any((link.NETNS_DIR / name).exists() for name in names)
    # Cleaned up however the test ends.
    with pytest.raises(RuntimeError, match="the test failed"), FarLink(delay_ms=1) as failing:
        names = (failing.near.name, failing.far.name)
        raise RuntimeError("the test failed")
    assert not any((link.NETNS_DIR / name).exists() for name in names)


@pytest.mark.slow
def test_a_far_lossy_client_is_named_client_network_and_every_wait_is_accounted(far_link, fake_in, confdir,
                                                                                tmp_path):
    far = far_link(delay_ms=CLIENT_ONE_WAY_MS, loss=CLIENT_LOSS, seed=7)
    upstream = fake_in(far.far, prefill_ms=20)  # the relay reaches it on far's loopback
    relay = relay_in(far.far, [f"reverse:{upstream}@{RELAY_PORT}"], confdir, tmp_path / "timing.jsonl")
    with relay:
        seen = client_requests(far.near, (far.far.ip, RELAY_PORT))
        records = {r["request_id"]: r for r in relay.log.wait(len(seen))}
        drops = far.drops()
    assert "Addon error" not in relay.text()
    check_client_link(seen, records, drops, RELAY_PORT)
    assert {r["id"] for r in records.values()} and all(not r["error"] for r in records.values())


@pytest.mark.slow
def test_a_far_lossy_client_of_n_workers_is_named_client_network(far_link, fake_in, confdir, tmp_path):
    """The same far client with `ttft-relay run --workers 2`: each worker must see its clients' own
    sockets (an L4 balancer in front owns them and reports its own loopback RTT)."""
    far = far_link(delay_ms=CLIENT_ONE_WAY_MS, loss=CLIENT_LOSS, seed=7)
    upstream = fake_in(far.far, prefill_ms=20)
    workers = Workers(far.far, 2, upstream, confdir, tmp_path / "timing.jsonl")
    try:
        wait_until_serving(far.near, (far.far.ip, RELAY_PORT), workers.proc)
        seen = client_requests(far.near, (far.far.ip, RELAY_PORT))
        deadline = time.monotonic() + 10
        while len(records := {r["request_id"]: r for r in workers.records()}) < len(seen) + 1:
            assert time.monotonic() < deadline, f"{len(records)} records of {len(seen) + 1}"
            time.sleep(0.05)  # the workers write their records moments after the answers
        drops = far.drops()
    finally:
        output = workers.stop()
    assert "Addon error" not in output, output[-3000:]
    check_client_link(seen, records, drops, RELAY_PORT)


UPSTREAM_ONE_WAY_MS = 50  # a 100 ms round trip from the VPS to its provider
UPSTREAM_LOSS = 0.05
SLOW_SERVER_MS = 300
UPSTREAM_LINK = (phases.UPSTREAM_CONNECT, phases.UPSTREAM_TLS, phases.UPSTREAM_NETWORK)
"""The verdicts that name the upstream's link: its TCP connect, its TLS handshake, its round trip."""
UPSTREAM_OWN = (phases.UPSTREAM_WAIT, phases.UPSTREAM_QUEUEING)
"""The upstream's own wait: before the relay has learned this upstream · model, and beyond it."""


def upstream_requests(relay: MitmdumpProcess | str, n: int, label: str, *, fresh: bool, body: dict = BODY) -> list[str]:
    """`n` requests from a client beside the relay (call inside its namespace): each on a
    connection of its own (so each opens an upstream connection), or all on one kept-alive
    connection. Returns their request ids."""
    ids = [f"{label}-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
    conn = None
    try:
        for rid in ids:
            if conn is None or fresh:
                if conn is not None:
                    conn.close()
                conn = HttpConnection(relay if isinstance(relay, str) else relay.url())
            response = conn.request("POST", "/v1/chat/completions", body, {"x-request-id": rid})
            assert response.status == 200, response.read()
            response.read()
    finally:
        if conn is not None:
            conn.close()
    return ids


@pytest.mark.slow
def test_a_far_upstream_is_its_network_and_a_lossy_one_is_told_apart_from_a_slow_server(far_link, certs, confdir,
                                                                                       tmp_path):
    far = far_link(delay_ms=UPSTREAM_ONE_WAY_MS, seed=11)
    with far.far.entered():
        fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip).start()
    try:
        fake.behaviour.prefill_ms = 10
        # The test CA names localhost, not the far side's address: TLS is real, its name unchecked.
        relay = relay_in(far.near, [f"reverse:https://{far.far.ip}:{fake.port}@0"], confdir,
                         tmp_path / "timing.jsonl", ssl_insecure=True)
        with relay, far.near.entered():
            fresh = upstream_requests(relay, 6, "fresh", fresh=True)  # each opens an upstream connection
            kept = upstream_requests(relay, 6, "kept", fresh=False)
            fake.behaviour.head_delay_ms = SLOW_SERVER_MS  # a slow server behind the same far link
            slow = upstream_requests(relay, 8, "slow", fresh=False)
            fake.behaviour.head_delay_ms = 0
            far.set(NEAR, loss=UPSTREAM_LOSS)  # a fast server behind a lossy link
            far.set(FAR, loss=UPSTREAM_LOSS)
            lossy = upstream_requests(relay, 24, "lossy", fresh=False)
            records = {r["request_id"]: r for r in relay.log.wait(6 + 6 + 8 + 24)}
    finally:
        fake.stop()
    assert "Addon error" not in relay.text()

    def table(ids: list[str]) -> dict[str, tuple]:
        return {rid: (records[rid]["verdict"], records[rid]["ttft_ms"], records[rid]["upstream_retransmits"],
                      records[rid]["upstream_out_of_order"], records[rid]["upstream_retransmit_ms"],
                      records[rid]["phases"].get("upstream_wait")) for rid in ids}

    # Far: the relay learns the round trip from the handshakes (TLS's includes both ends' crypto,
    # which a loaded machine slows), and names the link.
    assert all(0.9 * 2 * UPSTREAM_ONE_WAY_MS <= records[rid]["rtt_ms"] <= 2 * 2 * UPSTREAM_ONE_WAY_MS
               for rid in fresh + kept), {rid: records[rid]["rtt_ms"] for rid in fresh + kept}
    assert all(records[rid]["verdict"] in UPSTREAM_LINK for rid in fresh), table(fresh)
    assert all(records[rid]["verdict"] == phases.UPSTREAM_NETWORK for rid in kept[1:]), table(kept)
    # Slow: the same link, a server that takes its time: the upstream's own wait (queueing, once
    # the relay has learned how fast this upstream · model answers), no loss. (The first opens
    # its connection: its connect, TLS and round trip cost the link as much as the server's delay.)
    assert all(records[rid]["verdict"] in UPSTREAM_OWN and not records[rid]["upstream_retransmits"]
               and not records[rid]["upstream_out_of_order"] for rid in slow[1:]), table(slow)
    # Lossy: told apart from a slow server. The loss a request met is in its record, and names
    # the link wherever the record can time it: a request resent (the kernel's last send of
    # it), an answer segment lost and sent again (one round trip at least). An answer segment
    # the upstream resent only after its retransmission timeout is counted, not timed.
    def lost(rid: str) -> bool:
        return bool(records[rid]["upstream_retransmits"] or records[rid]["upstream_out_of_order"])

    assert not [rid for rid in lossy if records[rid]["verdict"] in UPSTREAM_OWN and not lost(rid)], \
        table(lossy)
    clean = statistics.median(records[rid]["ttft_ms"] for rid in kept)
    slowed = [rid for rid in lossy if records[rid]["ttft_ms"] > clean + 0.4 * 2 * UPSTREAM_ONE_WAY_MS]
    assert len(slowed) >= 2, f"the link's loss slowed {len(slowed)} requests: too few to tell anything apart {table(lossy)}"
    named = [rid for rid in slowed if records[rid]["verdict"] in UPSTREAM_LINK]
    assert len(named) >= 0.75 * len(slowed), table(slowed)


def test_websocket_turns_of_a_far_client_are_named_client_network(far_link, fake_in, confdir, tmp_path):
    """Codex's transport: one socket, a turn per `response.create`. Each turn record reads the
    socket's own link, so a far client is named on every turn of a long session."""
    far = far_link(delay_ms=CLIENT_ONE_WAY_MS, seed=5)
    upstream = fake_in(far.far, prefill_ms=20)
    relay = relay_in(far.far, [f"reverse:{upstream}@{RELAY_PORT}"], confdir, tmp_path / "timing.jsonl")
    rid = uuid.uuid4().hex
    with relay:
        with far.near.entered():
            client = WebSocketClient(f"ws://{far.far.ip}:{RELAY_PORT}/v1/responses",
                                     headers={"x-request-id": rid, "openai-beta": "responses_websockets=2026-02-06"})
        with client:
            for _ in range(3):
                client.send_text(orjson.dumps({"type": "response.create", "model": "gpt-5.1-codex",
                                               "input": [{"type": "message", "role": "user", "content": "hi"}]}).decode())
                while (message := client.receive(30)) is not None and '"response.completed"' not in message.text:
                    pass
        turns = sorted((r for r in relay.log.of(rid, 4) if r["turn"]), key=lambda r: r["turn"])
    named = [(r["turn"], r["client_min_rtt_ms"], r["ttft_ms"], r["verdict"]) for r in turns]
    assert len(turns) == 3 and all(r["client_min_rtt_ms"] >= 1.8 * CLIENT_ONE_WAY_MS for r in turns), named
    assert all(r["verdict"] == phases.CLIENT_NETWORK for r in turns), named


LONG_BODY = {**BODY, "messages": [{"role": "user", "content": "Say hello. " + "context " * 2000}]}
"""A 16 kB request: more than a fresh connection's first flight (ten segments) carries."""
NAMED_SHARE = 0.95
EACH_ITS_OWN_UPSTREAM_CONNECTION = {"relay_upstream_pool": False}
"""What a fresh upstream connection costs is measured here (its connect, TLS and the upload's
second flight on a new congestion window): with the pool (the default) a new client connection
takes one already open, whose far-link cost `tests/test_upstream_pool_e2e.py` measures."""


@pytest.mark.slow
@pytest.mark.parametrize("jitter_ms, n_workers", [(0, 1), (20, 1), (0, 2)], ids=["steady", "jitter", "workers"])
def test_a_far_provider_is_named_its_link_and_the_uploads_round_trips_are_not_its_wait(far_link, certs, confdir,
                                                                                      tmp_path, jitter_ms, n_workers):
    """Relay → provider 100 ms round trip, TLS, fresh connections carrying 16 kB: each part of the
    link (connect, TLS, the round trip, the upload's second flight) is a round trip, none a quarter
    of the first token's wait alone; together they are most of it, and the link is the one named,
    by a relay alone or by each of `--workers 2`."""
    far = far_link(delay_ms=UPSTREAM_ONE_WAY_MS, jitter_ms=jitter_ms, seed=13)
    with far.far.entered():
        fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip).start()
    upstream = f"https://{far.far.ip}:{fake.port}"
    log = tmp_path / "timing.jsonl"
    try:
        fake.behaviour.prefill_ms = 30
        if n_workers == 1:
            # The test CA names localhost, not the far side's address: TLS is real, its name unchecked.
            relay = relay_in(far.near, [f"reverse:{upstream}@{RELAY_PORT}"], confdir, log, ssl_insecure=True,
                             **EACH_ITS_OWN_UPSTREAM_CONNECTION)
            with relay, far.near.entered():
                fresh, kept = far_provider_requests(f"http://127.0.0.1:{RELAY_PORT}")
                records = {r["request_id"]: r for r in relay.log.wait(len(fresh) + len(kept))}
            output = relay.text()
        else:
            workers = Workers(far.near, n_workers, upstream, confdir, log, ssl_insecure=True,
                              **EACH_ITS_OWN_UPSTREAM_CONNECTION)
            try:
                wait_until_serving(far.near, ("127.0.0.1", RELAY_PORT), workers.proc)
                with far.near.entered():
                    fresh, kept = far_provider_requests(f"http://127.0.0.1:{RELAY_PORT}")
                deadline = time.monotonic() + 10
                while len(records := {r["request_id"]: r for r in workers.records()}) < len(fresh) + len(kept) + 1:
                    assert time.monotonic() < deadline, f"{len(records)} records of {len(fresh) + len(kept) + 1}"
                    time.sleep(0.05)  # the workers write their records moments after the answers
            finally:
                output = workers.stop()
    finally:
        fake.stop()
    assert "Addon error" not in output, output[-3000:]
    table = {rid[:8]: (records[rid]["verdict"], records[rid]["ttft_ms"], records[rid]["rtt_ms"],
                       {k: round(v) for k, v in records[rid]["phases"].items()}) for rid in fresh + kept}
    for ids in (fresh, kept[1:]):
        named = [rid for rid in ids if records[rid]["verdict"] in UPSTREAM_LINK]
        assert len(named) >= NAMED_SHARE * len(ids), table
    # The upload's second flight is measured on the upstream socket, as the link's ...
    uploads = [records[rid]["phases"].get("upstream_upload", 0.0) for rid in fresh]
    assert statistics.median(uploads) >= 0.5 * 2 * UPSTREAM_ONE_WAY_MS, table
    # ... and kept out of the upstream's own wait, which the prefill line is learned from.
    own = [prefill.own_wait(records[rid]) for rid in fresh + kept]
    assert statistics.median(o for o in own if o is not None) < 0.5 * 2 * UPSTREAM_ONE_WAY_MS, (own, table)


def test_a_far_http2_providers_upload_round_trips_are_its_link_too(far_link, certs, confdir, tmp_path):
    """The far provider over HTTP/2 (a client that speaks it, `http2: true`, an upstream that
    picks it): one stream on each upstream connection, the kernel's last send is the request's,
    so its upload beyond the first flight is measured as on HTTP/1 and kept out of the upstream's
    own wait (it was left in it: `upstream_sent` was never marked on HTTP/2)."""
    far = far_link(delay_ms=UPSTREAM_ONE_WAY_MS, seed=13)
    with far.far.entered():
        fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip, h2=True).start()
    # The relay's certificate names the far side's address: TLS is real, its name unchecked (as upstream).
    unchecked = ssl.create_default_context()
    unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
    ids = [f"h2-{i}-{uuid.uuid4().hex[:8]}" for i in range(8)]
    try:
        fake.behaviour.prefill_ms = 30
        relay = relay_in(far.near, [f"reverse:https://{far.far.ip}:{fake.port}@{RELAY_PORT}"], confdir,
                         tmp_path / "timing.jsonl", ssl_insecure=True, http2=True)
        with relay, far.near.entered():
            for rid in ids:  # each on a client connection of its own: each opens an upstream connection
                with httpx2.Client(http2=True, verify=unchecked, timeout=30) as h2c:
                    response = h2c.post(f"https://127.0.0.1:{RELAY_PORT}/v1/chat/completions", json=LONG_BODY,
                                        headers={"x-request-id": rid})
                    assert response.status_code == 200 and response.http_version == "HTTP/2", response.text[:300]
            records = {r["request_id"]: r for r in relay.log.wait(len(ids))}
    finally:
        fake.stop()
    assert "Addon error" not in relay.text()
    assert len(fake.received) == len(ids) and all(r.h2 for r in fake.received)
    assert len({r.conn_id for r in fake.received}) == len(ids)
    table = {rid[:10]: (records[rid]["verdict"], {k: round(v) for k, v in records[rid]["phases"].items()}) for rid in ids}
    uploads = [records[rid]["phases"].get("upstream_upload", 0.0) for rid in ids]
    assert statistics.median(uploads) >= 0.5 * 2 * UPSTREAM_ONE_WAY_MS, table
    own = [prefill.own_wait(records[rid]) for rid in ids]
    assert statistics.median(o for o in own if o is not None) < 0.5 * 2 * UPSTREAM_ONE_WAY_MS, (own, table)
    assert all(records[rid]["verdict"] in UPSTREAM_LINK for rid in ids), table


def far_provider_requests(origin: str) -> tuple[list[str], list[str]]:
    """20 requests of 16 kB each on a connection of its own (each opens an upstream connection
    without the pool), then 10 on one kept-alive connection."""
    return (upstream_requests(origin, 20, "fresh", fresh=True, body=LONG_BODY),
            upstream_requests(origin, 10, "kept", fresh=False, body=LONG_BODY))


FAR_CLIENT_PREFILL_MS = 600
"""Long enough that one client round trip (150 ms) is under a quarter of the first token."""
LEARNING = 10
"""Requests that teach the relay this upstream · model's first token (prefill.MIN_SAMPLES of them, and more)."""


@pytest.mark.slow
def test_a_far_clients_handshake_counts_in_its_first_requests_wait(far_link, fake_in, confdir, tmp_path):
    """A far client on fresh connections: its TCP handshake is a round trip it waited before its
    request, which the request's own clock does not see. Judged from its SYN, the link (the
    handshake and the request's round trip) is a third of what it felt: named, where the request's
    round trip alone (a fifth of its first token) read `ok`."""
    far = far_link(delay_ms=CLIENT_ONE_WAY_MS, seed=9)
    upstream = fake_in(far.far, prefill_ms=FAR_CLIENT_PREFILL_MS)
    relay = relay_in(far.far, [f"reverse:{upstream}@{RELAY_PORT}"], confdir, tmp_path / "timing.jsonl")
    origin = f"http://{far.far.ip}:{RELAY_PORT}"
    with relay:
        with far.near.entered():
            conn = HttpConnection(origin)
        with conn:
            learning = [one_request(conn, False, time.time()) for _ in range(LEARNING)]
        fresh = []
        for _ in range(20):
            began = time.time()
            with far.near.entered():
                conn = HttpConnection(origin)
            with conn:
                fresh.append(one_request(conn, True, began))
        records = {r["request_id"]: r for r in relay.log.wait(len(learning) + len(fresh))}
    assert "Addon error" not in relay.text()
    mine = [records[s.request_id] for s in fresh]
    table = [(r["verdict"], r["ttft_ms"], r["expected_ttft_ms"], r["client_min_rtt_ms"],
              r["phases"].get(phases.SETUP_PHASE), r["verdict_detail"]) for r in mine]
    # The relay had learned what this upstream · model takes: the first token was in line with it.
    assert all(r["expected_ttft_ms"] is not None for r in mine), table
    named = [r for r in mine if r["verdict"] == phases.CLIENT_NETWORK and "handshakes" in r["verdict_detail"]]
    assert len(named) >= NAMED_SHARE * len(mine), table
    assert all(r["client_setup_round_trips"] == 0 and "client_tcp" in r["marks"] for r in mine), table
