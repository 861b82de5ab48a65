"""BBR against cubic on the upstream pool's connections to a far upstream (issue 40).

The pool's connections outlive their client connections: one carries request after request,
idle in between. How the kernel sends a request's body on it after an idle spell is its
congestion control's: cubic (with net.ipv4.tcp_slow_start_after_idle, the default) starts
over from the initial window after an idle spell longer than the retransmission timeout, so a
body beyond ten segments waits a round trip per doubling; BBR keeps its window across idle
spells, but every 10 s without a new lowest round trip it holds the window at four packets
for at least 200 ms (PROBE_RTT). Which one the pool's sockets get is
`relay_upstream_pool_congestion` (TCP_CONGESTION on each socket).

A real far link (ttft_relay/testing/fakes/link.py: two network namespaces, a round trip of
2 x --one-way-ms), the fake upstream beyond it, the relay with the pool on beside the client;
each request on a new client connection (so on a pooled upstream connection), a body of
--kb kB, after an idle gap (--gaps, seconds). The arms take turns, --rounds times, each with
a relay of its own. Per arm and gap: the record's `upstream_upload` p50 (the request's last
byte leaving the relay's socket, beyond its first flight: docs/records.md) and the first token
p50 as the client sees it (from its request's last byte to the first chunk).

Needs root and network namespaces (as the far-link tests). Run it under the CPU lock:

    flock /tmp/ttft-cpu.lock scripts/bench pool_cc [--one-way-ms 50] [--kb 64] [--gaps 0.3,3,11] [--requests 4] [--rounds 2]

`--initcwnd N` gives the relay's route to the upstream an initial window of N segments (the
README's optional VPS step: cubic restarts an idle connection from it too), and
`--keep-window-after-idle` sets net.ipv4.tcp_slow_start_after_idle=0 in the relay's namespace.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ttft_relay import config
from ttft_relay.testing.fakes import link
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import MitmdumpProcess

ARMS = ("cubic", "bbr")
RELAY_OPTIONS = {
    "relay_timing_console": False, "relay_metrics_listen": "", "flow_detail": 0, "relay_trim": False,
    "relay_upstream_pool": True,
}


def body(kb: int) -> dict:
    words = "context " * max(0, (kb * 1024 - 200) // len("context "))
    return {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": words}]}


def request(url: str, payload: dict, rid: str) -> float:
    """One request on a new client connection; its first token as the client saw it (ms)."""
    with HttpConnection(url) as conn:
        response = conn.request("POST", "/v1/chat/completions", payload, {"x-request-id": rid})
        chunks = list(response.chunks())
        assert response.status == 200 and response.complete, response.status
        return (chunks[0].at - response.request_sent_at) * 1000


def run_arm(far: link.FarLink, upstream: str, confdir: Path, log: Path, congestion: str, args) -> list[tuple]:
    relay = MitmdumpProcess([f"reverse:{upstream}@0"], confdir, options={
        **config.MITMPROXY_DEFAULTS, **RELAY_OPTIONS, "relay_timing_log": log,
        "relay_upstream_pool_congestion": congestion})
    relay.args = far.near.adopt(relay.args)
    payload = body(args.kb)
    seen = []
    with relay.start(), far.near.entered():
        assert relay.log is not None
        request(relay.url(), payload, f"warm-{uuid.uuid4().hex[:8]}")  # the pool's connections open, the tokenizer loads
        for gap in args.gaps:
            for _ in range(args.requests):
                time.sleep(gap)  # the scenario: the pooled connection idle this long
                rid = f"{congestion}-{gap:g}-{uuid.uuid4().hex[:8]}"
                seen.append((congestion, gap, rid, request(relay.url(), payload, rid)))
        records = {r["request_id"]: r for r in relay.log.wait(len(seen) + 1)}
    return [(cc, gap, ft, records[rid]) for cc, gap, rid, ft in seen]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench pool_cc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--one-way-ms", type=float, default=50)
    ap.add_argument("--kb", type=int, default=64, help="request body size")
    ap.add_argument("--gaps", default="0.3,3,11", help="idle seconds before each request, comma-separated")
    ap.add_argument("--requests", type=int, default=4, help="per gap, arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--initcwnd", type=int, default=0,
                    help="the relay's route to the upstream with this initial window (segments; 0: the kernel's)")
    ap.add_argument("--keep-window-after-idle", action="store_true",
                    help="net.ipv4.tcp_slow_start_after_idle=0 on the relay's side")
    args = ap.parse_args(argv)
    args.gaps = [float(g) for g in args.gaps.split(",")]
    if (why := link.unavailable()) is not None:
        print(f"no far link here: {why}", file=sys.stderr)
        return 2
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as tmp, link.FarLink(delay_ms=args.one_way_ms, seed=1) as far:
        if args.initcwnd:
            far.route(far.near, initcwnd=args.initcwnd)
        if args.keep_window_after_idle:
            subprocess.run(far.near.adopt(["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"]), check=True)
        with far.far.entered():
            fake = FakeUpstream(host=far.far.ip).start()
        try:
            fake.behaviour.prefill_ms = 10
            fake.behaviour.chunks = 5
            upstream = f"http://{far.far.ip}:{fake.port}"
            for r in range(args.rounds):
                for congestion in ARMS if r % 2 == 0 else ARMS[::-1]:
                    log = Path(tmp) / f"timing-{congestion}-{r}.jsonl"
                    rows += run_arm(far, upstream, Path(tmp) / "confdir", log, congestion, args)
        finally:
            fake.stop()
    print(f"far link: round trip {2 * args.one_way_ms:g} ms; {args.kb} kB requests, each on a new client "
          f"connection (a pooled upstream one); {args.requests} x {args.rounds} per gap and arm; route initcwnd "
          f"{args.initcwnd or 'default'}; slow start after idle {'off' if args.keep_window_after_idle else 'on'}")
    print(f"{'arm':<6} {'idle s':>6} {'upstream_upload p50':>19} {'max':>7} {'first token p50':>15} {'max':>7} "
          f"{'reused':>6}")
    for congestion in ARMS:
        for gap in args.gaps:
            mine = [(ft, rec) for cc, g, ft, rec in rows if cc == congestion and g == gap]
            uploads = [rec["phases"].get("upstream_upload", 0.0) for _, rec in mine]
            firsts = [ft for ft, _ in mine]
            reused = sum(1 for _, rec in mine if rec["reused_connection"])
            print(f"{congestion:<6} {gap:>6g} {statistics.median(uploads):>16.1f} ms {max(uploads):>4.0f} ms "
                  f"{statistics.median(firsts):>12.1f} ms {max(firsts):>4.0f} ms {reused:>3}/{len(mine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
