"""Streaming benchmark: what each relay setup does to the first token.

Starts a fake OpenAI upstream (a subprocess) that waits `--prefill-ms` before its
first token and then sends `--chunks` events `--gap-ms` apart, and measures, from
the client, the time to the first token and to the end of the response:

    direct          client → upstream
    mitmdump        client → plain mitmdump (reverse mode) → upstream
    mitmdump+stream client → mitmdump -s benchmarks/baseline_stream.py → upstream
    relay           client → mitmdump -s ttft_relay/relay.py → upstream

Requests go round-robin over the setups so drift on a shared machine hits all
alike; each request opens a new client connection. Ratios are against direct,
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._setups import BASELINE_SCRIPT, percentile, stream_shape, stream_shape_arguments
from ttft_relay import apis
from ttft_relay.stream import sse
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import MitmdumpProcess, start_fake_upstream

BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def one_request(base_url: str) -> tuple[float, float]:
    """(first token ms, total ms) of one streamed chat completion on a new connection."""
    watcher = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
    start = time.time()
    conn, resp = client.request("POST", base_url + "/v1/chat/completions", BODY, timeout=30)
    with conn:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        for chunk in resp.chunks():
            watcher.feed(chunk.data, chunk.at)
    end = time.time()
    if watcher.first_token is None:
        raise RuntimeError("no token in the response")
    return (watcher.first_token - start) * 1000, (end - start) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="per setup (default 30)")
    stream_shape_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()

    fake, upstream = start_fake_upstream(**stream_shape(args))
    tmp = Path(tempfile.mkdtemp(prefix="ttft-bench-"))
    mode = f"reverse:{upstream}@0"
    relays = {
        "mitmdump": MitmdumpProcess([mode], tmp, script=None),
        "mitmdump+stream": MitmdumpProcess([mode], tmp, script=BASELINE_SCRIPT),
        "relay": MitmdumpProcess([mode], tmp, options={"relay_timing_log": tmp / "timing.jsonl",
                                                      "relay_timing_console": "false"}),
    }
    try:
        targets = {"direct": upstream}
        for name, proc in relays.items():
            targets[name] = proc.start().url()
        for url in targets.values():  # warm-up: imports, first-connection costs
            one_request(url)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        for _ in range(args.requests):
            for name, url in targets.items():
                results[name].append(one_request(url))
    finally:
        for proc in relays.values():
            proc.stop()
        fake.kill()

    rows = {}
    base_ft = statistics.median(ft for ft, _ in results["direct"])
    for name, samples in results.items():
        ft = [s[0] for s in samples]
        total = [s[1] for s in samples]
        rows[name] = {
            "first_token_p50_ms": round(statistics.median(ft), 1),
            "first_token_p90_ms": round(percentile(ft, 90), 1),
            "total_p50_ms": round(statistics.median(total), 1),
            "first_token_vs_direct": round(statistics.median(ft) / base_ft, 2),
        }
    if args.json:
        print(json.dumps({"params": vars(args), "results": rows}, indent=2))
        return
    print(f"fake upstream: prefill {args.prefill_ms} ms, {args.chunks} chunks {args.gap_ms} ms apart; "
          f"{args.requests} requests per setup, new connection each")
    print(f"{'setup':<16} {'first token p50':>16} {'p90':>8} {'total p50':>10} {'first token / direct':>21}")
    for name, r in rows.items():
        print(f"{name:<16} {r['first_token_p50_ms']:>13.1f} ms {r['first_token_p90_ms']:>8.1f} "
              f"{r['total_p50_ms']:>10.1f} {r['first_token_vs_direct']:>20.2f}x")


if __name__ == "__main__":
    main()
