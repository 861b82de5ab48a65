"""Start-up benchmark: how long after its start the relay answers its first request, and how long after its port opens.

A client polls the listener's port (a connect every 2 ms, as a client retrying would)
and sends its request on the first connection the port takes; a fake OpenAI upstream
(in this process) answers at once. Three ways the relay starts, each `--runs` times:

    run        `ttft-relay run`: one mitmdump process (the tokenizers loaded before
               mitmproxy starts; it binds its listeners before it loads the relay's addons)
    workers    `ttft-relay run --workers 2`, as scripts/relay runs it: the supervisor
               binds, the port listens once the first worker serves
    socket     the same on a listening socket passed as systemd's socket unit passes it
               (a restart under deploy/ttft-relay.socket): the port is open before the
               relay starts, so a client waits for the start itself (worker 0 starts
               beside the supervisor, prefork.py)

Per way, medians over the runs (ms): from the start to the port taking a connection,
to the mitmproxy loading the relay ("Loading script": Python, mitmproxy, the options,
the tokenizers), to the relay saying its tokenizers are ready ("tokenizer ready": its
addons configured), to the first answer; and from the port open to the first answer,
the wait a client that connected at once sees.

    scripts/bench start [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

from ttft_relay import workers
from ttft_relay.testing import socket_activation
from ttft_relay.testing.fakes.upstream import FakeUpstream

REPO = Path(__file__).resolve().parent.parent
CHAT = {"model": "gpt-4o-mini", "stream": False, "messages": [{"role": "user", "content": "Say hello"}]}
POLL_S = 0.002
WAYS = ("run", "workers", "socket")
MARKS = {"loaded": "Loading script", "tokenizer": "tokenizer ready"}
"""Lines of the relay's output that mark a step of its start (their first occurrence)."""


def first_answer(port: int, deadline: float) -> float:
    """Polls `port` until it takes a connection, asks on it: the moment the port opened."""
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the relay never listened on {port}") from None
            time.sleep(POLL_S)  # the client's retry pace
    opened = time.monotonic()
    with sock:
        body = orjson.dumps(CHAT)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: relay\r\ncontent-type: application/json\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        head = sock.recv(64)
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"the first request was answered {head!r}")
    return opened


def start_once(way: str, upstream: FakeUpstream, work: Path) -> dict[str, float]:
    """One start of the relay `way`: ms from its start to each step."""
    port = workers.free_port()
    args = [sys.executable, "-m", "ttft_relay", "run", "--listen-host", "127.0.0.1",
            "--mode", f"reverse:{upstream.base_url}@{port}", "--set", "relay_metrics_listen=",
            "--set", f"confdir={work / 'confdir'}", "--set", f"relay_timing_log={work / 'timing.jsonl'}"]
    unit = socket.create_server(("127.0.0.1", port)) if way == "socket" else None
    if way != "run":
        args[4:4] = ["--workers", "2"]
    command, fds = socket_activation.command([unit], args) if unit is not None else (args, ())
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, pass_fds=fds, env={**os.environ, "TTFT_RELAY_CONF": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)
    seen: dict[str, float] = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            for mark, text in MARKS.items():
                if text in line:
                    seen.setdefault(mark, time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        opened = first_answer(port, began + 120)
        answered = time.monotonic()
    finally:
        proc.terminate()
        proc.wait(120)
        reader.join(10)
        if unit is not None:
            unit.close()
    out = {mark: (seen[mark] - began) * 1000 for mark in MARKS if mark in seen}
    return {"port": (opened - began) * 1000, **out, "answer": (answered - began) * 1000,
            "port_to_answer": (answered - opened) * 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp, FakeUpstream() as upstream:
        for n in range(args.runs):
            for way in WAYS[n % 3:] + WAYS[:n % 3]:  # turns: drift on a shared machine hits each alike
                results[way].append(start_once(way, upstream, Path(tmp)))
    columns = ("port", "loaded", "tokenizer", "answer", "port_to_answer")
    print(f"median of {args.runs} starts, ms from the start (port_to_answer: from the port open)")
    print(f"{'':8}" + "".join(f"{c:>15}" for c in columns))
    for way, runs in results.items():
        cells = [statistics.median(r[c] for r in runs) if all(c in r for r in runs) else float("nan")
                 for c in columns]
        print(f"{way:8}" + "".join(f"{v:>15.0f}" for v in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
