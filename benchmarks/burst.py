"""Burst benchmark: what a burst of concurrent new streams does to the first token.

For each burst size, every setup gets the same burst (all requests started at once,
each on a new connection) against one fake OpenAI upstream (a subprocess, backlog
1024), setups taking turns round after round so that drift on a shared machine hits
all alike:

    direct        client → upstream
    bare          client → mitmdump -s <script that only turns streaming on>
    relay-1       client → scripts/relay --workers 1 (mitmdump -s ttft_relay/relay.py)
    relay-N       client → scripts/relay --workers N (N mitmdump workers sharing the listener)

Per setup and burst size: first-token p50/p99 over all rounds (from the start of the
burst to the first answer text), failures (errors, non-200, timeouts), the relay's
CPU seconds per burst (all its processes: workers and supervisor), and the connections
the kernel dropped from a full listen queue during its bursts (Linux's TcpExt
ListenOverflows: machine-wide, but the bursts run one at a time).

Mind the listen backlogs: bare mitmproxy listens with asyncio's fixed default of
100, so in a burst larger than that, connections the kernel cannot queue wait for
a SYN retransmit (1 s, then 3 s). The relay's listeners queue 4096
(`relay_listen_backlog`; the kernel caps it at net.core.somaxconn).

    scripts/bench burst [--bursts 100,200,500] [--rounds 3] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit


from ttft_relay import prefork
from benchmarks.streams import one_stream
from benchmarks._setups import BenchSetups, cpu_seconds, percentile

TIMEOUT = 60.0


def listen_overflows() -> int:
    """Linux's count of connections dropped from full accept queues (0 elsewhere)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return dict(zip(names.split()[1:], map(int, values.split()[1:]))).get("ListenOverflows", 0)
    return 0


async def first_token_ms(host: str, port: int, start: float) -> float:
    """ms from `start` to the first answer text of one new stream; raises on any failure."""
    return (await one_stream(host, port, start, None))[0]


async def burst(url: str, size: int) -> tuple[list[float], int]:
    u = urlsplit(url)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(asyncio.wait_for(first_token_ms(u.hostname, u.port, start), TIMEOUT) for _ in range(size)),
        return_exceptions=True,
    )
    ok = [r for r in results if isinstance(r, float)]
    return ok, size - len(ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", default="100,200,500", help="burst sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="bursts per setup and size")
    ap.add_argument("--workers", type=int, default=prefork.default_workers(), help="N for relay-N")
    ap.add_argument("--prefill-ms", type=float, default=50)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=10)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.bursts.split(",")]

    knobs = {"prefill_ms": args.prefill_ms, "chunks": args.chunks, "gap_ms": args.gap_ms}
    with BenchSetups(knobs, workers=args.workers) as bench:
        setups = {name: (url, lambda p=processes: list(p().values())) for name, (url, processes) in bench.setups.items()}
        time.sleep(2)  # start-up work (tokenizer loading) out of the way
        for url, _ in setups.values():
            asyncio.run(burst(url, 20))  # warm-up
        first = {(name, n): [] for name in setups for n in sizes}
        failed = {(name, n): 0 for name in setups for n in sizes}
        cpu = {(name, n): 0.0 for name in setups for n in sizes}
        dropped = {(name, n): 0 for name in setups for n in sizes}
        for n in sizes:
            for _ in range(args.rounds):
                for name, (url, pids) in setups.items():
                    c0, d0 = cpu_seconds(*pids()), listen_overflows()
                    ok, bad = asyncio.run(burst(url, n))
                    cpu[name, n] += cpu_seconds(*pids()) - c0
                    dropped[name, n] += listen_overflows() - d0
                    first[name, n] += ok
                    failed[name, n] += bad
                    time.sleep(0.5)  # let connections close before the next burst

    print(f"fake upstream: prefill {args.prefill_ms:g} ms, {args.chunks} chunks {args.gap_ms:g} ms apart; "
          f"{args.rounds} bursts per setup and size, new connection per stream; {os.cpu_count()} cores")
    print(f"{'burst':>5} {'setup':<9} {'first token p50':>16} {'p99':>9} {'failures':>9} {'relay CPU s/burst':>18}"
          f" {'full-queue drops/burst':>23}")
    for n in sizes:
        for name in setups:
            ft = first[name, n]
            cpu_s = "" if name == "direct" else f"{cpu[name, n] / args.rounds:.2f}"
            print(f"{n:>5} {name:<9} {statistics.median(ft) if ft else float('nan'):>13.0f} ms "
                  f"{percentile(ft, 99):>6.0f} ms {failed[name, n]:>9} {cpu_s:>18} {dropped[name, n] / args.rounds:>23.0f}")
        multi_name = f"relay-{args.workers}"
        if multi_name in setups and first[multi_name, n] and first["relay-1", n]:
            print(f"{'':>5} p99 relay-1 / {multi_name}: {percentile(first['relay-1', n], 99) / percentile(first[multi_name, n], 99):.2f}x"
                  f" (goal at 500: >= 1.5x); relay-1 / bare p99: "
                  f"{percentile(first['relay-1', n], 99) / percentile(first['bare', n], 99):.2f}x (goal <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
