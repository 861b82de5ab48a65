"""Long streams arriving open-loop: how many a setup carries before its first tokens and gaps suffer.

Real-shaped load: each stream is a chat completion with a 50 ms prefill, then 200 SSE
events 20 ms apart (a 4 s answer at 50 tokens/s), new streams started at a fixed rate
whatever the setup's state (open loop: a slow setup does not slow the arrivals), each
on a new connection. At R streams/s about R x 4.1 are live at once. Setups take turns
within each rate, round after round, so that drift on a shared machine hits all alike:

    direct        client → fake upstream
    floor         client → a plain asyncio TCP forwarder (benchmarks/forwarder.py): the least
                  Python spends per read and write, under any relay's cost (not with --tls)
    nginx         client → nginx with proxy_buffering off, one worker, kept-alive upstream
                  connections (benchmarks/references.py): the C floor of an HTTP relay
    envoy         client → Envoy's HTTP router, one worker: the C++ floor
    bare          client → mitmdump -s <script that only turns streaming on>
    seams         client → mitmdump -s benchmarks/seams_stream.py: streaming through the relay's
                  seams into mitmproxy (splice, direct reads, hook plans, ...) and no relay work:
                  the least a relay on mitmproxy costs, under the relay's own work
    relay-1       client → the relay as one process (console off, trimming on, the upstream
                  pool on as by default: `--variant nopool:relay_upstream_pool=false` is its A/B)
    relay-N       client → scripts/relay --workers N (N workers sharing the listener)
    NAME          client → the relay as one process with other options (--variant NAME:OPTION=VALUE):
                  an option's A/B in the same run, e.g. --variant nosplice:relay_stream_splice=false

Per setup and rate: first token p50/p99 (from the moment the stream was due to its
first answer text) and what the setup adds to direct's p50 (`--events 1 --rates 1`: the
added first token at one stream at a time), worst inter-chunk gap per stream p50/p99 (after the first token),
failures (errors, non-200, timeouts, missing events), and CPU microseconds per
streamed event of each relay process (its CPU over the window / events the clients
received through that setup). A setup *sustains* a rate when it has no failures, its
first token p99 is within direct's + 100 ms and its worst-gap p99 within 2 x direct's
at that rate (and it sustained every lower rate).

Per setup and rate also the streams that *stalled*: a gap between two reads after the
first token longer than twice the pacing (40 ms at the default 20 ms). A setup holds a
rate *without a stall* (the criterion of published LLM-gateway stream benchmarks, so that
the figures compare with theirs) when every stream got every event, none stalled and
fewer than 0.1 % failed (and it held every lower rate); this bound is absolute, not
against direct: on a busy machine direct itself may stall, and the report says so.

`--otlp` adds two setups, the relay as one process exporting every record as an
OpenTelemetry trace (docs/telemetry.md): `otlp` to a collector that takes every export at
once (benchmarks/_otlp_sink.py, a process of its own), `otlp-down` to a port where no
collector listens; their cost is read against relay-1 in the same run.

`--keep-alive` has the clients keep their HTTP/1.1 connections for the window's next
streams (the count of connections opened is printed). `--tls` puts TLS on both hops; `--h2` also has the fake upstream and the clients offer
HTTP/2 before HTTP/1.1 (as the real APIs and curl or reqwest, the Codex CLI's HTTP
client, do), each setup picking, and says which protocol each setup's clients got. The
relay setups start with the relay's defaults for mitmproxy's options
(`config.MITMPROXY_DEFAULTS`: HTTP/1.1), as its command starts it.

The load generator, the fake upstream and the relay share the machine's cores: the
load average is printed with the figures (the run's range, and per row the highest at
the start of its windows: arms compare only at a like load). Run benchmarks under
`flock /tmp/ttft-cpu.lock` on a shared machine.

    scripts/bench streams [--quick] [--rates 5,15,25,40] [--seconds 10] [--rounds 2] [--workers N] [--tls | --h2] [--keep-alive] [--otlp]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import ssl
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.events
import orjson


from benchmarks._setups import BenchSetups, cpu_seconds, percentile
from ttft_relay import prefork, workers

BODY = orjson.dumps({"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]})
LAST_CHUNK = b"\r\n0\r\n\r\n"
"""How a chunked body (no trailers) ends: the last data chunk's CR LF, the zero-size chunk."""
FIRST_PIECE = b"Hello"  # the fake's first answer piece (ttft_relay.testing.fakes.replies.answer_pieces)
STREAM_TIMEOUT = 60.0
FIRST_TOKEN_SLACK_MS = 100.0
GAP_FACTOR = 2.0
STALL_FACTOR = 2.0
"""A stall: a gap after the first token longer than this many times the pacing."""
STALL_ERROR_BUDGET = 0.001
"""The share of streams that may fail where a rate is held without a stall."""


@dataclass
class Window:
    """What one setup did with one rate's arrivals, summed over rounds."""

    first_ms: list[float] = field(default_factory=list)
    worst_gap_ms: list[float] = field(default_factory=list)
    failures: int = 0
    streams: int = 0
    events: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)
    protocols: Counter[str] = field(default_factory=Counter)
    """Streams per protocol the setup and its client agreed on ("h2", "http/1.1")."""
    connections: int = 0
    """Connections the clients opened (one per stream, unless kept alive)."""
    first_by_id: dict[str, float] = field(default_factory=dict)
    """The client's first token per x-request-id, to hold the relay's records against."""


def client_tls(h2: bool = False) -> ssl.SSLContext:
    """TLS to a setup, as a client across the internet would speak it (not verified: the
    benchmark measures the cost, not the trust); with `h2`, offering HTTP/2 before HTTP/1.1
    as curl and Rust's reqwest (the Codex CLI) do."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if h2:
        context.set_alpn_protocols(["h2", "http/1.1"])
    return context


@dataclass
class Connections:
    """Where the streams of a window get their connections: a new one each, or with
    `keep_alive` an idle one the window's earlier HTTP/1.1 streams left, as SDKs pool theirs."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    keep_alive: bool = False
    opened: int = 0
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=list)

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.idle:
            return self.idle.pop()
        self.opened += 1
        return await asyncio.open_connection(self.host, self.port, ssl=self.tls)

    def put(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], reusable: bool) -> None:
        if self.keep_alive and reusable:
            self.idle.append(conn)
        else:
            conn[1].close()

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def one_stream(host: str, port: int, due: float, expected_events: int | None,
                     request_id: str = "", tls: ssl.SSLContext | None = None,
                     connections: Connections | None = None) -> tuple[float, float, int, str]:
    """(ms from `due` to the first answer text, worst gap in ms after it, events, "h2" or
    "http/1.1"); raises on failure. HTTP/2 if the TLS handshake chose it, else HTTP/1.1;
    on a connection of `connections` (default: a new one)."""
    connections = connections or Connections(host, port, tls)
    reader, writer = conn = await connections.get()
    reusable = False
    try:
        tls_object = writer.get_extra_info("ssl_object")
        over_h2 = tls_object is not None and tls_object.selected_alpn_protocol() == "h2"
        if over_h2:
            body = h2_body(reader, writer, f"{host}:{port}", request_id)
        else:
            body = h1_body(reader, writer, f"{host}:{port}", request_id, connections.keep_alive)
        seen, first, last, worst, events = b"", None, 0.0, 0.0, 0
        async for data in body:
            now = time.perf_counter()
            events += data.count(b"data:")
            if first is None:
                seen = seen[-len(FIRST_PIECE):] + data
                if FIRST_PIECE in seen:
                    first = now
            else:
                worst = max(worst, now - last)
            last = now
        if first is None:
            raise RuntimeError("no answer text")
        if expected_events is not None and events < expected_events:
            raise RuntimeError(f"{events} of {expected_events} events")
        reusable = not over_h2
        return (first - due) * 1000, worst * 1000, events, "h2" if over_h2 else "http/1.1"
    finally:
        connections.put(conn, reusable)


async def h1_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, authority: str,
                  request_id: str, keep_alive: bool = False) -> AsyncIterator[bytes]:
    """The request over HTTP/1.1; the response body's reads as they come (chunk framing
    included), to the connection's end, or with `keep_alive` to the body's last chunk."""
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\ncontent-type: application/json\r\n"
                 b"x-request-id: %s\r\nconnection: %s\r\ncontent-length: %d\r\n\r\n%s"
                 % (authority.encode(), request_id.encode(), b"keep-alive" if keep_alive else b"close", len(BODY), BODY))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    tail = b""
    while data := await reader.read(65536):
        yield data
        tail = (tail + data)[-len(LAST_CHUNK):]
        if keep_alive and tail == LAST_CHUNK:  # (events are LF-framed: only the chunk framing has CR LF)
            return
    if keep_alive:
        raise RuntimeError("the connection closed before the body's end")


async def h2_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, authority: str,
                  request_id: str) -> AsyncIterator[bytes]:
    """The request over HTTP/2 (one stream); the response body's DATA as it comes."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "https"),
                            (":authority", authority), ("content-type", "application/json"),
                            ("x-request-id", request_id), ("content-length", str(len(BODY)))])
    conn.send_data(sid, BODY, end_stream=True)
    writer.write(conn.data_to_send())
    while data := await reader.read(65536):
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived) and dict(event.headers).get(":status") != "200":
                raise RuntimeError(f"status {dict(event.headers).get(':status')}")
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                yield event.data
            elif isinstance(event, h2.events.StreamEnded):
                return
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                raise RuntimeError(f"HTTP/2: {type(event).__name__}")
        writer.write(conn.data_to_send())
    raise RuntimeError("HTTP/2: the connection closed mid-stream")


async def arrivals(url: str, rate: float, seconds: float, expected_events: int | None, into: Window,
                   tls: ssl.SSLContext | None = None, keep_alive: bool = False) -> None:
    """Start `rate` streams per second for `seconds`, on schedule; wait for all to end.
    With `keep_alive`, a stream takes an idle connection of the window's where there is one."""
    u = urlsplit(url)
    assert u.hostname is not None and u.port is not None
    connections = Connections(u.hostname, u.port, tls, keep_alive)
    loop = asyncio.get_running_loop()
    start = time.perf_counter() + 0.05
    tasks = []

    async def run(due: float) -> None:
        request_id = uuid.uuid4().hex
        try:
            first, gap, events, protocol = await asyncio.wait_for(
                one_stream(u.hostname, u.port, due, expected_events, request_id, tls, connections), STREAM_TIMEOUT)
        except Exception:  # every failure is counted, none stops the window
            into.failures += 1
            return
        into.first_ms.append(first)
        into.first_by_id[request_id] = first
        into.worst_gap_ms.append(gap)
        into.events += events
        into.protocols[protocol] += 1

    for i in range(int(rate * seconds)):
        due = start + i / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(loop.create_task(run(due)))
    into.streams += len(tasks)
    await asyncio.gather(*tasks)
    into.connections += connections.opened
    connections.close()


def cpu_of(processes: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in processes.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench streams", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="rates 5,25, 6 s each, one round (about 2 minutes)")
    ap.add_argument("--rates", default="5,15,25,40", help="new streams per second, comma-separated")
    ap.add_argument("--seconds", type=float, default=10, help="arrival window per setup, rate and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=max(2, prefork.default_workers()), help="N for relay-N")
    ap.add_argument("--prefill-ms", type=float, default=50)
    ap.add_argument("--events", type=int, default=200, help="answer events per stream")
    ap.add_argument("--gap-ms", type=float, default=20)
    ap.add_argument("--setups", default="direct,floor,nginx,envoy,bare,seams,relay-1,relay-N",
                    help="which setups, comma-separated")
    ap.add_argument("--relay-set", action="append", default=[], metavar="NAME=VALUE",
                    help="an option for the relay setups (repeatable), e.g. relay_hook_plans=false")
    ap.add_argument("--tls", action="store_true",
                    help="TLS on both hops: the fake upstream serves HTTPS, clients speak TLS to every setup")
    ap.add_argument("--h2", action="store_true",
                    help="with TLS on both hops, HTTP/2 offered too: the fake upstream and the clients offer h2 "
                         "before http/1.1, as the real APIs and curl or reqwest (Codex) do; each setup picks")
    ap.add_argument("--keep-alive", action="store_true",
                    help="HTTP/1.1 clients keep their connections and the next streams of the window reuse them, "
                         "as SDKs and coding agents do (default: a new connection per stream)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:OPTION=VALUE[,OPTION=VALUE]",
                    help="one more setup: the relay as one process with these options (repeatable), "
                         "e.g. nosplice:relay_stream_splice=false")
    ap.add_argument("--otlp", action="store_true",
                    help="two more setups: the relay exporting OpenTelemetry traces to a collector that takes "
                         "them at once (otlp) and to one that is down (otlp-down)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rates, args.seconds, args.rounds = "5,25", 6.0, 1
    rates = [float(r) for r in args.rates.split(",")]
    args.tls = args.tls or args.h2

    knobs = {"prefill_ms": args.prefill_ms, "chunks": args.events, "gap_ms": args.gap_ms}
    relay_options = {"relay_timing_console": "false", **dict(kv.split("=", 1) for kv in args.relay_set)}
    variants = {name: dict(kv.split("=", 1) for kv in options.split(","))
                for name, _, options in (v.partition(":") for v in args.variant)}
    sink = otlp_sink() if args.otlp else None
    if sink is not None:  # before the --variant setups: one of those can be a control after them
        variants = {"otlp": {"relay_otlp_endpoint": sink[1]},
                    "otlp-down": {"relay_otlp_endpoint": f"http://127.0.0.1:{workers.free_port()}"}, **variants}
    with BenchSetups(knobs, workers=args.workers, relay_options=relay_options,
                     names=tuple(args.setups.split(",")), variants=variants, tls=args.tls, h2=args.h2) as bench:
        tls = client_tls(args.h2) if args.tls else None
        setups = bench.setups
        # The warm-up's arrivals and the pauses: 1 s, or a window if shorter (a short run, as the
        # suite's in tests/test_bench_streams.py, is short throughout).
        pace_s = min(1.0, args.seconds)
        time.sleep(2 * pace_s)  # start-up work out of the way
        expected = None
        for url, _ in setups.values():  # warm-up; the direct stream's events are what every stream must carry
            warm = Window()
            asyncio.run(arrivals(url, 5, pace_s, None, warm, tls))
            expected = expected or (min(warm.events // max(1, len(warm.first_ms)), args.events) if warm.first_ms else None)
        results = {(name, r): Window() for name in setups for r in rates}
        for rate in rates:
            for _ in range(args.rounds):
                for name, (url, processes) in setups.items():
                    w = results[name, rate]
                    procs = processes()
                    c0 = cpu_of(procs)
                    w.load.append(os.getloadavg()[0])
                    asyncio.run(arrivals(url, rate, args.seconds, expected, w, tls, args.keep_alive))
                    for pname, c in cpu_of(procs).items():
                        w.cpu[pname] = w.cpu.get(pname, 0.0) + c - c0[pname]
                    time.sleep(pace_s / 2)  # let connections close before the next window

    report(args, rates, setups, results)
    records_against_clients(rates, setups, results, read_records(bench.tmp))
    if sink is not None:
        sink[0].terminate()
        print(f"the otlp setup's collector took {sink[0].communicate(timeout=10)[0].strip().splitlines()[-1]}")
    return 0


def otlp_sink() -> tuple[subprocess.Popen[str], str]:
    """benchmarks/_otlp_sink.py started: (its process, its URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks._otlp_sink"], cwd=Path(__file__).resolve().parent.parent,
                            stdout=subprocess.PIPE, text=True)
    atexit.register(lambda: proc.poll() is None and proc.kill())  # a bench that fails leaves no sink behind
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if line[:1] != ["listening"]:
        proc.kill()
        raise RuntimeError(f"the OTLP sink did not start: {line}")
    return proc, line[1]


def read_records(folder: Path) -> dict[str, dict]:
    """The relays' timing records (every worker's log), by x-request-id."""
    found = {}
    for log in folder.glob("timing*.jsonl"):
        for line in log.read_bytes().splitlines():
            rec = orjson.loads(line)
            found[rec.get("request_id")] = rec
    return found


def records_against_clients(rates: list[float], setups: dict, results: dict[tuple[str, float], Window],
                            records: dict[str, dict]) -> None:
    """What the relays' own records say of the same streams: their first token against the
    client's (the relay must see its own queueing), their verdicts, and the relay's own
    pauses (the worst loop lag and the longest garbage collection a record saw)."""
    print("the relays' records of the same streams: first token p50 / p99 (the client's), verdicts; "
          "the relay's own pauses: loop lag, longest GC (max over the records)")
    for rate in rates:
        for name in setups:
            w = results[name, rate]
            joined = [(records[rid], ms) for rid, ms in w.first_by_id.items() if rid in records]
            if not joined:
                continue
            ours = [rec["ttft_ms"] for rec, _ in joined if rec["ttft_ms"] is not None]
            theirs = [ms for _, ms in joined]
            verdicts = Counter(rec["verdict"] for rec, _ in joined).most_common(3)
            lag = max((rec.get("loop_lag_ms") or 0.0 for rec, _ in joined), default=0.0)
            gc_pause = max((rec.get("gc_pause_ms") or 0.0 for rec, _ in joined), default=0.0)
            print(f"{rate:>6g} {name:<9} {median(ours):>6.0f} / {percentile(ours, 99):.0f} ms "
                  f"({median(theirs):.0f} / {percentile(theirs, 99):.0f} ms); "
                  + ", ".join(f"{v} {n}" for v, n in verdicts) + f" of {len(joined)}; "
                  f"loop lag {lag:.0f} ms, GC {gc_pause:.0f} ms")


def report(args, rates: list[float], setups: dict, results: dict[tuple[str, float], Window]) -> None:
    loads = [x for w in results.values() for x in w.load]
    print(f"{'TLS on both hops' + (', h2 offered' if args.h2 else '') + '; ' if args.tls else ''}fake upstream: prefill {args.prefill_ms:g} ms, {args.events} events {args.gap_ms:g} ms apart; "
          f"{args.seconds:g} s of arrivals x {args.rounds} round(s) per setup and rate; {os.cpu_count()} cores; "
          f"load average (1 min) during the run {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'rate/s':>6} {'setup':<9} {'first token p50':>15} {'p99':>7} {'added p50':>9} {'worst gap p50':>13} "
          f"{'p99':>7} {'fail':>5} {'streams':>7} {'stalls':>6} {'load':>4}  CPU µs per event")
    sustained = {name: None for name in setups}
    broken = set()
    stall_ms = STALL_FACTOR * args.gap_ms
    stall_free: dict[str, float | None] = {name: None for name in setups}
    stalled_once = set()
    for rate in rates:
        direct = results.get(("direct", rate))
        for name in setups:
            w = results[name, rate]
            ft99, gap99 = percentile(w.first_ms, 99), percentile(w.worst_gap_ms, 99)
            cpu = ""
            if w.cpu and w.events:
                per = {p: s * 1e6 / w.events for p, s in w.cpu.items()}
                worker_names = [p for p in per if p.startswith("worker")]
                parts = [f"all {sum(per.values()):.0f}"]
                if worker_names:
                    parts.append(f"per worker {sum(per[p] for p in worker_names):.0f}")
                    parts += [f"{p} {per[p]:.0f}" for p in per if not p.startswith("worker")]
                cpu = ", ".join(parts)
            stalls = sum(1 for gap in w.worst_gap_ms if gap > stall_ms)
            added = median(w.first_ms) - median(direct.first_ms) if direct is not None else float("nan")
            print(f"{rate:>6g} {name:<9} {median(w.first_ms):>12.1f} ms {ft99:>4.0f} ms {added:>+6.1f} ms "
                  f"{median(w.worst_gap_ms):>10.0f} ms {gap99:>4.0f} ms {w.failures:>5} {w.streams:>7} {stalls:>6} "
                  f"{max(w.load, default=float('nan')):>4.1f}  {cpu}")
            if name not in stalled_once:
                if w.first_ms and stalls == 0 and w.failures <= STALL_ERROR_BUDGET * w.streams:
                    stall_free[name] = rate
                else:
                    stalled_once.add(name)
            if direct is not None and name != "direct" and name not in broken:
                ok = (w.failures == 0 and w.first_ms
                      and ft99 <= percentile(direct.first_ms, 99) + FIRST_TOKEN_SLACK_MS
                      and gap99 <= GAP_FACTOR * percentile(direct.worst_gap_ms, 99))
                if ok:
                    sustained[name] = rate
                else:
                    broken.add(name)
    stream_s = (args.prefill_ms + args.events * args.gap_ms) / 1000
    print(f"highest rate sustained (no failures, first token p99 <= direct + {FIRST_TOKEN_SLACK_MS:g} ms, "
          f"worst gap p99 <= {GAP_FACTOR:g} x direct):")
    for name, rate in sustained.items():
        if name != "direct":
            print(f"  {name:<9} {'none of the rates' if rate is None else f'{rate:g} streams/s (~{rate * stream_s:.0f} live)'}")
    print(f"streams held without a {stall_ms:g} ms stall (every event delivered, no gap after the first token "
          f"> {STALL_FACTOR:g} x the {args.gap_ms:g} ms pacing, < {STALL_ERROR_BUDGET:.1%} failed):")
    for name, rate in stall_free.items():
        print(f"  {name:<9} {'none of the rates' if rate is None else f'{rate:g} streams/s (~{rate * stream_s:.0f} live)'}")
    if args.keep_alive:
        print("connections the clients opened, kept alive: " + "; ".join(
            f"{name} {sum(results[name, r].connections for r in rates)} for "
            f"{sum(results[name, r].streams for r in rates)} streams" for name in setups))
    if args.h2:
        got = {name: sum((results[name, r].protocols for r in rates), Counter()) for name in setups}
        print("the protocol each setup's clients got: " + "; ".join(
            f"{name} " + ", ".join(f"{p} {n}" for p, n in got[name].most_common()) for name in setups))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


if __name__ == "__main__":
    sys.exit(main())
