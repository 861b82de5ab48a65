"""What the benchmarks share: the setups they compare, the fake upstream's shape from their
command line, and their measures (CPU seconds, percentiles).

The relay, its processes and the fake upstream come from the test support
(ttft_relay/testing/harness.py); what is here only the benchmarks use, and it starts
benchmarks/'s own scripts, so it lives beside them, in the checkout.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from ttft_relay.testing.harness import MitmdumpProcess, RelayWorkers, start_fake_upstream

REPO = Path(__file__).resolve().parent.parent
BASELINE_SCRIPT = REPO / "benchmarks" / "baseline_stream.py"
"""A mitmproxy script that streams every response and does nothing else: what
benchmarks measure the relay against."""
SEAMS_SCRIPT = REPO / "benchmarks" / "seams_stream.py"
"""The relay's seams (its patches and streaming) with none of its work: bench streams' `seams`."""


class BenchSetups:
    """The setups the benchmarks compare, against one fake upstream subprocess:

        direct    the fake upstream itself
        floor     benchmarks/forwarder.py: a plain asyncio TCP forwarder (only if named; not with tls)
        bare      mitmdump -s benchmarks/baseline_stream.py (streaming, nothing else)
        seams     mitmdump -s benchmarks/seams_stream.py: the relay's patches and streaming, no relay
                  work (only if named), with the relay's defaults for mitmproxy's options
        relay-1   the relay as one mitmdump process
        relay-N   ttft-relay run --workers N: N workers sharing the listener (only if N > 1)
        nginx     nginx with proxy_buffering off, one worker (benchmarks/references.py; only if named)
        envoy     Envoy with its router, one worker (benchmarks/references.py; only if named)

    and, for each of `variants` (name → options), the relay as one process with those
    options over `relay_options`: an A/B of an option in the same interleaved run. With
    `tls`, the fake serves HTTPS (every setup trusts its test CA), and every setup takes
    TLS from its clients too (mitmproxy's own certificate; clients do not verify it); with
    `h2` as well, the fake offers HTTP/2 before HTTP/1.1, as the real APIs do.

    `setups` maps each name to (url, processes), `processes()` naming the pids whose
    CPU counts for it (none for direct). A context manager: everything stops on exit.
    """

    def __init__(self, knobs: dict[str, object], *, workers: int, relay_options: dict[str, object] | None = None,
                 names: tuple[str, ...] = ("direct", "bare", "relay-1", "relay-N"),
                 variants: dict[str, dict[str, object]] | None = None, tls: bool = False, h2: bool = False) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-"))
        self.knobs = knobs
        self.workers = workers
        self.tls_dir = self.tmp / "upstream-ca" if tls else None
        self.h2 = h2
        self.upstream_trust = {"ssl_verify_upstream_trusted_ca": self.tls_dir / "ca.pem"} if self.tls_dir else {}
        from ttft_relay import config  # here, not for every test: it loads mitmproxy's addons (and their imports)

        # The relay as its command starts it: with the relay's defaults for mitmproxy's options.
        self.relay_defaults = config.MITMPROXY_DEFAULTS
        self.relay_options = {**self.relay_defaults, "flow_detail": 0, "relay_metrics_listen": "127.0.0.1:0",
                              **self.upstream_trust, **(relay_options or {})}
        self.names = names
        self.variants = variants or {}
        self.setups: dict[str, tuple[str, Callable[[], dict[str, int]]]] = {}
        self._stoppers: list[Callable[[], object]] = []

    def __enter__(self) -> BenchSetups:
        try:
            fake, upstream = start_fake_upstream(tls_dir=self.tls_dir, h2=self.h2, **self.knobs)
            self._stoppers.append(lambda: (fake.terminate(), fake.wait(10)))
            mode = f"reverse:{upstream}@0"
            if "direct" in self.names:
                self.setups["direct"] = (upstream, dict)
            if "floor" in self.names and self.tls_dir is None:
                self.setups["floor"] = self._forwarder(upstream)
            for kind in ("nginx", "envoy"):
                if kind in self.names:
                    from benchmarks.references import ReferenceProxy, binary

                    if binary(kind) is None:  # a reference left out says so; the run goes on
                        print(f"{kind} is not installed: left out (scripts/bench installs it where it can)",
                              file=sys.stderr)
                        continue
                    reference = ReferenceProxy(kind, upstream, self.tmp, certs=self.tls_dir, h2=self.h2)
                    self._stoppers.append(reference.stop)
                    self.setups[kind] = (reference.start().url(), reference.processes)
            singles = {}
            if "bare" in self.names:
                singles["bare"] = MitmdumpProcess([mode], self.tmp, script=BASELINE_SCRIPT,
                                                  options={"flow_detail": 0, **self.upstream_trust})
            if "seams" in self.names:
                singles["seams"] = MitmdumpProcess([mode], self.tmp, script=SEAMS_SCRIPT, options={
                    **self.relay_defaults, "flow_detail": 0, **self.upstream_trust})
            if "relay-1" in self.names:
                singles["relay-1"] = MitmdumpProcess(
                    [mode], self.tmp, options={**self.relay_options, "relay_timing_log": self.tmp / "timing-1.jsonl"})
            for name, options in self.variants.items():
                singles[name] = MitmdumpProcess(
                    [mode], self.tmp, options={**self.relay_options, **options, "relay_timing_log": self.tmp / f"timing-{name}.jsonl"})
            for name, proc in singles.items():
                self._stoppers.append(proc.stop)
                proc.start()
                self.setups[name] = (proc.url(), lambda p=proc: {"mitmdump": p.proc.pid})
            if "relay-N" in self.names and self.workers > 1:
                multi = RelayWorkers(upstream, self.workers, self.tmp, self.relay_options)
                self._stoppers.append(multi.stop)
                self.setups[f"relay-{self.workers}"] = (multi.start().url(), multi.processes)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _forwarder(self, upstream: str) -> tuple[str, Callable[[], dict[str, int]]]:
        u = urlsplit(upstream)
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.forwarder", str(u.hostname), str(u.port)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)
        self._stoppers.append(lambda: (proc.terminate(), proc.wait(10)))
        assert proc.stdout
        line = proc.stdout.readline().split()
        if line[:1] != ["listening"]:
            raise RuntimeError(f"forwarder did not start: {line}")
        return line[1], lambda: {"forwarder": proc.pid}

    def __exit__(self, *exc: object) -> None:
        for stop in reversed(self._stoppers):
            stop()
        self._stoppers.clear()


def stream_shape_arguments(ap: argparse.ArgumentParser, *, prefill_ms: float = 50, gap_ms: float = 10,
                           chunks: int = 20) -> None:
    """The fake upstream's answer as benchmarks take it from their command line."""
    ap.add_argument("--prefill-ms", type=float, default=prefill_ms, help=f"before the first token (default {prefill_ms:g})")
    ap.add_argument("--gap-ms", type=float, default=gap_ms, help=f"between the other chunks (default {gap_ms:g})")
    ap.add_argument("--chunks", type=int, default=chunks, help=f"answer pieces (default {chunks})")


def stream_shape(args: argparse.Namespace) -> dict[str, object]:
    """The fake upstream's knobs from `stream_shape_arguments`."""
    return {"prefill_ms": args.prefill_ms, "gap_ms": args.gap_ms, "chunks": args.chunks}


def cpu_seconds(*pids: int) -> float:
    """User + system CPU time of processes, from /proc (Linux); ones gone count 0."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile of `values` (NaN for none)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else math.nan
