"""Soak: long streams through a relay whose timing log's disk fills up, again and again.

A small filesystem of its own (a tmpfs, `--disk-mib`; mounting needs root, and it is
unmounted at the end) holds the relay's timing log and in-flight ledger. `--clients`
clients each send streams one after the other (`--events` events `--gap-ms` apart, a
request id each) for `--seconds`; meanwhile the disk is filled to the last byte every
`--fill-every` seconds and freed `--full-for` seconds later. While it is full, `--burst`
more streams start at once (the ledger needs slots it never wrote before, in pages the
full disk cannot give: its writes fail), and a second relay is started on the same log and
stopped again (it must find the ledger locked and take nothing for lost). At the end the relay stops cleanly and a third starts on the
log (it must find nothing lost either).

It then checks what the issue asks: every request either answered (the client read the
whole stream) or recorded, none recorded twice, none recorded as lost that was answered;
and counts what the full disk cost (records never written, lines torn).

    sudo scripts/bench disk_soak [--seconds 60] [--clients 8] [--disk-mib 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ttft_relay.testing.harness import RELAY_SCRIPT, MitmdumpProcess, start_fake_upstream

LOST = "relay process exited with the request in flight (no answer was recorded)"


def stream(port: int, rid: str, events: int, gap_ms: int) -> bool:
    """One stream; whether the client read it whole."""
    body = json.dumps({"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-request-id: {rid}\r\nx-fake-chunks: {events}\r\n"
            f"x-fake-gap-ms: {gap_ms}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), 60) as s:
            s.sendall(head)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data and data.endswith(b"0\r\n\r\n")
    except OSError:
        return False


def fill(disk: Path) -> None:
    with open(disk / "filler", "ab") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def read_log(path: Path) -> tuple[list[dict], int]:
    records, torn = [], 0
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            torn += 1
    return records, torn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--gap-ms", type=int, default=10)
    ap.add_argument("--disk-mib", type=int, default=4)
    ap.add_argument("--fill-every", type=float, default=15)
    ap.add_argument("--full-for", type=float, default=5)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--relay-script", type=Path, default=RELAY_SCRIPT)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="disk-soak-"))
    disk = tmp / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.disk_mib}m", f"disk-soak-{os.getpid()}",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        print(f"cannot mount a tmpfs (root is needed): {mounted.stderr.strip()}", file=sys.stderr)
        return 2
    fake, url = start_fake_upstream()
    log = disk / "timing.jsonl"
    options = {"relay_timing_log": log, "relay_metrics_listen": "", "relay_timing_console": False, "flow_detail": 0}
    relays: list[MitmdumpProcess] = []
    try:
        relay = MitmdumpProcess([f"reverse:{url}@0"], tmp, script=args.relay_script, options=options).start()
        relays.append(relay)
        sent: list[str] = []
        answered: set[str] = set()
        lock = threading.Lock()
        stop = time.monotonic() + args.seconds

        def client(n: int) -> None:
            i = 0
            while time.monotonic() < stop:
                one(f"c{n}-{i}")
                i += 1

        def one(rid: str) -> None:
            with lock:
                sent.append(rid)
            if stream(relay.port, rid, args.events, args.gap_ms):
                with lock:
                    answered.add(rid)

        bursts: list[threading.Thread] = []
        clients = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
        for t in clients:
            t.start()
        fills = seconds = 0
        others_found = []
        start = time.monotonic()
        while time.monotonic() < stop:
            time.sleep(min(args.fill_every, max(stop - time.monotonic(), 0)))
            if time.monotonic() >= stop:
                break
            fill(disk)
            fills += 1
            burst = [threading.Thread(target=one, args=(f"b{fills}-{k}",)) for k in range(args.burst)]
            for t in burst:
                t.start()
            bursts.extend(burst)
            # A relay started on the same log while the disk is full: the ledger is still the first one's.
            other = MitmdumpProcess([f"reverse:{url}@0"], tmp, script=args.relay_script, options=options).start()
            relays.append(other)
            time.sleep(args.full_for)
            other.stop()
            others_found.append("recorded as lost" in other.text())
            (disk / "filler").unlink(missing_ok=True)
        seconds = time.monotonic() - start
        for t in clients + bursts:
            t.join(120)
        relay.stop()
        third = MitmdumpProcess([f"reverse:{url}@0"], tmp, script=args.relay_script, options=options).start()
        relays.append(third)
        third.stop()
        records, torn = read_log(log)
        by_rid: dict[str, list[dict]] = {}
        for rec in records:
            by_rid.setdefault(rec.get("request_id"), []).append(rec)
        twice = [rid for rid in sent if len(by_rid.get(rid, ())) > 1]
        lost_but_answered = [rid for rid in answered if any(r.get("error") == LOST for r in by_rid.get(rid, ()))]
        neither = [rid for rid in sent if rid not in answered and rid not in by_rid]
        unrecorded_answered = [rid for rid in answered if rid not in by_rid]
        outcome = {
            "seconds": round(seconds, 1), "disk_fills": fills, "requests": len(sent), "answered": len(answered),
            "recorded": sum(1 for rid in sent if rid in by_rid), "answered_but_not_recorded": len(unrecorded_answered),
            "neither_answered_nor_recorded": len(neither), "recorded_twice": len(twice),
            "recorded_lost_though_answered": len(lost_but_answered), "torn_log_lines": torn,
            "relays_started_meanwhile_that_recorded_lost": sum(others_found),
            "lost_after_the_clean_stop": "recorded as lost" in third.text(),
            "ledger_warnings": relay.text().count("in-flight ledger"),
            "log_write_errors": relay.text().count("cannot write timing records"),
        }
        print(json.dumps(outcome, indent=2))
        ok = not neither and not twice and not lost_but_answered and not any(others_found) \
            and not outcome["lost_after_the_clean_stop"]
        print("PASS: every request answered or recorded, none twice" if ok else "FAIL", flush=True)
        return 0 if ok else 1
    finally:
        for r in relays:
            r.stop()
        fake.terminate()
        fake.wait(10)
        subprocess.run(["umount", "-l", str(disk)], check=False)


if __name__ == "__main__":
    sys.exit(main())
