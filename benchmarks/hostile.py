"""Hostile input benchmark: what an attacker's frames, junk requests and garbage upstreams
cost the relay, and what they cost everyone else's streams.

One relay (mitmdump -s ttft_relay/relay.py with its defaults, or `--relay-script` another
checkout's, to measure before and after a change) with four listeners: reverse to the fake
upstream (the victims' streams), reverse to a hostile upstream (ttft_relay/testing/fakes/hostile.py),
reverse to an upstream that closes its kept-alive connections at random (`LateClosingUpstream`),
and a regular proxy listener (the junk requests). Scenarios that need a relay of their own (a
supervisor, a far link) start it themselves, below. Per scenario on the shared relay:

    rss       the relay's resident memory before the attack, and its peak during it
              (VmRSS sampled every 20 ms), in MB
    stall     a victim: an event stream through the relay, an event every 10 ms; the
              longest gap between its arrivals while the attack ran, against the longest
              gap of the same stream without an attack, measured in the same run (ratio)
    outcome   what the attacker got (close code, bytes passed on, series, ...)

Scenarios (the figures of issue 26):

    ws-bomb-client     one permessage-deflate frame (about 1 MB) that inflates to 1 GB, from the client
    ws-bomb-upstream   the same from the upstream
    ws-big-messages    10 messages of 50 MB on one socket, from the client
    ws-fragments       one message in 100k fragments
    ws-pings           100k pings
    metrics-junk       10k requests over 50 closed ports x 50 models x 4 paths through the proxy
                       listener, then one real model: the scrape's series, size and time
    metrics-idle       1000 idle connections to the metrics endpoint: the relay's threads
    sse-gzip-bomb      an event stream, gzip-encoded, that inflates to 1000 MB

Issue 36's cases:

    ws-many-messages   10 sockets each sending a 23 MiB message (each under the per-message
                       bound) at once: the relay's memory, the victim's stall, all delivered?
    ws-many-messages-20  the same with 20 sockets
    ws-over-bound      one 30 MiB message (over the 24 MiB bound) from a client that sends it
                       whole, then reads: does its send complete, does it get its close 1009, when
    otlp-endless       exporting to a collector that answers 200 with an endless chunked body,
                       200 requests: the relay's memory over 10 s, and how long its stop takes
    otlp-hang-names    a collector that never answers, and 2000 requests naming a 200 KB model
    otlp-forged-line   a collector whose 500 body holds a newline and a fake record line: does
                       the relay's console show that line as a line of its own
    metrics-evict      through the proxy listener: gpt-4o 3 times to its upstream, 150 models to an
                       attacker's upstream that answers 200 to anything, gpt-4o again: its count
    pool-keepalive-race  an upstream that advertises keep-alive and closes each connection 0-300 ms
                       after its answer (reading nothing meanwhile), 60 clients, 4 at a time, each
                       on a new connection to the relay: their statuses (502: a pooled connection
                       lost the race; the pool is on by default, `--set relay_upstream_pool=...`),
                       the upstream's connections, and from the records how many went on a
                       connection they did not open (reused, or opened by the pool ahead of them)
                       and their total time (p50, max); from the relay's log how many were sent
                       once more after their reused connection closed before the answer

With a relay of their own (`--relay-script`'s checkout). The pool on a far link
(ttft_relay/testing/fakes/link.py; root):

    pool-silent        6 clients through the pool (relay_upstream_pool=true), then the link
                       forgets their connections (a NAT that lost its table: every packet of
                       them dropped, no reset), then 6 clients at once: each one's status and
                       when, and their records (relay_first_token_timeout=30: a request left
                       on a dead connection fails then)

On `ttft-relay run --workers 2`, in front of the fake upstream:

    worker-dies-starting  worker 1 killed (-9, as the OOM killer does) before it is ready, 40
                       clients arriving meanwhile (one every 50 ms): their outcomes, the
                       supervisor's exit, its "N workers ready" line and the workers alive then
    reload-starting    SIGHUP (systemctl reload) as worker 0 starts, before it has a handler:
                       the supervisor's exit, workers that died, 10 clients after
    kill-answered      a worker killed -9 every 2 s, 5 times, 8 clients asking throughout:
                       of the requests whose clients had the whole answer, those recorded "lost"
    stop-arriving      SIGTERM (systemctl stop) with a 3 s stream in flight
                       (relay_shutdown_grace=5) and 3 clients connecting again and again (each
                       every 50 ms, or once its last is over): the outcomes of those that
                       connected during the stop (refused, answered, or closed with no answer),
                       and records against answers

    scripts/bench hostile [--scenario NAME ...] [--relay-script PATH] [--set NAME=VALUE ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import random
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ttft_relay.testing.fakes import hostile, link
from ttft_relay.testing.fakes.hostile import BINARY, CONTINUATION, PING, TEXT, HostileUpstream, RawClient, frame
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import RELAY_SCRIPT, MitmdumpProcess, RelayWorkers, read_records, start_fake_upstream

GIB = 1 << 30
EVENT_GAP_MS = 10
VICTIM_EVENTS = 6000
"""60 s of events: longer than any attack here (the victim is stopped when its attack is over)."""
SCENARIOS: dict[str, Callable[[Bench], dict]] = {}


RELAY_OPTIONS: dict[str, Callable[[HostileCollector], dict[str, str]]] = {}
"""Options a scenario's relay starts with, given the hostile collector (its mode set)."""


def scenario(fn: Callable[[Bench], dict]) -> Callable[[Bench], dict]:
    SCENARIOS[fn.__name__.replace("_", "-")] = fn
    return fn


def exporting(mode: str) -> Callable[[Callable[[Bench], dict]], Callable[[Bench], dict]]:
    """The scenario's relay exports traces to the hostile collector, which behaves as `mode`."""
    def mark(fn: Callable[[Bench], dict]) -> Callable[[Bench], dict]:
        def options(collector: HostileCollector) -> dict[str, str]:
            collector.mode = mode
            return {"relay_otlp_endpoint": collector.url}
        RELAY_OPTIONS[fn.__name__.replace("_", "-")] = options
        return fn
    return mark


class LoopbackServer:
    """A server on loopback with a thread per connection (`_one`), counting its connections."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()


class HostileCollector(LoopbackServer):
    """An OTLP collector on loopback that misbehaves as `mode` says: `endless` (200, then a
    chunked body without end), `hang` (reads the POST, never answers), `forge` (500 whose body
    holds a newline and a line made to look like the relay's own)."""

    FORGED = "2026-01-01 00:00:00 200 gpt-4o ttft 12 ms ok (forged by the collector)"

    def __init__(self) -> None:
        self.mode = "hang"
        super().__init__()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                while conn.recv(1 << 20):  # each POST, then the answer its mode gives
                    if self.mode == "hang":
                        continue
                    if self.mode == "forge":
                        body = f"collector error\n{self.FORGED}".encode()
                        conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(body), body))
                        continue
                    conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
                    while True:
                        conn.sendall(chunk)
            except OSError:
                pass


class LateClosingUpstream(LoopbackServer):
    """An upstream on loopback that answers each request 200 with `connection: keep-alive`,
    then closes the connection at a random moment 0-300 ms later, reading nothing meanwhile:
    a request sent on it in that time is lost (a server's idle timeout or restart, as a
    kept-alive connection's client meets it)."""

    BODY = json.dumps({"id": "chatcmpl-late", "object": "chat.completion", "model": "gpt-4o-mini",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    def __init__(self) -> None:
        self.answered = 0
        super().__init__()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    if not (chunk := conn.recv(65536)):
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(m.group(1)) if (m := re.search(rb"(?i)content-length:\s*(\d+)", head)) else 0
                while len(body) < length:
                    if not (chunk := conn.recv(65536)):
                        return
                    body += chunk
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                             b"keep-alive: timeout=60\r\ncontent-length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))
                self.answered += 1
                time.sleep(random.uniform(0, 0.3))  # the close's moment: nothing read meanwhile
            except OSError:
                pass


def rss_mb(pid: int) -> float:
    """VmRSS of `pid` in MB; 0 once it has exited (a scenario may stop the relay itself)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class RssPeak:
    """The peak VmRSS of a process while the `with` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.before, self.peak = pid, rss_mb(pid), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except OSError:
                return

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.pid))


class Victim:
    """An event stream through the relay, read in a process of its own (`--victim PORT`), which
    prints each read's time (`time.monotonic`, the same clock in every process); `arrivals` are
    those times. Not a thread here: this process's hostile fakes hold its GIL for a big frame's
    unmasking (~130 ms per 23 MiB), and a reader here measured them as the relay's stall."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.arrivals: list[float] = []
        self.first = threading.Event()
        self.proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.arrivals.append(float(line))
            self.first.set()
        self.first.set()

    def start(self) -> Victim:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.hostile", "--victim", str(self.port)],
                                     cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
        self._thread.start()
        self.first.wait(30)
        return self

    def max_gap_ms(self, start: float, end: float) -> float:
        ts = [t for t in self.arrivals if start <= t <= end]
        return max((b - a for a, b in zip(ts, ts[1:])), default=0.0) * 1000

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)
        self._thread.join(10)


def victim_stream(port: int) -> None:
    """The victim's process: the stream read as it comes, each read's time printed."""
    body = json.dumps({"model": "gpt-4o-mini", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"x-fake-chunks: {VICTIM_EVENTS}\r\nx-fake-gap-ms: {EVENT_GAP_MS}\r\nx-request-id: victim\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), 60) as s:
        s.sendall(head + body)
        while data := s.recv(65536):
            print(time.monotonic(), flush=True)
            if b"[DONE]" in data:
                break


class Bench:
    def __init__(self, relay_script: Path, tmp: Path, options: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.fake, self.fake_url = start_fake_upstream()
        self.hostile = HostileUpstream(ATTACKS).__enter__()
        self.late_closing = LateClosingUpstream()
        from ttft_relay import config

        # mitmproxy takes one listener per address: port 0 only once.
        ports = closed_ports(3)
        self.relay = MitmdumpProcess(
            [f"reverse:{self.fake_url}@{ports[0]}", f"reverse:{self.hostile.base_url}@{ports[1]}",
             f"reverse:{self.late_closing.url}@{ports[2]}", "regular@0"], tmp,
            script=relay_script,
            options={**config.MITMPROXY_DEFAULTS, "relay_timing_log": tmp / "timing.jsonl",
                     "relay_metrics_listen": "127.0.0.1:0", **(options or {})})
        try:
            self.relay.start()
        except BaseException:
            self.close()
            raise
        self.pid = self.relay.proc.pid
        self.victim_port, self.hostile_port, self.late_closing_port, self.proxy_port = self.relay.ports

    def metrics_url(self) -> str:
        return re.search(r"(http://\S+/metrics)", self.relay.wait_for_output(r"metrics at http://")).group(1)

    def attack(self, run: Callable[[], dict]) -> dict:
        """Run an attack beside a victim stream; the relay's memory and the victim's longest gap."""
        victim = Victim(self.victim_port).start()
        time.sleep(0.5)
        with RssPeak(self.pid) as rss:
            start = time.monotonic()
            outcome = run()
            end = time.monotonic()
        time.sleep(0.3)  # the victim's reads up to `end + 0.2`
        victim.stop()
        return {"rss_before_mb": round(rss.before), "rss_peak_mb": round(rss.peak),
                "victim_max_gap_ms": round(victim.max_gap_ms(start, end + 0.2), 1),
                "attack_s": round(end - start, 2), **outcome}

    def baseline(self) -> dict:
        victim = Victim(self.victim_port).start()
        time.sleep(0.5)
        start = time.monotonic()
        time.sleep(3)
        end = time.monotonic()
        victim.stop()
        return {"victim_max_gap_ms": round(victim.max_gap_ms(start, end), 1)}

    def close(self) -> None:
        self.relay.stop()
        self.hostile.__exit__()
        self.late_closing.close()
        self.fake.terminate()
        self.fake.wait(10)


def closed_with(client: RawClient, timeout: float = 120) -> dict:
    try:
        f = client.until_close(timeout)
    except (TimeoutError, OSError) as e:
        return {"close": f"none ({type(e).__name__})", "received": client.received}
    return {"close": hostile.close_code(f) if f else "connection closed", "received": client.received}


ATTACKS: dict[str, Callable[[hostile.UpstreamSession], list[bytes]]] = {
    "ws-bomb": lambda s: [frame(TEXT, hostile.deflate_bomb(GIB), rsv1=True, masked=False)],
    "sse-gzip-bomb": lambda s: [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
        b"connection: close\r\n\r\n" + hostile.gzip_bomb(1000 * 1000 * 1000, b"data: {}\n\n")],
}


@scenario
def ws_bomb_client(b: Bench) -> dict:
    with RawClient(b.hostile_port, timeout=300) as c:
        def run() -> dict:
            c.send(frame(TEXT, hostile.deflate_bomb(GIB), rsv1=True, masked=True))
            out = closed_with(c, 300)
            sessions = b.hostile.wait_ended(len(b.hostile.sessions), 120)
            out["passed_upstream"] = sessions[-1].received
            return out
        return b.attack(run)


@scenario
def ws_bomb_upstream(b: Bench) -> dict:
    def run() -> dict:
        with RawClient(b.hostile_port, headers={"x-attack": "ws-bomb"}, timeout=300) as c:
            return closed_with(c, 300)
    return b.attack(run)


@scenario
def ws_big_messages(b: Bench) -> dict:
    with RawClient(b.hostile_port, deflate=False, timeout=300) as c:
        def run() -> dict:
            big = frame(BINARY, b"a" * (50 * 1000 * 1000), masked=True)
            for _ in range(10):
                c.send(big)
            time.sleep(2)
            held = rss_mb(b.pid)
            c.send(frame(hostile.CLOSE, b"\x03\xe8", masked=True))
            return {"rss_held_mb": round(held), **closed_with(c)}
        return b.attack(run)


@scenario
def ws_fragments(b: Bench) -> dict:
    with RawClient(b.hostile_port, deflate=False) as c:
        def run() -> dict:
            data = frame(TEXT, b"a", fin=False, masked=True) + frame(CONTINUATION, b"a", fin=False, masked=True) * 99_998
            c.send(data + frame(CONTINUATION, b"a", masked=True))
            c.send(frame(hostile.CLOSE, b"\x03\xe8", masked=True))
            return closed_with(c)
        return b.attack(run)


@scenario
def ws_pings(b: Bench) -> dict:
    with RawClient(b.hostile_port, deflate=False) as c:
        def run() -> dict:
            c.send(frame(PING, b"p", masked=True) * 100_000)
            c.send(frame(hostile.CLOSE, b"\x03\xe8", masked=True))
            out = closed_with(c)
            out["pongs_or_pings_back"] = len(c.frames)
            return out
        return b.attack(run)


@scenario
def sse_gzip_bomb(b: Bench) -> dict:
    def run() -> dict:
        body = b'{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}'
        got = 0
        with socket.create_connection(("127.0.0.1", b.hostile_port), 120) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-attack: sse-gzip-bomb\r\n"
                      b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            while data := s.recv(1 << 20):
                got += len(data)
        return {"client_received_mb": round(got / 1e6, 1)}
    return b.attack(run)


@scenario
def ws_many_messages(b: Bench, sockets: int = 10, size: int = 23 * 1024 * 1024) -> dict:
    clients = [RawClient(b.hostile_port, deflate=False, timeout=300) for _ in range(sockets)]
    message = frame(BINARY, b"a" * size, masked=True)

    def run() -> dict:
        started = time.monotonic()
        senders = [threading.Thread(target=c.send, args=(message,)) for c in clients]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        deadline = time.monotonic() + 120
        while sum(s.received for s in b.hostile.sessions[-sockets:]) < sockets * size and time.monotonic() < deadline:
            time.sleep(0.05)
        delivered = sum(s.received for s in b.hostile.sessions[-sockets:]) // size
        took = time.monotonic() - started
        held = rss_mb(b.pid)
        for c in clients:
            c.send(frame(hostile.CLOSE, b"\x03\xe8", masked=True))
            c.sock.close()
        return {"delivered": f"{delivered}/{sockets}", "all_delivered_s": round(took, 2), "rss_held_mb": round(held)}
    return b.attack(run)


@scenario
def ws_many_messages_20(b: Bench) -> dict:
    """Issue 36's 20 sockets x 23 MiB: the victim's stall with the budget pausing most of them."""
    return ws_many_messages(b, sockets=20)


@scenario
def ws_over_bound(b: Bench) -> dict:
    with RawClient(b.hostile_port, deflate=False, timeout=120) as c:
        def run() -> dict:
            started = time.monotonic()
            # As a synchronous client does: the whole message, then read.
            sent = _send_quietly(c, frame(BINARY, b"a" * (30 * 1024 * 1024), masked=True))
            out = closed_with(c, 70)
            out["send"] = sent
            out["close_after_s"] = round(time.monotonic() - started, 2)
            return out
        return b.attack(run)


def _send_quietly(c: RawClient, data: bytes) -> str:
    """How sending `data` went: "ok", or the error (the relay closed the socket meanwhile)."""
    try:
        c.send(data)
    except OSError as e:
        return type(e).__name__
    return "ok"


def asked(port: int, model: str = "gpt-4o-mini", headers: str = "", *, stream: bool = False,
          timeout: float = 30) -> int | str:
    """One chat request on a new connection to the relay's `port` (`headers`: more head lines,
    each ending in CRLF): the status of its whole answer, or what ended it: "refused", "reset",
    "closed" (no byte of an answer), "timeout", or "cut" (an answer's head, not all its body)."""
    body = json.dumps({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}).encode()
    data, broken = b"", ""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"connection: close\r\n%scontent-length: %d\r\n\r\n%s" % (headers.encode(), len(body), body))
            while chunk := s.recv(65536):
                data += chunk
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        broken = "timeout"
    except OSError:
        broken = "reset"
    if not data.startswith(b"HTTP/"):
        return broken or "closed"
    head, _, rest = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
    chunked = re.search(rb"(?i)\r\ntransfer-encoding:\s*chunked", head)
    whole = (len(rest) >= int(length.group(1)) if length else rest.endswith(b"0\r\n\r\n") if chunked
             else not broken)
    return int(data.split(b" ", 2)[1]) if whole else "cut"


def tally(outcomes: list[int | str]) -> dict[str, int]:
    """How many of each outcome, most first."""
    return {str(k): n for k, n in Counter(outcomes).most_common()}


def _relayed(b: Bench, n: int, model: str, threads_n: int = 8) -> int:
    """`n` requests through the victim listener naming `model`; how many were answered 200."""
    return _in_parallel(n, threads_n, lambda: asked(b.victim_port, model)).count(200)


def _in_parallel(n: int, threads_n: int, ask: Callable[[], int | str]) -> list[int | str]:
    """`ask()` `n` times, `threads_n` at a time: the outcomes."""
    outcomes: list[int | str] = []
    lock = threading.Lock()
    todo = iter(range(n))

    def worker() -> None:
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            outcome = ask()
            with lock:
                outcomes.append(outcome)
    ts = [threading.Thread(target=worker) for _ in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return outcomes


@scenario
@exporting("endless")
def otlp_endless(b: Bench) -> dict:
    def run() -> dict:
        answered = _relayed(b, 200, "gpt-4o-mini")
        time.sleep(10)  # the exporter reads the collector's answer meanwhile: the memory it costs
        stop = time.monotonic()
        b.relay.stop()
        return {"answered": answered, "stop_s": round(time.monotonic() - stop, 1)}
    return b.attack(run)


@scenario
@exporting("hang")
def otlp_hang_names(b: Bench) -> dict:
    def run() -> dict:
        answered = _relayed(b, 2000, "m" * 200_000, threads_n=16)
        return {"answered": answered}
    return b.attack(run)


@scenario
@exporting("forge")
def otlp_forged_line(b: Bench) -> dict:
    def run() -> dict:
        _relayed(b, 3, "gpt-4o-mini")
        try:
            b.relay.wait_for_output(r"OTLP export to .* failed", timeout=20)
        except Exception:  # noqa: BLE001 (reported as not seen)
            return {"failure_logged": False}
        try:  # a line of its own, as the relay's console lines are: the line after the failure's
            b.relay.wait_for_output("^" + re.escape(HostileCollector.FORGED), timeout=3)
            forged_own_line = True
        except AssertionError:
            forged_own_line = False
        return {"failure_logged": True, "forged_line_on_its_own": forged_own_line}
    return b.attack(run)


@scenario
def metrics_evict(b: Bench) -> dict:
    url = b.metrics_url()
    attacker, attacker_url = start_fake_upstream()
    try:
        def run() -> dict:
            for _ in range(3):
                proxied(b.proxy_port, b.fake_url + "/v1/chat/completions", "gpt-4o")
            junk_ok = sum(proxied(b.proxy_port, attacker_url + "/v1/chat/completions", f"junk-{i}") == 200
                          for i in range(150))
            proxied(b.proxy_port, b.fake_url + "/v1/chat/completions", "gpt-4o")
            time.sleep(1)
            _, _, _, text = scrape(url)
            counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("gen_ai_client_operation_duration_seconds_count{")
                      and 'gen_ai_request_model="gpt-4o"' in line]
            return {"junk_answered_200": junk_ok, "gpt-4o_count": sum(counts) if counts else "evicted"}
        return b.attack(run)
    finally:
        attacker.terminate()
        attacker.wait(10)


@scenario
def pool_keepalive_race(b: Bench) -> dict:
    def run() -> dict:
        outcomes = _in_parallel(60, 4, lambda: asked(b.late_closing_port))
        time.sleep(1)  # the last records written
        port = b.late_closing.url.rsplit(":", 1)[1]
        theirs = [r for r in read_records(b.tmp / "timing.jsonl") if r.get("upstream", "").endswith(f":{port}")]
        return {"clients": tally(outcomes), "upstream_answered": b.late_closing.answered,
                "upstream_connections": b.late_closing.connections,
                "on_reused_connections": sum(r.get("reused_connection") is True for r in theirs),
                "sent_again": b.relay.text().count("sending the request once more"),
                "total_ms_p50_max": _p50_max([(r.get("phases") or {}).get("total", 0.0) for r in theirs])}
    return b.attack(run)


def _p50_max(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values) or [0.0]
    return round(ordered[len(ordered) // 2], 1), round(ordered[-1], 1)


OWN_RELAY: dict[str, Callable[[OwnRelay], dict]] = {}
"""Scenarios that start a relay of their own (the supervisor's start, reload and stop; a far link)."""


def own_relay(fn: Callable[[OwnRelay], dict]) -> Callable[[OwnRelay], dict]:
    OWN_RELAY[fn.__name__.replace("_", "-")] = fn
    return fn


@dataclass
class OwnRelay:
    """What such a scenario starts its relay from: the checkout whose relay runs (the relay
    script's), a directory of its own, the options given (`--set`)."""

    repo: Path
    tmp: Path
    options: dict[str, str]
    fake: subprocess.Popen[str] | None = None

    def supervised(self, **options: object) -> RelayWorkers:
        """`ttft-relay run --workers 2` in front of the fake upstream (not started yet)."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.fake, url = start_fake_upstream()
        return RelayWorkers(url, 2, self.tmp, {"relay_metrics_listen": "", **options, **self.options}, repo=self.repo)

    def mitmdump(self, modes: list[str], **options: object) -> MitmdumpProcess:
        """The relay as one mitmdump process (not started yet)."""
        from ttft_relay import config

        self.tmp.mkdir(parents=True, exist_ok=True)
        return MitmdumpProcess(modes, self.tmp, script=self.repo / "ttft_relay" / "relay.py",
                               options={**config.MITMPROXY_DEFAULTS, "relay_timing_log": self.tmp / "timing.jsonl",
                                        "relay_metrics_listen": "", **options, **self.options})

    def close(self) -> None:
        if self.fake is not None:
            self.fake.terminate()
            self.fake.wait(10)


def _until(condition: Callable[[], object], timeout: float) -> bool:
    """Polls `condition` (a process's children) until it holds; whether it did in time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _arriving(port: int, n: int, every_s: float) -> list[int | str]:
    """`n` clients, one every `every_s` (a pace, not a sync), each in a thread of its own: their outcomes."""
    outcomes: list[int | str] = []
    ts = []
    for _ in range(n):
        ts.append(threading.Thread(target=lambda: outcomes.append(asked(port))))
        ts[-1].start()
        time.sleep(every_s)
    for t in ts:
        t.join()
    return outcomes


def _exit(relay: RelayWorkers, within: float) -> int | str:
    """The supervisor's exit status if it exits within `within` seconds, else "serving"."""
    assert relay.proc is not None
    try:
        return relay.proc.wait(within)
    except subprocess.TimeoutExpired:
        return "serving"


@own_relay
def worker_dies_starting(s: OwnRelay) -> dict:
    relay = s.supervised().spawn()
    try:
        if not _until(lambda: 1 in relay.workers(), 120):  # spawned once worker 0 serves
            return {"error": "worker 1 never started: " + " | ".join(relay.lines[-5:])}
        os.kill(relay.workers()[1], signal.SIGKILL)
        outcomes = _arriving(relay.port, 40, every_s=0.05)
        ready = relay.wait_for(r"workers ready", 60)
        live = len(relay.workers())
        return {"clients": tally(outcomes), "ready_line": ready, "workers_alive_then": live,
                "supervisor": _exit(relay, 5)}
    finally:
        relay.stop()


@own_relay
def reload_starting(s: OwnRelay) -> dict:
    relay = s.supervised().spawn()
    try:
        if not _until(lambda: 0 in relay.workers(), 120):
            return {"error": "worker 0 never started: " + " | ".join(relay.lines[-5:])}
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGHUP)
        ready = relay.wait_for(r"workers ready", 60)
        outcomes = _arriving(relay.port, 10, every_s=0.05)
        return {"ready_line": ready, "clients_after": tally(outcomes), "supervisor": _exit(relay, 5),
                "workers_died": [ln for ln in relay.lines if re.search(r"exited \((?!0\))", ln)]}
    finally:
        relay.stop()


ARRIVAL_S = 0.05
"""stop-arriving: each of its 3 clients connects again every 50 ms (or once its last is over)."""


@own_relay
def stop_arriving(s: OwnRelay) -> dict:
    relay = s.supervised(relay_shutdown_grace=5).start()
    assert relay.proc is not None
    outcomes: list[tuple[float, int | str]] = []
    stopped = threading.Event()

    def arrive() -> None:
        while not stopped.is_set():
            began = time.monotonic()
            outcomes.append((began, asked(relay.port)))
            stopped.wait(max(0.0, ARRIVAL_S - (time.monotonic() - began)))  # a pace, not a sync
    held = threading.Thread(target=asked, args=(relay.port,),
                            kwargs={"headers": "x-fake-chunks: 300\r\nx-fake-gap-ms: 10\r\n", "stream": True})
    arriving = [threading.Thread(target=arrive) for _ in range(3)]
    try:
        held.start()
        for t in arriving:
            t.start()
        _until(lambda: sum(o == 200 for _, o in outcomes) >= 6, 60)
        signalled = time.monotonic()
        relay.proc.send_signal(signal.SIGTERM)
        code = _exit(relay, 60)
        stop_s = time.monotonic() - signalled
    finally:
        stopped.set()
        for t in [held, *arriving]:
            t.join(60)
        relay.stop()
    during = [o for at, o in outcomes if at >= signalled]
    answered = sum(isinstance(o, int) for _, o in outcomes) + 1  # and the held stream
    records = len(read_records(s.tmp / "timing-n.jsonl"))
    return {"stop_s": round(stop_s, 1), "supervisor": code, "during_the_stop": tally(during),
            "answered": answered, "records": records}


SILENT_FIRST_TOKEN_TIMEOUT_S = 30


@own_relay
def pool_silent(s: OwnRelay) -> dict:
    """The pool's connections to an upstream across a far link that then forgets them."""
    if (why := link.unavailable()) is not None:
        return {"error": f"no far link here: {why}"}
    with link.FarLink(delay_ms=5, seed=1) as far:
        with far.far.entered():
            fake = FakeUpstream(host=far.far.ip).start()
        try:
            relay = s.mitmdump([f"reverse:http://{far.far.ip}:{fake.port}@0"], relay_upstream_pool=True,
                               relay_first_token_timeout=SILENT_FIRST_TOKEN_TIMEOUT_S)
            relay.args = far.near.adopt(relay.args)
            with relay.start(), far.near.entered():  # the clients' threads in the relay's namespace
                def timed() -> int | str:
                    began = time.monotonic()
                    outcome = asked(relay.port, stream=True, timeout=2 * SILENT_FIRST_TOKEN_TIMEOUT_S)
                    return f"{outcome} after {time.monotonic() - began:.1f} s"
                _in_parallel(6, 6, lambda: asked(relay.port, stream=True))  # the pool keeps their connections
                time.sleep(1)  # the answers' ends reach the pool, which parks each connection
                far.forget()  # a NAT on the way lost its table: the kept connections' path is silent
                outcomes = sorted(_in_parallel(6, 6, timed), key=str)
        finally:
            fake.stop()
    after_forget = read_records(s.tmp / "timing.jsonl")[6:]
    return {"clients": outcomes, "their_records": tally([f"{r.get('status')} {r.get('error') or 'ok'}"[:90]
                                                         for r in after_forget])}


KILLS = 5


@own_relay
def kill_answered(s: OwnRelay) -> dict:
    """Workers killed -9 under load, again and again: of the requests whose clients had the whole
    answer, how many were recorded as lost (the kill between the answer's last byte and its record)."""
    relay = s.supervised().start()
    answered: list[str] = []
    stopped = threading.Event()

    def client(n: int) -> None:
        for i in range(1_000_000):
            if stopped.is_set():
                return
            rid = f"client{n}-{i}"
            if asked(relay.port, headers=f"x-request-id: {rid}\r\n") == 200:
                answered.append(rid)
    clients = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    try:
        for t in clients:
            t.start()
        for _ in range(KILLS):
            time.sleep(2)  # the pace of the kills: a worker restarted in between
            _until(relay.workers, 30)
            os.kill(random.choice(list(relay.workers().values())), signal.SIGKILL)
        time.sleep(2)
    finally:
        stopped.set()
        for t in clients:
            t.join(60)
        relay.stop()
    from ttft_relay.observe.ledger import LOST_ERROR

    records = read_records(s.tmp / "timing-n.jsonl")
    lost = {r.get("request_id") for r in records if r.get("error") == LOST_ERROR}
    return {"kills": KILLS, "answered_in_full": len(answered), "of_them_recorded_lost": len(lost & set(answered)),
            "lost_records": len(lost), "records": len(records)}


def closed_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def proxied(proxy_port: int, url: str, model: str) -> int:
    body = json.dumps({"model": model, "stream": False, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection(("127.0.0.1", proxy_port), 30) as s:
        s.sendall(f"POST {url} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
                  f"content-length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def scrape(url: str) -> tuple[int, int, float, str]:
    start = time.monotonic()
    text = urllib.request.urlopen(url, timeout=120).read().decode()
    took = time.monotonic() - start
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return series, len(text), took, text


@scenario
def metrics_junk(b: Bench) -> dict:
    url = b.metrics_url()
    ports = closed_ports(50)
    paths = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1beta/models/x:generateContent"]
    jobs = [(f"http://127.0.0.1:{ports[i % 50]}{paths[(i // 50) % 4]}", f"junk-model-{(i // 200) % 50}")
            for i in range(10_000)]

    def run() -> dict:
        lock = threading.Lock()
        todo = iter(jobs)

        def worker() -> None:
            while True:
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                proxied(b.proxy_port, *job)

        ts = [threading.Thread(target=worker) for _ in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        real = proxied(b.proxy_port, b.fake_url + "/v1/chat/completions", "gpt-4o")
        time.sleep(1)
        series, size, took, text = scrape(url)
        labelled = 'gen_ai_request_model="gpt-4o"' in text
        return {"series": series, "scrape_mb": round(size / 1e6, 1), "scrape_s": round(took, 2),
                "real_model_status": real, "gpt-4o_labelled": labelled}
    return b.attack(run)


@scenario
def metrics_idle(b: Bench) -> dict:
    url = b.metrics_url()
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    def run() -> dict:
        before = threads(b.pid)
        idle = []
        for _ in range(1000):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), 5))
            except OSError:
                break
        time.sleep(2)
        during = threads(b.pid)
        start = time.monotonic()
        try:
            scrape(url)
            scraped = round(time.monotonic() - start, 2)
        except OSError as e:
            scraped = f"failed: {e}"
        other_path = urllib.request.Request(url.replace("/metrics", "/anything"))
        try:
            other = urllib.request.urlopen(other_path, timeout=10).status
        except urllib.error.HTTPError as e:
            other = e.code
        closed = closed_by_peer(idle, 12)
        for s in idle:
            s.close()
        return {"threads_before": before, "threads_with_1000_idle": during, "scrape_s_meanwhile": scraped,
                "other_path_status": other, "idle_closed_by_relay_within_12s": closed}
    return b.attack(run)


def closed_by_peer(socks: list[socket.socket], within: float) -> int:
    """How many of `socks` the other side closed within `within` seconds (all waited on at once)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + within
    while sel.get_map() and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            sel.unregister(key.fileobj)
            try:
                closed += key.fileobj.recv(1) == b""
            except OSError:
                closed += 1
    sel.close()
    return closed


def run_on_bench(name: str, relay_script: Path, tmp: Path, options: dict[str, str]) -> dict:
    # A relay per scenario: one attack's leftovers (memory, threads) are not the next one's.
    b = Bench(relay_script, tmp, options)
    try:
        base = b.baseline()
        result = SCENARIOS[name](b)
        result["victim_gap_ratio"] = round(result["victim_max_gap_ms"] / max(base["victim_max_gap_ms"], 1e-3), 1)
        result["baseline_max_gap_ms"] = base["victim_max_gap_ms"]
        result["relay_alive"] = b.relay.proc.poll() is None
    finally:
        b.close()
    return result


def run_own_relay(name: str, relay_script: Path, tmp: Path, options: dict[str, str]) -> dict:
    """A scenario with a relay of its own, run from the relay script's checkout."""
    own = OwnRelay(relay_script.resolve().parents[1], tmp, options)
    try:
        return OWN_RELAY[name](own)
    finally:
        own.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", action="append", choices=sorted({*SCENARIOS, *OWN_RELAY}), help="(default: all)")
    ap.add_argument("--relay-script", type=Path, default=RELAY_SCRIPT,
                    help="the relay to attack (another checkout's ttft_relay/relay.py: before a change)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a relay option")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--victim", type=int, metavar="PORT", help=argparse.SUPPRESS)  # Victim's own process
    args = ap.parse_args()
    if args.victim:
        victim_stream(args.victim)
        return
    options = dict(item.split("=", 1) for item in args.set)
    results: dict[str, dict] = {}
    collector = HostileCollector()
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        for name in args.scenario or sorted({*SCENARIOS, *OWN_RELAY}):
            if name in OWN_RELAY:
                result = run_own_relay(name, args.relay_script, Path(tmp) / name, options)
            else:
                result = run_on_bench(name, args.relay_script, Path(tmp) / name,
                                      {**options, **(RELAY_OPTIONS[name](collector) if name in RELAY_OPTIONS else {})})
            results[name] = result
            if not args.json:
                print(f"{name:18} " + "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    collector.close()
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
