"""Upstream groups: two routes to one API, side by side, on agent-shaped conversations.

Two fake upstreams of one provider that honours prompt caching (`prompt_cache`: a
conversation continued on the same upstream reads its history from that upstream's cache;
moved to the other, it pays the whole prefill, `--prefill-per-1k` ms per 1k uncached tokens):

    a   near, with a queue that comes and goes (`--spike-ms` more before the head for
        `--spike-s` of every `--spike-every-s` seconds)
    b   far: behind a forwarder that delays each direction `--one-way-ms`

and three ways to use them, each through the relay:

    single     one reverse listener to a (no group)
    latency    LiteLLM's latency-based routing, done by the client over two relays (one to a,
               one to b): each request to the route whose last LATENCY_WINDOW first tokens
               averaged lowest (each route tried once first)
    groups     one listener with the group a + b (`relay_upstream_groups`): the relay's choice,
               a slow head sent on to b for at most `--slow-head` percent of the requests
    hedging    the same group hedging instead (`relay_upstream_hedge`): a slow head's request
               sent to b as well, the first head winning, for at most `--hedge` percent

Each setup runs the same `--conversations` conversations of `--turns` turns (a system prompt
of `--system-tokens`, each turn adding about `--turn-tokens`), round-robin over the
conversations and the setups so a queue spike hits all alike; before them, `--warmup` single
requests each teach the relay's lines. The bodies differ per setup (their system prompt names
it), so no setup reads another's cache. Reported per setup: first token p50/p95/p99 (ms, from
the request's send to the first token, a new connection each), the prompt tokens paid
(uncached, as the fakes' usage reports them) and, from the relay's records, the prompt tokens
sent again: those of an attempt abandoned at its slow head or failed over, and of a hedge's
losing attempt (counted whole: the other member may not hold the prefix).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

from benchmarks._setups import percentile
from ttft_relay import apis
from ttft_relay.stream import sse
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.forwarder import DelayingForwarder
from ttft_relay.testing.harness import MitmdumpProcess, start_fake_upstream

SETUPS = ("single", "latency", "groups", "hedging")
LATENCY_WINDOW = 5
WORDS = "the relay keeps the conversation where its prompt cache is unless another route is quicker ".split()


def text_of(tokens: int, seed: str) -> str:
    """About `tokens` tokens (4 characters each) of text that starts with `seed`."""
    out, n = [seed], 0
    while sum(len(w) + 1 for w in out) < tokens * 4:
        out.append(WORDS[n % len(WORDS)])
        n += 1
    return " ".join(out)


def body(setup: str, conversation: int, turn: int, args: argparse.Namespace) -> dict:
    messages = [{"role": "system", "content": text_of(args.system_tokens, f"[{setup} conversation {conversation}]")}]
    for n in range(turn + 1):
        messages.append({"role": "user", "content": text_of(args.turn_tokens, f"turn {n}:")})
        if n < turn:
            messages.append({"role": "assistant", "content": "Hello t1 t2 t3 t4"})
    return {"model": "gpt-4o-mini", "stream": True, "stream_options": {"include_usage": True}, "messages": messages}


def one_request(base_url: str, payload: dict, request_id: str) -> tuple[float, int]:
    """(first token ms, uncached prompt tokens) of one streamed chat completion on a new connection."""
    watcher = sse.StreamWatcher(apis.get(apis.OPENAI_CHAT))
    conn, resp = client.request("POST", base_url + "/v1/chat/completions", payload, {"x-request-id": request_id},
                                timeout=60)
    with conn:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        for chunk in resp.chunks():
            watcher.feed(chunk.data, chunk.at)
    if watcher.first_token is None:
        raise RuntimeError("no token in the response")
    usage = watcher.usage or {}
    paid = (usage.get("input_tokens") or 0) - (usage.get("cached_tokens") or 0)
    return (watcher.first_token - resp.request_sent_at) * 1000, paid


def sent_again(timing_log: Path, counted: set[str]) -> int:
    """The prompt tokens of the attempts a group abandoned (failed over, slow head) or lost (a
    hedge's), in the relay's records of the counted requests."""
    total = 0
    for line in timing_log.read_text().splitlines() if timing_log.exists() else ():
        rec = json.loads(line)
        route = rec.get("route") or {}
        if rec.get("request_id") in counted:
            attempts = len(route.get("failed_over") or ()) + bool((route.get("hedged") or {}).get("won"))
            total += attempts * (rec.get("prompt_tokens") or 0)
    return total


class LatencyRouting:
    """LiteLLM's latency-based routing: the route whose recent first tokens averaged lowest."""

    def __init__(self, routes: list[str]) -> None:
        self.recent: dict[str, deque[float]] = {route: deque(maxlen=LATENCY_WINDOW) for route in routes}

    def pick(self) -> str:
        untried = [route for route, seen in self.recent.items() if not seen]
        return untried[0] if untried else min(self.recent, key=lambda r: statistics.fmean(self.recent[r]))

    def learn(self, route: str, ttft_ms: float) -> None:
        self.recent[route].append(ttft_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=12, help="single requests per setup before (default 12)")
    ap.add_argument("--system-tokens", type=int, default=6000)
    ap.add_argument("--turn-tokens", type=int, default=400)
    ap.add_argument("--prefill-per-1k", type=float, default=150.0, help="ms per 1k uncached prompt tokens")
    ap.add_argument("--spike-ms", type=float, default=2500.0)
    ap.add_argument("--spike-s", type=float, default=4.0)
    ap.add_argument("--spike-every-s", type=float, default=15.0)
    ap.add_argument("--one-way-ms", type=float, default=60.0)
    ap.add_argument("--explore", type=int, default=30, help="the group's relay_upstream_explore (default 30)")
    ap.add_argument("--slow-head", type=int, default=10, help="the group's relay_upstream_slow_head (default 10)")
    ap.add_argument("--hedge", type=int, default=10, help="the hedging group's relay_upstream_hedge_budget (default 10)")
    ap.add_argument("--quick", action="store_true", help="3 conversations of 6 turns, 8 warm-up requests")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns, args.warmup = 3, 6, 8

    provider = {"prompt_cache": True, "prefill_ms": 20, "prefill_ms_per_1k_tokens": args.prefill_per_1k, "chunks": 5}
    fake_a, url_a = start_fake_upstream(**provider, queue_spike_ms=args.spike_ms, queue_spike_s=args.spike_s,
                                        queue_spike_every_s=args.spike_every_s)
    fake_b, url_b = start_fake_upstream(**provider)
    far_b = DelayingForwarder("127.0.0.1", int(url_b.rsplit(":", 1)[1]), args.one_way_ms).start()
    url_far_b = f"http://127.0.0.1:{far_b.port}"
    tmp = Path(tempfile.mkdtemp(prefix="ttft-bench-groups-"))
    relays: dict[str, MitmdumpProcess] = {}

    def relay(name: str, upstream: str, **options: object) -> str:
        proc = MitmdumpProcess([f"reverse:{upstream}@0"], tmp / f"confdir-{name}", options={
            "relay_timing_log": str(tmp / f"timing-{name}.jsonl"), "relay_metrics_listen": "", **options})
        relays[name] = proc.start()
        return proc.url()

    try:
        urls = {
            "single": relay("single", url_a),
            "latency-a": relay("latency-a", url_a),
            "latency-b": relay("latency-b", url_far_b),
            "groups": relay("groups", url_a, relay_upstream_groups=f"127.0.0.1 b={url_far_b}",
                            relay_upstream_explore=args.explore, relay_upstream_slow_head=args.slow_head),
            "hedging": relay("hedging", url_a, relay_upstream_groups=f"127.0.0.1 b={url_far_b}",
                             relay_upstream_explore=args.explore, relay_upstream_hedge=True,
                             relay_upstream_hedge_budget=args.hedge),
        }
        routing = LatencyRouting(["latency-a", "latency-b"])
        first_tokens: dict[str, list[float]] = {s: [] for s in SETUPS}
        paid: dict[str, int] = dict.fromkeys(SETUPS, 0)
        counted_ids: set[str] = set()

        def send(setup: str, payload: dict, counted: bool) -> None:
            route = routing.pick() if setup == "latency" else setup
            request_id = f"{setup}-{len(counted_ids) if counted else 'warm-up'}-{time.time_ns()}"
            ttft, uncached = one_request(urls[route], payload, request_id)
            if setup == "latency":
                routing.learn(route, ttft)
            if counted:
                counted_ids.add(request_id)
                first_tokens[setup].append(ttft)
                paid[setup] += uncached

        for n in range(args.warmup):
            for setup in SETUPS:
                send(setup, body(setup, 1000 + n, 0, args), counted=False)
        started = time.time()
        for turn in range(args.turns):
            for conversation in range(args.conversations):
                for setup in SETUPS:
                    send(setup, body(setup, conversation, turn, args), counted=True)
        elapsed = time.time() - started
    finally:
        for proc in relays.values():
            proc.stop()
        again = {setup: sum(sent_again(tmp / f"timing-{name}.jsonl", counted_ids) for name in relays
                            if name == setup or name.startswith(f"{setup}-"))
                 for setup in SETUPS}
        far_b.stop()
        for fake in (fake_a, fake_b):
            fake.terminate()
            fake.wait(10)

    results = {setup: {"requests": len(values), "p50_ms": round(percentile(values, 50), 1),
                       "p95_ms": round(percentile(values, 95), 1), "p99_ms": round(percentile(values, 99), 1),
                       "prompt_tokens_paid": paid[setup], "prompt_tokens_sent_again": again[setup]}
               for setup, values in first_tokens.items()}
    if args.json:
        print(json.dumps({"arguments": vars(args), "elapsed_s": round(elapsed, 1), "results": results}, indent=2))
        return
    print(f"{args.conversations} conversations x {args.turns} turns per setup, {elapsed:.0f} s; "
          f"a: queue +{args.spike_ms:.0f} ms for {args.spike_s:.0f} s of every {args.spike_every_s:.0f} s; "
          f"b: {args.one_way_ms:.0f} ms each way; prefill {args.prefill_per_1k:.0f} ms per 1k uncached tokens")
    print(f"{'setup':<10}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'prompt tokens paid':>22}{'sent again':>12}")
    for setup, r in results.items():
        print(f"{setup:<10}{r['p50_ms']:>10.0f}{r['p95_ms']:>10.0f}{r['p99_ms']:>10.0f}{r['prompt_tokens_paid']:>22,}"
              f"{r['prompt_tokens_sent_again']:>12,}")


if __name__ == "__main__":
    main()
