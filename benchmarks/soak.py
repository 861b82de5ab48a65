"""Workers killed under long streams: every request answered or recorded, none twice.

`ttft-relay run --workers N` in front of a fake upstream; long streams (a 50 ms prefill,
then 200 events 20 ms apart: about 4 s each) arrive open-loop, each on a new connection,
with an `x-request-id` of its own, and a worker is killed (SIGKILL, as the OOM killer
does) every few seconds. At the end the relay stops and its one timing log is read:
each request the client saw answered in full must have one record, each one it saw cut
or refused one record with an error (the worker started in the dead one's place records
the streams it took as lost), and none two. Prints the counts and every request that
breaks this. `tests/test_workers.py` runs a 20 s version of it.

    scripts/bench soak [--seconds 120] [--rate 12] [--kill-every 10] [--workers 2]
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import RelayWorkers, read_records, start_fake_upstream
from ttft_relay.observe import ledger

CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def stream(url: str, request_id: str, headers: dict[str, str], outcomes: dict[str, str]) -> None:
    """One stream on a new connection; its outcome: "answered" (the whole stream) or how it ended."""
    try:
        conn, resp = client.request("POST", f"{url}/v1/chat/completions", CHAT,
                                    {"x-request-id": request_id, **headers}, timeout=120)
        with conn:
            body = resp.read()
        outcomes[request_id] = "answered" if resp.complete and b"[DONE]" in body else f"cut: {body[-200:]!r}"
    except (OSError, http.client.HTTPException, ValueError) as e:
        outcomes[request_id] = f"failed: {e!r}"


def kill_soak(url: str, workers: Callable[[], list[int]], *, seconds: float, rate: float, kill_every: float,
              headers: dict[str, str] | None = None) -> tuple[dict[str, str], int]:
    """Streams arriving open-loop at `rate` a second for `seconds`, one of `workers()` (pids)
    killed every `kill_every` seconds; returns ({request id: outcome}, kills)."""
    outcomes: dict[str, str] = {}
    threads: list[threading.Thread] = []
    start = time.monotonic()
    next_kill, kills, n = start + kill_every, 0, 0
    while (now := time.monotonic()) < start + seconds:
        if now >= next_kill:
            if live := workers():
                os.kill(random.choice(live), signal.SIGKILL)
                kills += 1
            next_kill += kill_every
        t = threading.Thread(target=stream, args=(url, f"soak-{n}", headers or {}, outcomes), daemon=True)
        t.start()
        threads.append(t)
        n += 1
        time.sleep(max(0.0, start + n / rate - time.monotonic()))
    for t in threads:
        t.join(180)
    return outcomes, kills


def findings(outcomes: dict[str, str], records: list[dict]) -> list[str]:
    """What breaks "every request answered or recorded, none twice"."""
    by_id: dict[str, list[dict]] = {}
    for r in records:
        by_id.setdefault(r["request_id"], []).append(r)
    found = []
    for request_id, outcome in outcomes.items():
        recs = by_id.get(request_id, [])
        if len(recs) > 1:
            found.append(f"{request_id} recorded {len(recs)} times ({outcome})")
        elif not recs:
            found.append(f"{request_id} has no record ({outcome})")
        elif outcome != "answered" and not recs[0]["error"]:
            found.append(f"{request_id} {outcome}, recorded as answered")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120, help="arrival window")
    ap.add_argument("--rate", type=float, default=12, help="new streams per second (x 4 s: ~50 live at once)")
    ap.add_argument("--kill-every", type=float, default=10, help="seconds between two kills")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=20)
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    fake, upstream = start_fake_upstream(prefill_ms=50, chunks=args.events, gap_ms=args.gap_ms)
    relay = RelayWorkers(upstream, args.workers, tmp, {"relay_metrics_listen": "", "relay_timing_console": "false"})
    try:
        relay.start()

        def workers() -> list[int]:
            return [pid for name, pid in relay.processes().items() if name != "supervisor"]

        outcomes, kills = kill_soak(relay.url(), workers, seconds=args.seconds, rate=args.rate,
                                    kill_every=args.kill_every)
    finally:
        relay.stop()
        fake.terminate()
        fake.wait(10)
    records = read_records(tmp / "timing-n.jsonl")  # with what the stop recorded
    shutil.rmtree(tmp, ignore_errors=True)
    errors = Counter(r["error"] for r in records if r["error"])
    answered = sum(o == "answered" for o in outcomes.values())
    print(f"{len(outcomes)} streams over {args.seconds:g} s through {args.workers} workers, {kills} killed: "
          f"{answered} answered, {len(outcomes) - answered} cut or refused; {len(records)} records, "
          f"{errors.pop(ledger.LOST_ERROR, 0)} of them lost with a worker"
          + "".join(f", {n} '{e}'" for e, n in errors.most_common()))
    bad = findings(outcomes, records)
    print(f"every request answered or recorded, none twice: {'yes' if not bad else 'NO'}")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
