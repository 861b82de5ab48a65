"""What the relay costs: first-token latency and CPU per flow, against a bare
streaming mitmdump, in the same run against the same fake upstream.

Four mitmdump processes, requests interleaved round-robin so that drift in a
noisy machine hits all alike:

    bare          mitmdump -s <script that only sets flow.response.stream = True>
    relay-timing  the relay's addons without Timing (what timing is measured against)
    relay-own     the full relay with mitmproxy's own hook dispatch (relay_hook_plans
                  off): what the relay's addons cost on their own
    relay         the full relay (ttft_relay/relay.py), timing on, log written

Latency: the client's time from sending the request to the chunk carrying the
first answer text, on a fresh connection each time. CPU: the mitmdump process's
user + system time over the run, per flow.

    scripts/bench overhead [--requests 300] [--prefill-ms 50] [--chunks 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._setups import BASELINE_SCRIPT, cpu_seconds
from ttft_relay.testing.fakes.client import stream_post
from ttft_relay.testing.harness import MitmdumpProcess, start_fake_upstream

REPO = Path(__file__).resolve().parent.parent

RELAY_WITHOUT_TIMING_SCRIPT = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("relay_full", {str(REPO / "ttft_relay" / "relay.py")!r})
_relay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_relay)  # the relay's entry point: it makes the package importable
from ttft_relay.timing import addon as timing
addons = [a for a in _relay.addons if not isinstance(a, timing.Timing)]
"""

BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}
FIRST_PIECE = b"Hello"  # the fake's first answer piece (ttft_relay.testing.fakes.replies.answer_pieces)


def first_token_ms(url: str) -> float:
    """Send one request, read the whole stream (an early close would be a client abort
    for the relay), and return the time to the first answer text."""
    sent, first = time.time(), None
    for chunk in stream_post(url + "/v1/chat/completions", BODY):
        if first is None and FIRST_PIECE in chunk.data:
            first = chunk.at
    if first is None:
        raise RuntimeError("no answer text in the stream")
    return (first - sent) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per variant")
    ap.add_argument("--warmup", type=int, default=20, help="unmeasured requests per variant first")
    ap.add_argument("--prefill-ms", type=float, default=50)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                    help="an extra option for the relay variants, e.g. relay_timing_console=false")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    (tmp / "relay_without_timing.py").write_text(RELAY_WITHOUT_TIMING_SCRIPT)
    fake, upstream = start_fake_upstream(prefill_ms=args.prefill_ms, chunks=args.chunks, gap_ms=args.gap_ms)
    mode = f"reverse:{upstream}@0"
    common = {"relay_trim": "false", "flow_detail": 0} | dict(kv.split("=", 1) for kv in args.set)
    variants = {
        "bare": MitmdumpProcess([mode], tmp, script=BASELINE_SCRIPT, options={"flow_detail": 0}),
        "relay-timing": MitmdumpProcess([mode], tmp, script=tmp / "relay_without_timing.py", options=common),
        "relay-own": MitmdumpProcess([mode], tmp, options=common | {"relay_hook_plans": "false",
                                                                     "relay_timing_log": tmp / "timing-own.jsonl"}),
        "relay": MitmdumpProcess([mode], tmp, options=common | {"relay_timing_log": tmp / "timing.jsonl"}),
    }
    try:
        for proc in variants.values():
            proc.start()
        time.sleep(2)  # background start-up work (tokenizer loading) out of the way
        for _ in range(args.warmup):
            for proc in variants.values():
                first_token_ms(proc.url())
        latency: dict[str, list[float]] = {name: [] for name in variants}
        cpu0 = {name: cpu_seconds(proc.proc.pid) for name, proc in variants.items()}
        for _ in range(args.requests):
            for name, proc in variants.items():
                latency[name].append(first_token_ms(proc.url()))
        cpu = {name: (cpu_seconds(proc.proc.pid) - cpu0[name]) / args.requests * 1000 for name, proc in variants.items()}
    finally:
        for proc in variants.values():
            proc.stop()  # the relays write their last records as they stop
        fake.terminate()
        fake.wait(10)
    records = len((tmp / "timing.jsonl").read_bytes().splitlines())

    p50 = {name: statistics.median(v) for name, v in latency.items()}
    print(f"{args.requests} streamed requests per variant, fake upstream prefill {args.prefill_ms:g} ms, "
          f"{args.chunks} chunks; relay wrote {records} records ({args.warmup} warm-up + {args.requests} expected)")
    print(f"{'variant':<14}{'ttft p50 ms':>12}{'p90 ms':>9}{'CPU ms/flow':>13}")
    for name in variants:
        p90 = statistics.quantiles(latency[name], n=10)[-1]
        print(f"{name:<14}{p50[name]:>12.2f}{p90:>9.2f}{cpu[name]:>13.3f}")
    for name, base in (("relay", "bare"), ("relay", "relay-timing"), ("relay-own", "bare")):
        added = p50[name] - p50[base]
        ratio = cpu[name] / cpu[base] - 1
        print(f"{name:<9} vs {base:<13} added ttft p50 {added:+.2f} ms (goal <= 0.5), "
              f"CPU per flow {ratio:+.1%} (goal <= 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
