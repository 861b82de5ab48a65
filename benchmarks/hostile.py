"""Hostile input benchmark: what an attacker's frames, junk requests and garbage upstreams
cost the relay, and what they cost everyone else's streams.

One relay (mitmdump -s ttft_relay/relay.py with its defaults, or `--relay-script` another
checkout's, to measure before and after a change) with three listeners: reverse to the fake
upstream (the victims' streams), reverse to a hostile upstream (ttft_relay/testing/fakes/hostile.py),
and a regular proxy listener (the junk requests). Per scenario:

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

    scripts/bench hostile [--scenario NAME ...] [--relay-script PATH] [--set NAME=VALUE ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ttft_relay.testing.fakes import hostile
from ttft_relay.testing.fakes.hostile import BINARY, CONTINUATION, PING, TEXT, HostileUpstream, RawClient, frame
from ttft_relay.testing.harness import RELAY_SCRIPT, MitmdumpProcess, start_fake_upstream

GIB = 1 << 30
EVENT_GAP_MS = 10
VICTIM_EVENTS = 1500
"""15 s of events: longer than any attack here."""
SCENARIOS: dict[str, Callable[[Bench], dict]] = {}


def scenario(fn: Callable[[Bench], dict]) -> Callable[[Bench], dict]:
    SCENARIOS[fn.__name__.replace("_", "-")] = fn
    return fn


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
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
    """An event stream through the relay, read in a thread; `arrivals` are read times."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.arrivals: list[float] = []
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps({"model": "gpt-4o-mini", "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"x-fake-chunks: {VICTIM_EVENTS}\r\nx-fake-gap-ms: {EVENT_GAP_MS}\r\nx-request-id: victim\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        try:
            with socket.create_connection(("127.0.0.1", self.port), 60) as s:
                s.sendall(head + body)
                while data := s.recv(65536):
                    self.arrivals.append(time.monotonic())
                    if b"[DONE]" in data:
                        break
        finally:
            self.done.set()

    def start(self) -> Victim:
        self._thread.start()
        while not self.arrivals and not self.done.wait(0.01):
            pass
        return self

    def max_gap_ms(self, start: float, end: float) -> float:
        ts = [t for t in self.arrivals if start <= t <= end]
        return max((b - a for a, b in zip(ts, ts[1:])), default=0.0) * 1000

    def stop(self) -> None:
        self._thread.join(60)


class Bench:
    def __init__(self, relay_script: Path, tmp: Path, options: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.fake, self.fake_url = start_fake_upstream()
        self.hostile = HostileUpstream(ATTACKS).__enter__()
        from ttft_relay import config

        # mitmproxy takes one listener per address: port 0 only once.
        ports = closed_ports(2)
        self.relay = MitmdumpProcess(
            [f"reverse:{self.fake_url}@{ports[0]}", f"reverse:{self.hostile.base_url}@{ports[1]}", "regular@0"], tmp,
            script=relay_script,
            options={**config.MITMPROXY_DEFAULTS, "relay_timing_log": tmp / "timing.jsonl",
                     "relay_metrics_listen": "127.0.0.1:0", **(options or {})})
        try:
            self.relay.start()
        except BaseException:
            self.close()
            raise
        self.pid = self.relay.proc.pid
        self.victim_port, self.hostile_port, self.proxy_port = self.relay.ports

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="(default: all)")
    ap.add_argument("--relay-script", type=Path, default=RELAY_SCRIPT,
                    help="the relay to attack (another checkout's ttft_relay/relay.py: before a change)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a relay option")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    options = dict(item.split("=", 1) for item in args.set)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        for name in args.scenario or sorted(SCENARIOS):
            # A relay per scenario: one attack's leftovers (memory, threads) are not the next one's.
            b = Bench(args.relay_script, Path(tmp) / name, options)
            try:
                base = b.baseline()
                result = SCENARIOS[name](b)
                result["victim_gap_ratio"] = round(result["victim_max_gap_ms"] / max(base["victim_max_gap_ms"], 1e-3), 1)
                result["baseline_max_gap_ms"] = base["victim_max_gap_ms"]
                alive = b.relay.proc.poll() is None
                result["relay_alive"] = alive
            finally:
                b.close()
            results[name] = result
            if not args.json:
                print(f"{name:18} " + "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
