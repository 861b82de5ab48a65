"""Issue 40's numbers side by side, in one run: each a short pass of the benchmark that measures it.

- **a new client connection on a far link** (ttft_relay/testing/fakes/link.py, a round trip of
  2 x --one-way-ms, the HTTPS fake beyond it): first token p50 as the client sees it, from
  before its connect, each request on a new client connection: direct (the client's own TCP
  and TLS to the fake), the relay with the pool on (the default) and off
  (`relay_upstream_pool=false`); and a kept-alive client connection's later requests (from
  each request's start) against the pool's new connections (issue 40: ≤ 1.05);
- **an upstream name with a black-holed IPv6 address** (`scripts/bench dial`): the first request
  and the first token p50 with the name's addresses raced, against an IPv4-only name;
- **from a start to the first answer** (`scripts/bench start`, `ttft-relay run`): the port open,
  the first answer, both from the start;
- **the added first token at one stream** (`scripts/bench overhead`'s request, `references.py`'s
  proxies): one stream at a time on loopback, a new connection each, round-robin over direct,
  nginx, Envoy, a bare streaming mitmdump and the relay; p50 and what each adds over direct.

A part whose tools are missing here (root and namespaces for the first two, nginx or Envoy)
says so in its row. Run it under the CPU lock:

    flock /tmp/ttft-cpu.lock scripts/bench summary [--requests 10] [--one-way-ms 50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import dial, references, start
from benchmarks._setups import BASELINE_SCRIPT
from benchmarks.overhead import first_token_ms
from benchmarks.pool_cc import body, request
from ttft_relay import config
from ttft_relay.testing.fakes import link
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import MitmdumpProcess, start_fake_upstream

Row = tuple[str, str, str]
"""(what, setup, figure)."""
RELAY_OPTIONS = {"relay_timing_console": False, "relay_metrics_listen": "", "flow_detail": 0, "relay_trim": False}


def p50(samples: list[float]) -> str:
    return f"{statistics.median(samples):.1f} ms"


def far_new_connections(requests: int, one_way_ms: float, tmp: Path) -> list[Row]:
    what = f"new client connection, far link ({2 * one_way_ms:g} ms RTT, TLS), first token p50"
    if (why := link.unavailable()) is not None:
        return [(what, "-", f"not run: {why}")]
    certs = TestCerts.create(tmp / "certs", ips=("127.0.0.1", link.FAR_IP))
    rows = []
    with link.FarLink(delay_ms=one_way_ms, seed=1) as far:
        with far.far.entered():
            fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip).start()
        try:
            fake.behaviour.prefill_ms = 10
            upstream = f"https://{far.far.ip}:{fake.port}"
            with far.near.entered():
                direct = [new_connection_first_token(upstream, certs.ca_pem) for _ in range(requests)]
            rows.append((what, "direct (the client's own TCP and TLS)", p50(direct)))
            for name, pool in (("relay, pool on (default)", True), ("relay, pool off", False)):
                relay = MitmdumpProcess([f"reverse:{upstream}@0"], tmp / "confdir", options={
                    **config.MITMPROXY_DEFAULTS, **RELAY_OPTIONS, "relay_timing_log": tmp / f"far-{pool}.jsonl",
                    "ssl_verify_upstream_trusted_ca": certs.ca_pem, "relay_upstream_pool": pool})
                relay.args = far.near.adopt(relay.args)
                with relay.start(), far.near.entered():
                    request(relay.url(), body(1), "warm")  # the pool's connections open, the tokenizer loads
                    samples = [new_connection_first_token(relay.url()) for _ in range(requests)]
                    if pool:
                        with HttpConnection(relay.url()) as conn:
                            kept = [_first_token(conn, time.time()) for _ in range(requests + 1)][1:]
                rows.append((what, name, f"{p50(samples)} ({statistics.median(samples) / statistics.median(direct):.2f}x direct)"))
                if pool:
                    rows.append((what, "relay, a kept-alive client connection's later requests",
                                 f"{p50(kept)} (new / kept {statistics.median(samples) / statistics.median(kept):.2f})"))
        finally:
            fake.stop()
    return rows


def new_connection_first_token(url: str, ca: Path | None = None) -> float:
    """ms from before a new client connection's connect (and TLS handshake) to its first body chunk."""
    began = time.time()
    with HttpConnection(url, ca=ca) as conn:
        return _first_token(conn, began)


def _first_token(conn: HttpConnection, began: float) -> float:
    response = conn.request("POST", "/v1/chat/completions", body(1), {"x-request-id": f"s-{uuid.uuid4().hex[:8]}"})
    chunks = list(response.chunks())
    assert response.status == 200 and response.complete, response.status
    return (chunks[0].at - began) * 1000


def black_hole(requests: int) -> list[Row]:
    what = "IPv6 black hole ([::1] dead, 127.0.0.1 alive), new connection each"
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return [(what, "-", "not run: needs root and unshare(1)")]
    first, results = dial.measure(requests, setups=("relay-v4", "relay-dual"))
    return [(what, name, f"first request {first[name][1]:.1f} ms, first token p50 "
             f"{p50([ms for _, ms in results[name]])}, answered {sum(s == 200 for s, _ in results[name])}/"
             f"{len(results[name])}") for name in ("relay-v4", "relay-dual")]


def start_to_answer(tmp: Path) -> list[Row]:
    with FakeUpstream() as upstream:
        steps = start.start_once("run", upstream, tmp)
    return [("start to first answered request (ttft-relay run)", "relay",
             f"port open {steps['port']:.0f} ms, first answer {steps['answer']:.0f} ms "
             f"({steps['port_to_answer']:.0f} ms after the port opened)")]


def one_stream(requests: int, tmp: Path) -> list[Row]:
    what = "added first token, one stream at a time (loopback, new connection each), p50"
    fake, upstream = start_fake_upstream(prefill_ms=50, chunks=20)
    setups: dict[str, object] = {}
    missing = [kind for kind in ("nginx", "envoy") if references.binary(kind) is None]
    try:
        for kind in ("nginx", "envoy"):
            if kind not in missing:
                setups[kind] = references.ReferenceProxy(kind, upstream, tmp).start()
        mode = f"reverse:{upstream}@0"
        setups["bare mitmdump"] = MitmdumpProcess([mode], tmp, script=BASELINE_SCRIPT, options={"flow_detail": 0}).start()
        setups["relay"] = MitmdumpProcess([mode], tmp, options={**RELAY_OPTIONS,
                                                                 "relay_timing_log": tmp / "one.jsonl"}).start()
        urls = {"direct": upstream, **{name: proxy.url() for name, proxy in setups.items()}}  # type: ignore[attr-defined]
        for url in urls.values():
            first_token_ms(url)  # first-use costs out of the way
        latency: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(requests):
            for name, url in urls.items():
                latency[name].append(first_token_ms(url))
    finally:
        for proxy in setups.values():
            proxy.stop()  # type: ignore[attr-defined]
        fake.terminate()
        fake.wait(10)
    direct = statistics.median(latency["direct"])
    rows = [(what, name, f"{p50(samples)} ({statistics.median(samples) - direct:+.1f} ms)")
            for name, samples in latency.items()]
    return rows + [(what, kind, "not run: not installed") for kind in missing]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10, help="per setup, in each part")
    ap.add_argument("--one-way-ms", type=float, default=50, help="the far link's delay each way")
    args = ap.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-summary-") as tmp:
        for part in ("far", "one"):
            (Path(tmp) / part).mkdir()
        rows += far_new_connections(args.requests, args.one_way_ms, Path(tmp) / "far")
        rows += black_hole(args.requests)
        rows += start_to_answer(Path(tmp))
        rows += one_stream(args.requests * 3, Path(tmp) / "one")
    print(f"load average {os.getloadavg()[0]:.1f}; {args.requests} requests per setup (one stream: {args.requests * 3})")
    width = max(len(setup) for _, setup, _ in rows)
    shown = None
    for what, setup, figure in rows:
        if what != shown:
            print(f"\n{what}")
            shown = what
        print(f"  {setup:<{width}}  {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
