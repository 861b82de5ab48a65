"""A new upstream connection's round trips on a far link: TLS resumption, the route's initial window (issue 40).

Where the pool does not cover a request (the pool off, a burst larger than the pool, an
HTTP/2 client, `keep_host_header`, an HTTPS proxy), it opens an upstream connection of its
own: a TCP connect (one round trip), a TLS handshake (one on TLS 1.3, two on TLS 1.2), and the
request's upload, which leaves in one flight only when it fits the connection's initial
congestion window (ten segments, ~14 kB, a little more once the handshake's packets were
acknowledged); a longer body waits a round trip per doubling. Two things the relay and its
system can do: resume the upstream's TLS session (`relay_upstream_tls_resumption`: no
certificate chain, no verification), and a larger initial window on the VPS's route
(`ip route change default ... initcwnd N initrwnd N`, README's VPS recipe).

A real far link (ttft_relay/testing/fakes/link.py: two network namespaces, a round trip of
2 x --one-way-ms), the HTTPS fake upstream beyond it (TLS 1.3), the relay with the pool off
beside the client, so each request on a new client connection opens its own upstream
connection. The arms take turns, each with a relay of its own:

- `full`: `relay_upstream_tls_resumption=false`, the kernel's route;
- `resumed`: resumption on (the default), the kernel's route;
- `initcwnd`: resumed, and the relay's route to the upstream with `initcwnd --initcwnd`;
- `initcwnd+rwnd`: that, and the upstream's route back with `initrwnd` as large (the window
  a provider advertises is its own; Linux's first one is ~64 kB);
- `tls12-full`, `tls12-resumed`: the first two with the relay's upstream TLS at most 1.2
  (`tls_version_server_max=TLS1_2`), where a resumed handshake is one round trip, a full two.

Per arm and body size: the records' `upstream_connect`, `upstream_tls` and `upstream_upload` p50
(docs/records.md), how many handshakes resumed, and the first token p50 as the client sees it.

Needs root and network namespaces (as the far-link tests). Run it under the CPU lock:

    flock /tmp/ttft-cpu.lock scripts/bench far_round_trips [--one-way-ms 50] [--kb 4,16,32,60] [--requests 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from benchmarks.pool_cc import body, request
from ttft_relay import config
from ttft_relay.testing.fakes import link
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import MitmdumpProcess

ARMS = ("full", "resumed", "initcwnd", "initcwnd+rwnd", "tls12-full", "tls12-resumed")
RELAY_OPTIONS = {
    "relay_timing_console": False, "relay_metrics_listen": "", "flow_detail": 0, "relay_trim": False,
    "relay_upstream_pool": False, "ssl_insecure": True,
}
PHASES = ("upstream_connect", "upstream_tls", "upstream_upload")


def run_arm(far: link.FarLink, upstream: str, confdir: Path, log: Path, arm: str, args) -> list[tuple]:
    if arm.startswith("initcwnd"):
        far.route(far.near, initcwnd=args.initcwnd)
    if arm == "initcwnd+rwnd":
        far.route(far.far, initrwnd=args.initcwnd)
    relay = MitmdumpProcess([f"reverse:{upstream}@0"], confdir, options={
        **config.MITMPROXY_DEFAULTS, **RELAY_OPTIONS, "relay_timing_log": log,
        "relay_upstream_tls_resumption": not arm.endswith("full"),
        "tls_version_server_max": "TLS1_2" if arm.startswith("tls12") else "UNBOUNDED"})
    relay.args = far.near.adopt(relay.args)
    seen = []
    try:
        with relay.start(), far.near.entered():
            assert relay.log is not None
            request(relay.url(), body(1), f"warm-{uuid.uuid4().hex[:8]}")  # a session to resume, the tokenizer loaded
            for kb in args.kb:
                payload = body(kb)
                for _ in range(args.requests):
                    rid = f"{arm}-{kb}-{uuid.uuid4().hex[:8]}"
                    seen.append((arm, kb, rid, request(relay.url(), payload, rid)))
            records = {r["request_id"]: r for r in relay.log.wait(len(seen) + 1)}
    finally:
        far.route(far.near)
        far.route(far.far)
    return [(a, kb, ft, records[rid]) for a, kb, rid, ft in seen]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench far_round_trips", description=__doc__.split("\n\n")[0])
    ap.add_argument("--one-way-ms", type=float, default=50)
    ap.add_argument("--kb", default="4,16,32,60", help="request body sizes, comma-separated")
    ap.add_argument("--requests", type=int, default=5, help="per size and arm")
    ap.add_argument("--initcwnd", type=int, default=64, help="the initcwnd arm's initial window (segments)")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args(argv)
    args.kb = [int(kb) for kb in args.kb.split(",")]
    arms = args.arms.split(",")
    if (why := link.unavailable()) is not None:
        print(f"no far link here: {why}", file=sys.stderr)
        return 2
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as tmp, link.FarLink(delay_ms=args.one_way_ms, seed=1) as far:
        certs = TestCerts.create(Path(tmp) / "certs")
        with far.far.entered():
            fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip).start()
        try:
            fake.behaviour.prefill_ms = 10
            fake.behaviour.chunks = 5
            upstream = f"https://{far.far.ip}:{fake.port}"
            for i, arm in enumerate(arms):  # an arm named twice runs twice (its rows together)
                rows += run_arm(far, upstream, Path(tmp) / "confdir", Path(tmp) / f"timing-{i}.jsonl", arm, args)
        finally:
            fake.stop()
    print(f"far link: round trip {2 * args.one_way_ms:g} ms; each request on a new client connection, the pool "
          f"off (a new upstream connection each); {args.requests} per size and arm; p50s in ms")
    print(f"{'arm':<14} {'kB':>3} {'connect':>7} {'tls':>6} {'upload':>7} {'first token':>11} {'resumed':>7}")
    for arm in dict.fromkeys(arms):
        for kb in args.kb:
            mine = [(ft, rec) for a, k, ft, rec in rows if a == arm and k == kb]
            p50 = {phase: statistics.median(rec["phases"].get(phase, 0.0) for _, rec in mine) for phase in PHASES}
            resumed = sum(1 for _, rec in mine if rec.get("upstream_tls_resumed"))
            print(f"{arm:<14} {kb:>3} {p50['upstream_connect']:>7.1f} {p50['upstream_tls']:>6.1f} "
                  f"{p50['upstream_upload']:>7.1f} {statistics.median(ft for ft, _ in mine):>11.1f} "
                  f"{resumed:>4}/{len(mine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
