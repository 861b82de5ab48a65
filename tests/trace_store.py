"""A real trace store for the end-to-end tests: Arize Phoenix, which takes OTLP/HTTP (protobuf) on
/v1/traces and answers what it stored on its REST API (/v1/projects/{project}/spans).

`installed_phoenix()` pip-installs the pinned set (tests/phoenix-requirements.txt, ~150
packages, ~800 MB) once into its own environment outside the repository
(`${TTFT_RELAY_CACHE:-~/.cache/ttft-relay}/phoenix-<version>`), never into .venv with its
pinned constraints, and reuses it; about a minute on a cold cache. It skips the calling test
with a clear message only when the package index cannot be reached. `Phoenix` runs one
server on free loopback ports with a throwaway working directory (its SQLite database).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ttft_relay.workers import free_port

REQUIREMENTS = Path(__file__).with_name("phoenix-requirements.txt")
VERSION = next(line.split("==")[1].strip() for line in REQUIREMENTS.read_text().splitlines()
               if line.startswith("arize-phoenix=="))
INSTALL_TIMEOUT_S = 900
START_TIMEOUT_S = 120
_UNREACHABLE = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
                "Temporary failure in name resolution", "Network is unreachable", "ProxyError")


def cache_dir() -> Path:
    return Path(os.environ.get("TTFT_RELAY_CACHE") or "~/.cache/ttft-relay").expanduser() / f"phoenix-{VERSION}"


def installed_phoenix() -> Path:
    """The `phoenix` command of the pinned Phoenix, installed on first use (under a file lock:
    other checkouts may install it at the same time)."""
    root = cache_dir()
    phoenix = root / "venv" / "bin" / "phoenix"
    stamp = root / "installed"
    want = REQUIREMENTS.read_text()
    if stamp.exists() and stamp.read_text() == want and phoenix.exists():
        return phoenix
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == want and phoenix.exists():
            return phoenix
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root / "venv")], check=True)
        try:
            done = subprocess.run(
                [str(root / "venv" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                 "-r", str(REQUIREMENTS)],
                capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip install of Arize Phoenix took over {INSTALL_TIMEOUT_S} s: package index unreachable?")
        if done.returncode != 0:
            output = done.stdout + done.stderr
            if any(marker in output for marker in _UNREACHABLE):
                pytest.skip(f"package index unreachable, cannot install Arize Phoenix:\n{output[-800:]}")
            raise RuntimeError(f"pip install -r {REQUIREMENTS.name} failed:\n{output[-3000:]}")
        stamp.write_text(want)
        print(f"[trace_store] Arize Phoenix {VERSION} installed into {root} in {time.monotonic() - started:.0f} s",
              file=sys.stderr)
    return phoenix


class Phoenix:
    """One Phoenix server on loopback; `otlp_base` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def otlp_base(self) -> str:
        return self.url

    def start(self) -> Phoenix:
        phoenix = installed_phoenix()
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PHOENIX_WORKING_DIR": str(self.workdir), "PHOENIX_PORT": str(self.port),
               "PHOENIX_GRPC_PORT": str(free_port()), "PHOENIX_HOST": "127.0.0.1",
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        for name in list(env):
            if name.startswith("OTEL_"):  # the store itself traces nothing anywhere
                del env[name]
        self.log = self.workdir / "phoenix.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(phoenix), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Phoenix did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}{'?' + query if query else ''}", timeout=10) as r:
            return json.load(r)

    def spans(self, trace_id: str, project: str = "default") -> list[dict[str, Any]]:
        """Every span Phoenix has stored of one trace."""
        try:
            return self.get(f"/v1/projects/{project}/spans", trace_id=trace_id, limit=1000)["data"]
        except urllib.error.HTTPError as e:
            if e.code == 404:  # the project exists once its first span arrived
                return []
            raise

    def wait_for_spans(self, trace_id: str, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        """The trace's spans once at least `count` arrived (the relays export in batches); fewer
        after `timeout` fail (a count that is too high would otherwise cost the whole timeout)."""
        deadline = time.monotonic() + timeout
        while len(found := self.spans(trace_id)) < count:
            assert time.monotonic() < deadline, f"{len(found)} of {count} spans of {trace_id} after {timeout} s: {found}"
            time.sleep(0.25)
        return found

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Phoenix:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
