"""Reload benchmark: what a `systemctl reload` and a `systemctl restart` add to the first token of the clients arriving meanwhile.

The relay under its supervisor (`ttft-relay run --workers N`, as scripts/relay runs it)
on a listening socket this process holds and passes as systemd's socket unit does
(deploy/ttft-relay.socket; `ttft_relay/testing/socket_activation.py`), one TLS listener
in front of a fake OpenAI upstream (in this process), a stream held in flight across
every reload and restart, and a client arriving every 100 ms on a new TLS connection.
Windows take turns, round after round, so that drift on a shared machine hits all alike:

    steady   no reload
    reload   a SIGHUP at the window's start (relay.conf read again, new workers
             started on the same socket, the old ones finishing their turns); the
             window lasts until the new workers have taken over
    restart  SIGTERM at the window's start; the held stream ends on its own once the
             relay stops (a turn finishing within the grace), then systemd's restart:
             the relay exits, the next one starts on the same socket; the window lasts
             until it serves

Per window kind: clients, first token p50/p90/max (from the connect to the first
answer text, TLS handshake included), refused or failed clients, and the ratios to the
steady windows' figures. The streams held across reloads and restarts must end whole
("cut" counts those that did not).

    scripts/bench reload [--rounds 4] [--window 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson

from ttft_relay.testing import socket_activation
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.upstream import FakeUpstream

REPO = Path(__file__).resolve().parent.parent
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}
EVERY_S = 0.1


class Relay:
    """`ttft-relay run --workers N` with relay.conf at `conf`, on systemd's socket `unit`, its output watched."""

    def __init__(self, conf: Path, args: list[str], unit: socket.socket) -> None:
        command, fds = socket_activation.command([unit], [sys.executable, "-m", "ttft_relay", "run", *args])
        self.proc = subprocess.Popen(command, cwd=REPO, pass_fds=fds,
                                     env={**os.environ, "TTFT_RELAY_CONF": str(conf)}, process_group=0,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def said(self, pattern: str, after: int = 0) -> bool:
        with self.changed:
            return any(re.search(pattern, ln) for ln in self.lines[after:])

    def wait_for(self, pattern: str, after: int = 0, timeout: float = 120) -> None:
        rx = re.compile(pattern)
        with self.changed:
            if not self.changed.wait_for(lambda: any(rx.search(ln) for ln in self.lines[after:]), timeout):
                raise SystemExit(f"the relay never said {pattern!r}:\n" + "\n".join(self.lines[-30:]))


def first_token_ms(port: int, tls: ssl.SSLContext) -> float | str:
    """ms from the connect to the first answer text of one stream, or what ended it."""
    began = time.perf_counter()
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", orjson.dumps(CHAT), {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return f"status {resp.status}"
        while line := resp.readline():
            if b'"content"' in line:
                took = (time.perf_counter() - began) * 1000
                resp.read()
                return took
        return "no answer text"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return type(e).__name__
    finally:
        conn.close()


def window(port: int, tls: ssl.SSLContext, seconds: float, over: Callable[[], bool] = lambda: True) -> list[float | str]:
    """A client arriving every EVERY_S for `seconds` and until `over()`, each in a thread of its own."""
    out: list[float | str] = []
    threads = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end or not over():
        t = threading.Thread(target=lambda: out.append(first_token_ms(port, tls)))
        t.start()
        threads.append(t)
        time.sleep(max(0.0, EVERY_S - (time.monotonic() - now)))  # the arrival pace, not a sync
    for t in threads:
        t.join(60)
    return out


def summary(results: list[float | str]) -> dict[str, float | int]:
    times = sorted(r for r in results if isinstance(r, float))
    return {"clients": len(results), "failed": len(results) - len(times),
            "p50": statistics.median(times) if times else float("nan"),
            "p90": times[int(0.9 * (len(times) - 1))] if times else float("nan"),
            "max": times[-1] if times else float("nan")}


def held_stream(port: int, ca: Path) -> tuple[client.HttpConnection, client.RawResponse, Iterator[client.TimedChunk], bytes]:
    """A stream that stalls after its first chunk until the upstream's `release_stalls`."""
    held = client.HttpConnection(f"https://localhost:{port}", ca=ca, timeout=60)
    resp = held.request("POST", "/v1/chat/completions", CHAT, {"x-fake-stall-after-chunks": "1"})
    chunks = resp.chunks()
    return held, resp, chunks, next(chunks).data


def restart(stopping: Relay, mark: int, upstream: FakeUpstream, start: Callable[[], Relay],
            arriving: Callable[[Callable[[], bool]], list[float | str]]) -> tuple[Relay, list[float | str]]:
    """systemctl restart on the socket unit, clients `arriving` until the next relay serves: SIGTERM;
    once the relay stops, the turn held in flight ends (within the grace); once it exited, systemd
    `start`s the next one on the same socket. (The next relay, the clients' results.)"""
    stopping.proc.send_signal(signal.SIGTERM)
    started: list[Relay] = []

    def stop_then_start() -> None:
        stopping.wait_for(r"stopping: waiting up to", mark)
        upstream.release_stalls()
        stopping.proc.wait(120)
        started.append(start())

    thread = threading.Thread(target=stop_then_start)
    thread.start()
    results = arriving(lambda: bool(started) and started[0].said(r"\d+ workers ready"))
    thread.join()
    return started[0], results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench reload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=float, default=4.0, help="seconds per window (default 4)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    kinds = ("steady", "reload", "restart")
    with (tempfile.TemporaryDirectory(prefix="bench-reload-") as tmp, FakeUpstream() as upstream,
          socket.create_server(("127.0.0.1", 0)) as unit):
        work = Path(tmp)
        certs = TestCerts.create(work / "certs")
        port = unit.getsockname()[1]
        conf = work / "relay.conf"
        conf.write_text(f"listen_host: 127.0.0.1\nmode:\n  - reverse:{upstream.base_url}@{port}\n"
                        f"certs:\n  - '*={certs.cert_and_key_pem}'\nrelay_metrics_listen: ''\n"
                        f"relay_trim: false\nconfdir: {work / 'confdir'}\n")
        relay_args = ["--workers", str(args.workers)]
        relay = Relay(conf, relay_args, unit)
        tls = ssl.create_default_context(cafile=str(certs.ca_pem))
        tls.check_hostname = False
        results: dict[str, list[float | str]] = {kind: [] for kind in kinds}
        cut = held_total = 0
        try:
            relay.wait_for(r"\d+ workers ready")
            window(port, tls, 1.0)  # warm: the TLS session cache, the upstream connections
            for n in range(args.rounds):
                for kind in kinds[n % 3:] + kinds[:n % 3]:
                    if kind == "steady":
                        results[kind] += window(port, tls, args.window)
                        continue
                    held, resp, chunks, first = held_stream(port, certs.ca_pem)
                    mark = len(relay.lines)
                    if kind == "reload":
                        relay.proc.send_signal(signal.SIGHUP)
                        results[kind] += window(port, tls, args.window,
                                                lambda mark=mark, relay=relay: relay.said(r"reloaded: ", mark))
                        upstream.release_stalls()
                    else:
                        relay, arrived = restart(relay, mark, upstream,
                                                 lambda: Relay(conf, relay_args, unit),
                                                 lambda over: window(port, tls, args.window, over))
                        results[kind] += arrived
                    with held:
                        body = first + b"".join(c.data for c in chunks)
                    held_total += 1
                    cut += not (resp.complete and b"[DONE]" in body)
        finally:
            relay.proc.send_signal(signal.SIGINT)
            relay.proc.wait(120)
    summaries = {kind: summary(results[kind]) for kind in kinds}
    steady = summaries["steady"]
    print(f"{args.rounds} rounds of {args.window:.0f} s windows, a TLS client every {EVERY_S * 1000:.0f} ms, "
          f"--workers {args.workers}, on a socket held as systemd's socket unit holds it")
    print(f"{'':8} {'clients':>8} {'failed':>7} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8}")
    for name, s in summaries.items():
        print(f"{name:8} {s['clients']:>8} {s['failed']:>7} {s['p50']:>8.0f} {s['p90']:>8.0f} {s['max']:>8.0f}")
    for name in kinds[1:]:
        s = summaries[name]
        print(f"{name}/steady: p50 {s['p50'] / steady['p50']:.2f}x, p90 {s['p90'] / steady['p90']:.2f}x, "
              f"max {s['max'] / steady['max']:.2f}x, added p50 {s['p50'] - steady['p50']:.0f} ms, "
              f"max {s['max'] - steady['max']:.0f} ms")
    print(f"streams held across a reload or restart: {held_total}, cut: {cut}")
    failures = [r for kind in kinds for r in results[kind] if not isinstance(r, float)]
    if failures:
        print("failures:", sorted(set(map(str, failures))))
    return 1 if failures or cut else 0


if __name__ == "__main__":
    sys.exit(main())
