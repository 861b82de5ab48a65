"""WebSocket benchmark: what each setup adds to a Responses WebSocket turn's first token.

Codex CLI keeps one WebSocket per session and sends a `response.create` per turn.
Against a fake upstream (a subprocess) that waits `--prefill-ms` before a turn's
first text delta and then sends `--chunks` deltas `--gap-ms` apart, this opens one
socket per setup and sends turns round-robin over the setups, so drift on a shared
machine hits all alike:

    direct    client → upstream
    bare      client → mitmdump -s benchmarks/baseline_stream.py → upstream
    relay-1   client → mitmdump -s ttft_relay/relay.py → upstream (records every turn)

It reports, from the client, the time from sending `response.create` to the first
text delta (p50/p90) and to `response.completed`, the upgrade handshake on a new
connection (`--handshakes` per setup), and each setup's first token against direct,
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


from ttft_relay.testing.fakes.ws_client import WebSocketClient
from benchmarks._setups import BenchSetups, percentile, stream_shape, stream_shape_arguments

HEADERS = {"authorization": "Bearer sk-bench-FAKEKEY", "openai-beta": "responses_websockets=2026-02-06"}
TURN = {"type": "response.create", "model": "gpt-5.1-codex",
        "input": [{"type": "message", "role": "user", "content": "Say hello"}]}


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/responses"


def one_turn(client: WebSocketClient) -> tuple[float, float]:
    """(first token ms, total ms) of one turn on an open socket."""
    sent = client.send_text(json.dumps(TURN))
    first = None
    while (msg := client.receive(30)) is not None:
        kind = json.loads(msg.text)["type"]
        if kind == "response.output_text.delta" and first is None:
            first = msg.at
        if kind in ("response.completed", "response.failed", "error"):
            if first is None or kind != "response.completed":
                raise RuntimeError(f"turn ended with {kind}")
            return (first - sent) * 1000, (msg.at - sent) * 1000
    raise RuntimeError("socket closed mid-turn")


def handshake_ms(base: str) -> float:
    start = time.time()
    with WebSocketClient(ws_url(base), headers=HEADERS):
        return (time.time() - start) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=40, help="per setup (default 40)")
    ap.add_argument("--handshakes", type=int, default=10, help="new sockets per setup (default 10)")
    stream_shape_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()

    knobs = stream_shape(args)
    relay_options = {"relay_timing_console": "false", "relay_metrics_listen": ""}
    clients: dict[str, WebSocketClient] = {}
    with BenchSetups(knobs, workers=1, relay_options=relay_options, names=("direct", "bare", "relay-1")) as bench:
        bases = {name: url for name, (url, _) in bench.setups.items()}
        try:
            clients = {name: WebSocketClient(ws_url(base), headers=HEADERS) for name, base in bases.items()}
            for c in clients.values():  # warm-up: first-turn costs
                one_turn(c)
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in bases}
            for _ in range(args.turns):
                for name, c in clients.items():
                    results[name].append(one_turn(c))
            shakes: dict[str, list[float]] = {name: [] for name in bases}
            for _ in range(args.handshakes):
                for name, base in bases.items():
                    shakes[name].append(handshake_ms(base))
        finally:
            for c in clients.values():
                c.close()

    base_ft = statistics.median(ft for ft, _ in results["direct"])
    rows = {}
    for name, samples in results.items():
        ft = [s[0] for s in samples]
        rows[name] = {
            "first_token_p50_ms": round(statistics.median(ft), 1),
            "first_token_p90_ms": round(percentile(ft, 90), 1),
            "total_p50_ms": round(statistics.median(s[1] for s in samples), 1),
            "added_first_token_p50_ms": round(statistics.median(ft) - base_ft, 1),
            "first_token_vs_direct": round(statistics.median(ft) / base_ft, 3),
            "handshake_p50_ms": round(statistics.median(shakes[name]), 1),
        }
    if args.json:
        print(json.dumps({"params": vars(args), "results": rows}, indent=2))
        return
    print(f"fake upstream: prefill {args.prefill_ms} ms, {args.chunks} deltas {args.gap_ms} ms apart; "
          f"{args.turns} turns per setup on one socket each, {args.handshakes} new sockets per setup")
    print(f"{'setup':<8} {'first token p50':>16} {'p90':>8} {'added p50':>10} {'vs direct':>10} "
          f"{'total p50':>10} {'handshake p50':>14}")
    for name, r in rows.items():
        print(f"{name:<8} {r['first_token_p50_ms']:>13.1f} ms {r['first_token_p90_ms']:>8.1f} "
              f"{r['added_first_token_p50_ms']:>+10.1f} {r['first_token_vs_direct']:>9.3f}x "
              f"{r['total_p50_ms']:>10.1f} {r['handshake_p50_ms']:>11.1f} ms")


if __name__ == "__main__":
    main()
