"""An upstream name whose IPv6 address is black-holed: what each way of connecting costs the first token.

The fake upstream listens on 127.0.0.1:PORT; [::1]:PORT answers no SYN (a full accept queue:
a dead IPv6 route, for real). Each relay runs with its own /etc/hosts (a mount namespace:
root and unshare(1)) and reaches the fake by a name:

    direct       client → fake, no relay (the floor)
    relay-v4     client → relay → v4.test (127.0.0.1 only): the relay's own cost
    relay-dual   client → relay → dual.test ([::1] black-holed, then 127.0.0.1): the
                 addresses raced (RFC 8305, relay_connect_attempt_delay, default 250 ms)
    in-turn      the same name, the addresses tried one after another (relay_connect_attempt_delay=0,
                 mitmproxy's own connect): every connect waits on the black hole until
                 relay_connect_timeout (--connect-timeout) or the kernel gives up

Every request opens a new client connection, so every one makes its own upstream connect;
requests go round-robin over the setups. The first request of each is shown apart: the
first race over a name pays the attempt delay, later connects try the address that won
first (ttft_relay/dial.py). Ratios are against relay-v4, in the same run.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

from ttft_relay.testing.fakes.black_hole import BlackHole, hosts_file, with_hosts
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import MitmdumpProcess

BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def one_request(url: str) -> tuple[int, float]:
    """(status, first body chunk ms from the request's last byte) on a new connection."""
    with HttpConnection(url, timeout=120) as conn:
        response = conn.request("POST", "/v1/chat/completions", BODY, {"Authorization": "Bearer sk-bench"})
        chunks = list(response.chunks())
        if response.status != 200 or not chunks:
            return response.status, (time.time() - response.request_sent_at) * 1000
        return 200, (chunks[0].at - response.request_sent_at) * 1000


Samples = list[tuple[int, float]]


def measure(requests: int, connect_timeout: int = 10, setups: tuple[str, ...] = ("relay-v4", "relay-dual", "in-turn"),
            ) -> tuple[dict[str, tuple[int, float]], dict[str, Samples]]:
    """(each setup's first request, its `requests` requests: (status, first token ms)), direct
    included; in-turn makes at most 3 (each waits for the connect deadline)."""
    from ttft_relay import config

    tmp = Path(tempfile.mkdtemp(prefix="ttft-bench-dial-"))
    with FakeUpstream() as fake, BlackHole(socket.AF_INET6, "::1", fake.port):
        hosts = hosts_file(tmp / "hosts", {"v4.test": ["127.0.0.1"], "dual.test": ["::1", "127.0.0.1"]})
        common = {**config.MITMPROXY_DEFAULTS, "relay_metrics_listen": "", "relay_timing_console": False,
                  "relay_trim": False}
        specs = {name: spec for name, spec in {
            "relay-v4": ("v4.test", {}),
            "relay-dual": ("dual.test", {}),
            "in-turn": ("dual.test", {"relay_connect_attempt_delay": 0, "relay_connect_timeout": connect_timeout}),
        }.items() if name in setups}
        relays: dict[str, MitmdumpProcess] = {}
        try:
            for name, (host, options) in specs.items():
                relay = MitmdumpProcess([f"reverse:http://{host}:{fake.port}@0"], tmp / "confdir",
                                        options={**common, "relay_timing_log": tmp / f"{name}.jsonl", **options})
                relay.args = with_hosts(hosts, relay.args)
                relays[name] = relay.start()
            targets = {"direct": fake.base_url, **{name: relay.url() for name, relay in relays.items()}}
            # The first request of each: imports, first-connection costs, and a name's first race
            first = {name: one_request(url) for name, url in targets.items() if name != "in-turn"}
            results: dict[str, Samples] = {name: [] for name in targets}
            for n in range(requests):
                for name, url in targets.items():
                    if name != "in-turn" or n < 3:
                        results[name].append(one_request(url))
        finally:
            for relay in relays.values():
                relay.stop()
    return first, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="per setup (default 20; in-turn: at most 3)")
    ap.add_argument("--connect-timeout", type=int, default=10, help="the in-turn relay's relay_connect_timeout (s)")
    args = ap.parse_args()
    first, results = measure(args.requests, args.connect_timeout)
    base = statistics.median(ms for status, ms in results["relay-v4"] if status == 200)
    print("fake upstream on 127.0.0.1, [::1] on its port black-holed; new client connection per request")
    print(f"{'setup':<12} {'first request':>14} {'answered':>9} {'first token p50':>16} {'max':>9} {'p50 / relay-v4':>15}")
    for name, samples in results.items():
        ok = [ms for status, ms in samples if status == 200]
        statuses = sorted({status for status, _ in samples if status != 200})
        p50 = statistics.median(ms for _, ms in samples)
        answered = f"{len(ok)}/{len(samples)}" + (f" {statuses}" if statuses else "")
        once = f"{first[name][1]:.1f} ms" if name in first else "-"
        print(f"{name:<12} {once:>14} {answered:>9} {p50:>13.1f} ms {max(ms for _, ms in samples):>9.1f} {p50 / base:>14.2f}x")


if __name__ == "__main__":
    main()
