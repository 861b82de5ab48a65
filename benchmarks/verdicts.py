"""Which hop: how many requests of issue 34's cases read the right verdict, on real links.

Each case is a real relay (mitmdump, or `ttft-relay run --workers 2`) and a fake provider,
with the far side behind a real far link where the case has one
(ttft_relay/testing/fakes/link.py: two network namespaces joined by a userspace packet
forwarder, so both kernels see real round trips). The relay's own records are read back
and each request's verdict is held to the hop that took the time:

    healthy near           client, relay and provider on loopback, line learned,
                           prompts up to 2 kB                                         ok
    far client fresh/kept  client → relay 150 ms each way, small prompts               client network
    far provider ...       relay → provider 100 ms RTT over TLS, 16 kB requests, on a
                           connection each (fresh) or one kept; steady, 0-20 ms
                           jitter, the relay as --workers 2, HTTP/2 on both sides     upstream connect/TLS/network
    slow provider queue    the provider holds its head 1.5 s, line learned            upstream queueing
    long context           36-56 kB prompts, line learned                             context length
    TLS listener (re)start 8 clients connecting while `--workers 2` starts, TLS       relay starting
    --workers 2 learning   a fresh relay's first requests, healthy, 0.2-4 kB          ok (or learning)
    429                    the provider answers 429                                   upstream refused: rate limited
    diagnose               `ttft-relay diagnose --relay URL --no-direct` (its
                           defaults) over the 150 ms-each-way client link             network to the relay

The fake provider's first token takes 150 ms (100 ms near) plus 100 ms per 1k prompt
tokens (its tokens are 4 bytes). Needs root, /dev/net/tun, `ip` and `nsenter` (the link's
cases); run it alone on the machine: flock /tmp/ttft-cpu.lock scripts/bench verdicts --quick
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ttft_relay import workers
from ttft_relay.testing.fakes import link
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.link import FarLink
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import REPO, MitmdumpProcess, option_text, read_records, start_fake_upstream
from ttft_relay.timing import phases

CHAT = "/v1/chat/completions"
KEY = "sk-bench-verdicts-not-a-real-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RELAY_PORT = 8443
"""Inside a link's own namespace, where nothing else listens."""
CLIENT_ONE_WAY_MS = 150
PROVIDER_ONE_WAY_MS = 50
JITTER_MS = 20
PREFILL_MS, PER_1K_MS = 150, 100
NEAR_PREFILL_MS = 100
QUEUE_MS = 1500
RECORD_WAIT_S = 15
RELAY_OPTIONS = {
    # Plain HTTP off loopback, open: each link's private namespace is the firewall.
    "relay_client_tls": "optional", "relay_allow_open_proxy": True, "relay_timing_console": False,
    "relay_metrics_listen": "", "relay_trim": False, "flow_detail": 0,
}
UPSTREAM_LINK = set(phases.UPSTREAM_LINK)


def body(kb: float, tag: str = "") -> dict:
    """A streamed chat request of about `kb` KB."""
    text = "lorem ipsum dolor sit amet " * max(1, int(kb * 1024 / 27))
    return {"model": "gpt-4o-mini", "stream": True,
            "messages": [{"role": "system", "content": f"You are terse. {tag}"}, {"role": "user", "content": text}]}


@dataclass
class Row:
    """One case: which verdicts are right, and what its requests read."""

    case: str
    right: set[str]
    said: list[str] = field(default_factory=list)
    note: str = ""

    def is_right(self, verdict: str) -> bool:
        return any(verdict.startswith(word) for word in self.right)

    def add(self, verdicts: list[str]) -> None:
        self.said += verdicts

    def summary(self) -> tuple[int, int, Counter[str]]:
        wrong = Counter(v for v in self.said if not self.is_right(v))
        return len(self.said) - sum(wrong.values()), len(self.said), wrong


# --- the relay and its clients -----------------------------------------------------------


def relay_options(tmp: Path, **options: object) -> dict[str, object]:
    from ttft_relay import config  # loads mitmproxy's addons: only when a relay starts

    return {**config.MITMPROXY_DEFAULTS, **RELAY_OPTIONS, "confdir": tmp / "confdir",
            "relay_timing_log": tmp / "timing.jsonl", **options}


def relay_in(side: link.Side | None, upstream: str, tmp: Path, **options: object) -> MitmdumpProcess:
    """The relay as one mitmdump, in `side`'s namespace on RELAY_PORT (all its addresses), or on loopback."""
    opts = relay_options(tmp, **options)
    port = RELAY_PORT if side is not None else 0
    relay = MitmdumpProcess([f"reverse:{upstream}@{port}"], Path(str(opts.pop("confdir"))), options=opts)
    if side is not None:
        relay.args[relay.args.index("--listen-host") + 1] = "0.0.0.0"
        relay.args = side.adopt(relay.args)
    return relay.start()


class Workers:
    """`ttft-relay run --workers N`, in `side`'s namespace (or on loopback), reverse to `upstream`."""

    def __init__(self, side: link.Side | None, n: int, upstream: str, tmp: Path, *, port: int | None = None,
                 listen_host: str = "127.0.0.1", **options: object) -> None:
        self.port = port or (RELAY_PORT if side is not None else workers.free_port())
        args = [sys.executable, "-m", "ttft_relay", "run", "--workers", str(n),
                "--mode", f"reverse:{upstream}@{self.port}", "--listen-host", listen_host]
        for name, value in relay_options(tmp, **options).items():
            args += ["--set", f"{name}={option_text(value)}"]
        self.tmp = tmp
        self.proc = subprocess.Popen(side.adopt(args) if side is not None else args, cwd=REPO,
                                     env={**os.environ, "TTFT_RELAY_CONF": ""}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.output: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # drained to the end, or a worker blocks once the pipe fills
            self.output.append(line)
            if " workers ready" in line:
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float = 60) -> None:
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError("ttft-relay run --workers did not start:\n" + "".join(self.output[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def records_of(tmp: Path, ids: list[str]) -> list[dict]:
    """The records of `ids`, in their order, from every log in `tmp` (one per worker or one for all)."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        found = {r.get("request_id"): r for path in sorted(glob.glob(str(tmp / "timing*.jsonl")))
                 for r in read_records(Path(path))}
        if all(rid in found for rid in ids) or time.monotonic() > deadline:
            return [found.get(rid) or {"verdict": "(no record)"} for rid in ids]
        time.sleep(0.05)  # the relay's writer writes a record moments after the answer: bounded poll


def verdicts(tmp: Path, ids: list[str]) -> list[str]:
    return [r["verdict"] for r in records_of(tmp, ids)]


def requests(origin: str, n: int, label: str, *, fresh: bool, side: link.Side | None = None,
             make: Callable[[int], tuple[dict, dict]] = lambda i: (body(0.2), {}), ca: Path | None = None) -> list[str]:
    """`n` requests to `origin`, each on a connection of its own (`fresh`) or all on one, from
    `side`'s namespace; `make(i)` gives each its body and extra headers. Returns their ids."""
    ids = [f"{label}-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
    conn: HttpConnection | None = None
    try:
        for i, rid in enumerate(ids):
            if conn is None or fresh:
                if conn is not None:
                    conn.close()
                with entered(side):
                    conn = HttpConnection(origin, ca=ca, timeout=60)
            payload, headers = make(i)
            response = conn.request("POST", CHAT, payload, AUTH | {"x-request-id": rid} | headers)
            response.read()
    finally:
        if conn is not None:
            conn.close()
    return ids


def h2_requests(port: int, n: int, label: str, *, fresh: bool, side: link.Side, payload: dict) -> list[str]:
    """As `requests`, over HTTP/2 to the relay's port on `side`'s loopback, TLS (its certificate
    unchecked: it names the far side's address, as the relay leaves the provider's unchecked)."""
    import httpx2  # the SDKs' HTTP client, a test dependency

    unchecked = ssl.create_default_context()
    unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
    ids = [f"{label}-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
    h2c: httpx2.Client | None = None
    with side.entered():  # connections are made lazily, by the request: in the namespace
        try:
            for rid in ids:
                if h2c is None or fresh:
                    if h2c is not None:
                        h2c.close()
                    h2c = httpx2.Client(http2=True, verify=unchecked, timeout=60)
                response = h2c.post(f"https://127.0.0.1:{port}{CHAT}", json=payload, headers=AUTH | {"x-request-id": rid})
                if response.http_version != "HTTP/2":
                    raise RuntimeError(f"the relay answered over {response.http_version}, not HTTP/2")
        finally:
            if h2c is not None:
                h2c.close()
    return ids


@contextmanager
def entered(side: link.Side | None) -> Iterator[None]:
    if side is None:
        yield
    else:
        with side.entered():
            yield


def learn(origin: str, side: link.Side | None = None) -> None:
    """Teaches a relay its provider's first-token line: prompts from 0.5 to 56 kB, none queued."""
    sizes = [0.5, 56, 2, 40, 8, 24, 1, 48, 16, 4, 32, 12]
    requests(origin, len(sizes), "learn", fresh=False, side=side, make=lambda i: (body(sizes[i]), {}))


# --- the cases -------------------------------------------------------------------------------


def near_cases(n: int, tmp: Path) -> list[Row]:
    """Client, relay and provider on loopback; the relay learns its line first."""
    fake, upstream = start_fake_upstream(prefill_ms=NEAR_PREFILL_MS, prefill_ms_per_1k_tokens=PER_1K_MS)
    rows = [Row("healthy near (loopback)", {phases.OK}), Row("slow provider queue (+1.5 s head)", {phases.UPSTREAM_QUEUEING}),
            Row("long context (36-56 kB)", {phases.CONTEXT_LENGTH}),
            Row("provider answers 429", {f"{phases.UPSTREAM_REFUSED}: rate limited (429)"})]
    try:
        with relay_in(None, upstream, tmp) as relay:
            origin = relay.url()
            learn(origin)
            # Up to 2 kB: the prompt's share of the first token stays under the half that reads `context length`.
            healthy = requests(origin, n, "healthy", fresh=False, make=lambda i: (body([0.2, 0.5, 1, 2][i % 4]), {}))
            queued = requests(origin, n, "queued", fresh=False,
                              make=lambda i: (body([0.5, 1, 2][i % 3]), {"x-fake-head-delay-ms": str(QUEUE_MS)}))
            long = requests(origin, n, "long", fresh=False, make=lambda i: (body(36 + 4 * (i % 6)), {}))
            refused = requests(origin, n, "refused", fresh=False, make=lambda i: (body(1), {"x-fake-status": "429"}))
            for row, ids in zip(rows, (healthy, queued, long, refused)):
                row.add(verdicts(tmp, ids))
    finally:
        fake.terminate()
        fake.wait(10)
    return rows


def far_client_cases(n: int, diagnose_runs: int, tmp: Path) -> list[Row]:
    """Client → relay 150 ms each way; relay and provider together in `far`."""
    fresh = Row(f"far client {2 * CLIENT_ONE_WAY_MS} ms RTT, fresh", {phases.CLIENT_NETWORK})
    kept = Row(f"far client {2 * CLIENT_ONE_WAY_MS} ms RTT, kept", {phases.CLIENT_NETWORK})
    diagnosed = Row("diagnose over the far client link (defaults, --no-direct)", {"network to the relay"})
    with FarLink(delay_ms=CLIENT_ONE_WAY_MS, seed=7) as far:
        fake, upstream = start_fake_upstream(wrap=far.far.adopt, prefill_ms=PREFILL_MS,
                                             prefill_ms_per_1k_tokens=PER_1K_MS)
        try:
            with relay_in(far.far, upstream, tmp):
                origin = f"http://{far.far.ip}:{RELAY_PORT}"
                learn(origin, far.near)
                fresh.add(verdicts(tmp, requests(origin, n, "fresh", fresh=True, side=far.near)))
                kept.add(verdicts(tmp, requests(origin, n, "kept", fresh=False, side=far.near)))
                for _ in range(diagnose_runs):
                    diagnosed.add([diagnose(far.near, origin)])
        finally:
            fake.terminate()
            fake.wait(10)
    return [fresh, kept, diagnosed]


def diagnose(side: link.Side, origin: str) -> str:
    """`ttft-relay diagnose --relay ORIGIN --no-direct` from `side`: its verdict line."""
    done = subprocess.run(side.adopt([sys.executable, "-m", "ttft_relay", "diagnose", "--relay", origin, "--no-direct"]),
                          cwd=REPO, env={**os.environ, "OPENAI_API_KEY": KEY}, capture_output=True, text=True,
                          timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("verdict: ")), None)
    if line is None:
        return f"(no verdict: exit {done.returncode})"
    return line.removeprefix("verdict: ").split(" — ")[0]


def far_provider_cases(n: int, tmp: Path, *, jitter_ms: float = 0, n_workers: int = 1, h2: bool = False) -> list[Row]:
    """Relay → provider 100 ms RTT over TLS (client and relay together in `near`), 16 kB
    requests each on a connection of its own, then on one kept connection; with `h2`, HTTP/2
    on both sides (a client over TLS that speaks it, `http2: true`, a provider that picks it)."""
    how = (f", 0-{jitter_ms:g} ms jitter" if jitter_ms else "") + (f", --workers {n_workers}" if n_workers > 1 else "") \
        + (", HTTP/2" if h2 else "")
    fresh = Row(f"far provider {2 * PROVIDER_ONE_WAY_MS} ms RTT TLS 16 kB{how}, fresh", UPSTREAM_LINK)
    kept = Row(f"far provider {2 * PROVIDER_ONE_WAY_MS} ms RTT TLS 16 kB{how}, kept", UPSTREAM_LINK)
    sixteen_kb = {"model": "gpt-4o-mini", "stream": True,
                  "messages": [{"role": "user", "content": "Say hello. " + "context " * 2000}]}

    def same(i: int) -> tuple[dict, dict]:
        return sixteen_kb, {}

    with FarLink(delay_ms=PROVIDER_ONE_WAY_MS, jitter_ms=jitter_ms, seed=13) as far:
        with far.far.entered():  # the fake's loop thread stays in `far`
            fake = FakeUpstream(tls=True, certs=TestCerts.create(tmp / "upstream-ca"), host=far.far.ip, h2=h2).start()
        fake.behaviour.prefill_ms = 30
        upstream = f"https://{far.far.ip}:{fake.port}"
        origin = f"http://127.0.0.1:{RELAY_PORT}"
        # The test CA names localhost, not the far side's address: TLS is real, its name unchecked.
        try:
            if n_workers == 1:
                relay = relay_in(far.near, upstream, tmp, ssl_insecure=True, http2=h2)
                stop = relay.stop
            else:
                many = Workers(far.near, n_workers, upstream, tmp, listen_host="0.0.0.0", ssl_insecure=True)
                stop = many.stop
            try:
                if n_workers > 1:
                    many.wait_ready()
                if h2:
                    fresh.add(verdicts(tmp, h2_requests(RELAY_PORT, n, "fresh", fresh=True, side=far.near, payload=sixteen_kb)))
                    kept.add(verdicts(tmp, h2_requests(RELAY_PORT, n, "kept", fresh=False, side=far.near, payload=sixteen_kb)))
                else:
                    fresh.add(verdicts(tmp, requests(origin, n, "fresh", fresh=True, side=far.near, make=same)))
                    kept.add(verdicts(tmp, requests(origin, n, "kept", fresh=False, side=far.near, make=same)))
            finally:
                stop()
        finally:
            fake.stop()
    return [fresh, kept]


def restart_case(starts: int, clients: int, tmp: Path) -> list[Row]:
    """`ttft-relay run --workers 2` with a TLS listener, started while `clients` clients keep
    connecting: the supervisor listens before its workers serve, so each first connection waits
    in the kernel's queue, inside its TLS handshake."""
    row = Row(f"TLS listener (re)start, {clients} clients waiting", {phases.RELAY_STARTING})
    fake, upstream = start_fake_upstream(prefill_ms=NEAR_PREFILL_MS)
    certs = TestCerts.create(tmp / "listener-ca")
    port = workers.free_port()
    try:
        for start in range(starts):
            ids = [f"start{start}-{i}-{uuid.uuid4().hex[:8]}" for i in range(clients)]

            def client(rid: str) -> None:
                """Connects as soon as the port takes it (one that never does has no record: counted wrong)."""
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        with HttpConnection(f"https://localhost:{port}", ca=certs.ca_pem, timeout=60) as conn:
                            conn.request("POST", CHAT, body(0.2), AUTH | {"x-request-id": rid}).read()
                        return
                    except ConnectionRefusedError:
                        time.sleep(0.005)  # polling for the supervisor's listener, bounded by the deadline

            threads = [threading.Thread(target=client, args=(rid,)) for rid in ids]
            for t in threads:
                t.start()
            relay = Workers(None, 2, upstream, tmp, port=port, relay_client_tls="all",
                            certs=f"localhost={certs.cert_and_key_pem}")
            try:
                for t in threads:
                    t.join(90)
                row.add(verdicts(tmp, ids))
            finally:
                relay.stop()
    finally:
        fake.terminate()
        fake.wait(10)
    return [row]


def learning_case(n: int, tmp: Path) -> list[Row]:
    """A fresh `ttft-relay run --workers 2` (nothing learned), healthy requests of mixed sizes
    from its first: none is a slow hop for being among the first. (Up to 4 kB: the prompt's
    share of the first token stays under the half that reads `context length` once learned.)"""
    row = Row("--workers 2 learning, first requests", {phases.OK})
    fake, upstream = start_fake_upstream(prefill_ms=PREFILL_MS, prefill_ms_per_1k_tokens=PER_1K_MS)
    relay = Workers(None, 2, upstream, tmp)
    try:
        relay.wait_ready()
        sizes = [0.5, 4, 1, 3, 2, 0.2, 4, 0.5, 2.5, 1, 3.5, 1.5]
        row.add(verdicts(tmp, requests(f"http://127.0.0.1:{relay.port}", n, "learning", fresh=True,
                                       make=lambda i: (body(sizes[i % len(sizes)]), {}))))
    finally:
        relay.stop()
        fake.terminate()
        fake.wait(10)
    return [row]


# --- the run ---------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [f"{'case':<62} {'right':>7}  wrong verdicts seen", "-" * 100]
    for row in rows:
        right, total, wrong = row.summary()
        seen = ", ".join(f"{v} ×{c}" for v, c in wrong.most_common()) or "-"
        lines.append(f"{row.case:<62} {right:>3}/{total:<3}  {seen}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per case (a few minutes)")
    ap.add_argument("--requests", type=int, help="per case and connection kind (default 30; --quick 8)")
    ap.add_argument("--only", action="append", default=[],
                    choices=["near", "far-client", "far-provider", "restart", "learning"], help="run only these (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    if (reason := link.unavailable()) is not None:
        sys.exit(f"bench verdicts needs real far links: {reason}")
    n = args.requests or (8 if args.quick else 30)
    only = set(args.only) or {"near", "far-client", "far-provider", "restart", "learning"}
    started, load_before = time.time(), os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-verdicts-"))

    def part(name: str) -> Path:
        (root / name / "confdir").mkdir(parents=True)
        return root / name

    rows: list[Row] = []
    if "near" in only:
        rows += near_cases(n, part("near"))
    if "far-client" in only:
        rows += far_client_cases(n, 2 if args.quick else 5, part("far-client"))
    if "far-provider" in only:
        rows += far_provider_cases(n, part("provider"))
        rows += far_provider_cases(n, part("provider-jitter"), jitter_ms=JITTER_MS)
        rows += far_provider_cases(n, part("provider-workers"), n_workers=2)
        rows += far_provider_cases(n, part("provider-h2"), h2=True)
    if "restart" in only:
        rows += restart_case(1 if args.quick else 3, 8, part("restart"))
    if "learning" in only:
        rows += learning_case(max(n, 12) if args.quick else 24, part("learning"))
    took = time.time() - started
    if args.json:
        print(json.dumps({"requests": n, "seconds": round(took), "load": [load_before, os.getloadavg()],
                          "rows": [{"case": r.case, "right": sorted(r.right), "said": dict(Counter(r.said))}
                                   for r in rows]}, indent=2))
        return
    print(f"{n} requests per case and connection kind; {took:.0f} s; load average "
          f"{' '.join(f'{x:.1f}' for x in load_before)} before, {' '.join(f'{x:.1f}' for x in os.getloadavg())} after "
          f"({os.cpu_count()} CPUs)")
    print(table(rows))
    print(f"the relays' records: {root}/*/timing*.jsonl")


if __name__ == "__main__":
    main()
