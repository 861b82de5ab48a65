"""Load, nothing lost: many concurrent streams through the relay, in rounds.

Each round opens `--streams` connections at once (asyncio, raw HTTP/1.1, one
streamed chat completion each, every request naming its own model so that any
mixing of streams would show) and checks that

- every stream is byte-identical to what the fake upstream sends for that request
  (its replies are deterministic: `ttft_relay.testing.fakes.replies.build_reply`);
- the timing log gains exactly one record per request (joined by x-request-id);
- the relay's resident memory (VmRSS) returns near its level after the first
  round, so nothing (flows, streamed bodies, timers) is retained.

The fake's prefill holds every stream open until all have connected, so the
streams really are concurrent. Bare mitmproxy listens with a backlog of 100 (the
relay raises it, `relay_listen_backlog`): in a burst of hundreds of connects some
clients of a bare mitmdump wait for a SYN retransmit (about 1 s), which costs
time, not streams.

    scripts/bench load [--streams 500] [--rounds 5] [--prefill-ms 1500] [--chunks 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


from ttft_relay.testing.fakes.replies import answer_pieces, build_reply
from ttft_relay.testing.harness import MitmdumpProcess, start_fake_upstream

PATH = "/v1/chat/completions"


def request_body(round_no: int, index: int) -> bytes:
    return json.dumps({"model": f"load-r{round_no}-s{index}", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def expected_body(body: bytes, chunks: int) -> bytes:
    """What the fake upstream sends for `body` (de-chunked)."""
    return b"".join(build_reply("POST", PATH, body, answer_pieces(chunks), 200, None).chunks)


@dataclass
class RoundResult:
    streams: int
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    max_open: int = 0
    seconds: float = 0.0
    request_ids: set[str] = field(default_factory=set)


async def _one_stream(host: str, port: int, body: bytes, request_id: str) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nx-request-id: {request_id}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"status line {status!r}")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" not in headers.get("transfer-encoding", ""):
            raise RuntimeError(f"not chunked: {headers}")
        out = bytearray()
        while size := int((await reader.readline()).split(b";")[0], 16):
            out += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readline()  # the CRLF after the last chunk: a clean end
        return bytes(out)
    finally:
        writer.close()


async def run_round(url: str, streams: int, round_no: int, chunks: int, timeout: float = 120) -> RoundResult:
    """One round of `streams` concurrent streams against the relay at `url`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    result = RoundResult(streams)
    open_now = 0

    async def one(index: int) -> None:
        nonlocal open_now
        body = request_body(round_no, index)
        request_id = f"load-{round_no}-{index}"
        result.request_ids.add(request_id)
        open_now += 1
        result.max_open = max(result.max_open, open_now)
        try:
            got = await _one_stream(host, int(port), body, request_id)
            if got == expected_body(body, chunks):
                result.ok += 1
            else:
                result.failures.append(f"{request_id}: body differs ({len(got)} bytes)")
        except Exception as e:  # every failure is counted, none stops the round
            result.failures.append(f"{request_id}: {type(e).__name__}: {e}")
        finally:
            open_now -= 1

    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(streams))), timeout)
    result.seconds = time.monotonic() - t0
    return result


def rss_kib(pid: int) -> int:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def records_by_id(log: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    if log.exists():
        for line in log.read_bytes().splitlines():
            rid = json.loads(line).get("request_id")
            counts[rid] = counts.get(rid, 0) + 1
    return counts


def wait_for_records(log: Path, total: int, timeout: float = 30) -> dict[str, int]:
    """The log's records once it holds `total` of them (the writer flushes in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        counts = records_by_id(log)
        if sum(counts.values()) >= total or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill-ms", type=int, default=1500, help="holds every stream open while the rest connect")
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--rss-slack-mib", type=float, default=30, help="allowed RSS growth after round 1")
    args = parser.parse_args(argv)

    fake, fake_url = start_fake_upstream(prefill_ms=args.prefill_ms, chunks=args.chunks)
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        log = Path(tmp) / "timing.jsonl"
        relay = MitmdumpProcess([f"reverse:{fake_url}@0"], Path(tmp) / "conf",
                                options={"relay_timing_log": log, "relay_timing_console": "false"})
        try:
            relay.start()
            assert relay.proc is not None
            pid = relay.proc.pid
            print(f"relay pid {pid}, RSS at start {rss_kib(pid) / 1024:.1f} MiB")
            total, failed, baseline, rss = 0, 0, None, []
            for round_no in range(1, args.rounds + 1):
                result = asyncio.run(run_round(relay.url(), args.streams, round_no, args.chunks))
                total += args.streams
                counts = wait_for_records(log, total)
                missing = [r for r in result.request_ids if counts.get(r) != 1]
                rss.append(rss_kib(pid))
                baseline = baseline or rss[-1]
                failed += len(result.failures) + len(missing)
                print(f"round {round_no}: {result.ok}/{args.streams} streams byte-identical, "
                      f"{len(result.failures)} failed, max {result.max_open} open at once, {result.seconds:.1f} s; "
                      f"records {sum(counts.values())}/{total} ({len(missing)} not exactly one); "
                      f"RSS {rss[-1] / 1024:.1f} MiB")
                for line in result.failures[:5] + missing[:5]:
                    print("   ", line)
        finally:
            relay.stop()
            fake.terminate()
            fake.wait(10)
    grown = (rss[-1] - baseline) / 1024 if rss else 0.0
    print(f"RSS after round 1 {baseline / 1024:.1f} MiB, after round {len(rss)} {rss[-1] / 1024:.1f} MiB "
          f"({grown:+.1f} MiB)")
    ok = failed == 0 and grown <= args.rss_slack_mib
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
