"""Runs a real `mitmdump` process for end-to-end tests and benchmarks.

`MitmdumpProcess` starts mitmdump with listeners on port 0, reads the ports it
reports from its output, and fails loudly if a script failed to load (mitmdump
keeps running as a bare, buffering proxy when that happens, which would make a
streaming test measure the wrong thing).
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
"""The directory that holds the package: a checkout's root (README.md, docs/ and benchmarks/
beside it), or site-packages for an installed copy. The processes started here run in it, so
that `python -m` finds this copy of the package."""
RELAY_SCRIPT = REPO / "ttft_relay" / "relay.py"
MITMDUMP = Path(sys.executable).parent / "mitmdump"
MITMWEB = Path(sys.executable).parent / "mitmweb"

_LISTENING = re.compile(r"listening at (?:\*|[\d.]+|\[[^\]]*\]):(\d+)")
_SCRIPT_ERROR = re.compile(r"error in script|Traceback|mitmproxy has crashed", re.I)


def option_text(value: object) -> str:
    """An option value as mitmproxy's command line spells it (booleans: true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_args(options: dict[str, object]) -> list[str]:
    """`--set name=value` for each option; a list, one per item (mitmproxy makes them its sequence)."""
    return [arg for name, value in options.items()
            for item in (value if isinstance(value, list) else [value]) for arg in ("--set", f"{name}={option_text(item)}")]


class MitmdumpProcess:
    """One mitmdump process. `ports` lists the listen ports in the order reported,
    which is the order of `--mode` arguments."""

    def __init__(
        self,
        modes: list[str],
        confdir: Path,
        *,
        script: Path | None = RELAY_SCRIPT,
        options: dict[str, object] | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        relay_conf: Path | None = None,
    ) -> None:
        self.modes = modes
        self.confdir = confdir
        if relay_conf is not None:  # mitm.conf is read by the command, which runs mitmdump with the relay
            assert script == RELAY_SCRIPT
            args = [sys.executable, "-m", "ttft_relay", "run"]
        else:
            args = [str(MITMDUMP)]
        args += ["--set", f"confdir={confdir}", "--listen-host", "127.0.0.1"]
        for mode in modes:
            args += ["--mode", mode]
        if script is not None and relay_conf is None:
            args += ["-s", str(script)]
        if script == RELAY_SCRIPT:
            # A test stops its relay with the streams it holds open: ended at once (the relay's
            # default waits up to 30 s for them to finish); a test of the grace sets its own.
            options = {"relay_shutdown_grace": 0, **(options or {})}
        args += set_args(options or {})
        args += extra_args or []
        self.args = args
        self.env = {**os.environ, "TTFT_RELAY_CONF": str(relay_conf) if relay_conf else "", **(env or {})}
        log = (options or {}).get("relay_timing_log")
        self.log = TimingLog(Path(log)) if log else None
        """The relay's timing log (None if no `relay_timing_log` was set)."""
        self.output: list[str] = []
        self.ports: list[int] = []
        self._ready = threading.Event()
        self._output_done = threading.Event()
        self._changed = threading.Condition()
        self.proc: subprocess.Popen[str] | None = None
        self._interrupted = False

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def ca_pem(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def start(self, timeout: float = 30) -> MitmdumpProcess:
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env,
            cwd=REPO,
        )
        threading.Thread(target=self._read_output, daemon=True).start()
        if not self._ready.wait(timeout):
            self._abandon()
            raise RuntimeError(f"mitmdump did not start listening:\n{self.text()}")
        if len(self.ports) < len(self.modes) or self.proc.poll() is not None:
            self._abandon()
            raise RuntimeError(f"mitmdump failed to start:\n{self.text()}")
        bad = [line for line in self.output if _SCRIPT_ERROR.search(line)]
        if bad:
            self._abandon()
            raise RuntimeError(f"relay script failed to load:\n{self.text()}")
        return self

    def _abandon(self, exiting_within: float = 1) -> None:
        """After a failed start: a mitmdump exiting on its own is left to exit (a signal now lands
        in its teardown and prints a traceback of Python's own); one still running is stopped."""
        if self._output_done.wait(exiting_within):
            self.proc.wait(10)
        else:
            self.stop()

    def _read_output(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            with self._changed:
                self.output.append(line.rstrip("\n"))
                if m := _LISTENING.search(line):
                    self.ports.append(int(m.group(1)))
                    if len(self.ports) == len(self.modes):
                        self._ready.set()
                self._changed.notify_all()
        self._output_done.set()
        self._ready.set()  # exited: let start() report it
        with self._changed:
            self._changed.notify_all()

    def wait_for_output(self, pattern: str, timeout: float = 10) -> str:
        """The first output line matching `pattern`, waiting for it to appear."""
        rx = re.compile(pattern)
        with self._changed:
            found = self._changed.wait_for(
                lambda: next((ln for ln in self.output if rx.search(ln)), None), timeout
            )
        if not found:
            raise AssertionError(f"no output line matches {pattern!r}:\n{self.text()}")
        return found

    def wait_for_lines(self, pattern: str, count: int, timeout: float = 10) -> list[str]:
        """The output lines matching `pattern`, waiting until there are `count` of them (a
        relay logs as it goes: a line may come moments after what a client saw)."""
        rx = re.compile(pattern)
        with self._changed:
            self._changed.wait_for(lambda: sum(1 for ln in self.output if rx.search(ln)) >= count, timeout)
            found = [ln for ln in self.output if rx.search(ln)]
        if len(found) < count:
            raise AssertionError(f"{len(found)} of {count} output lines match {pattern!r}:\n{self.text()}")
        return found

    def text(self) -> str:
        return "\n".join(self.output)

    def url(self, index: int = 0) -> str:
        return f"http://127.0.0.1:{self.ports[index]}"

    def interrupt(self) -> None:
        """Asks mitmdump to stop the way Ctrl-C would, not waiting: `stop()` waits. Several
        relays asked at once shut down side by side (mitmproxy takes about a second each)."""
        if self.proc and self.proc.poll() is None and not self._interrupted:
            self._interrupted = True  # once: a second signal while shutting down can hit a closed wakeup fd
            self.proc.send_signal(2)  # SIGINT

    def stop(self) -> str:
        """Stops mitmdump the way Ctrl-C would (so `done` hooks run), and returns its output."""
        if self.proc and self.proc.poll() is None:
            self.interrupt()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.text()

    def __enter__(self) -> MitmdumpProcess:
        # `with relay.start():` is common: a second start would leave the first process running
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RelayWorkers:
    """`ttft-relay run --workers N` (the relay as N workers sharing its listeners) in reverse mode to
    `upstream` on a free port, for benchmarks; `processes()` names its process tree, `lines` are
    the supervisor's output (stderr). `repo`: the checkout whose relay runs (another one's, a
    `git archive` of an older commit, to measure before a change)."""

    def __init__(self, upstream: str, n: int, tmp: Path, options: dict[str, object] | None = None, *,
                 repo: Path = REPO) -> None:
        from ttft_relay import workers  # the supervisor's module imports mitmproxy: only when used

        self.port = workers.free_port()
        args = [sys.executable, "-m", "ttft_relay", "run", "--workers", str(n),
                "--mode", f"reverse:{upstream}@{self.port}", "--listen-host", "127.0.0.1"]
        options = {"confdir": tmp, "relay_timing_log": tmp / "timing-n.jsonl",
                   "relay_metrics_listen": "127.0.0.1:0", "flow_detail": 0, **(options or {})}
        args += set_args(options)
        self.args = args
        self.repo = repo
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._changed = threading.Condition()

    def spawn(self) -> RelayWorkers:
        """Started, not waited for (`start` waits until it serves)."""
        self.proc = subprocess.Popen(self.args, cwd=self.repo, env={**os.environ, "TTFT_RELAY_CONF": ""},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def start(self) -> RelayWorkers:
        if self.spawn().wait_for(r"\d+ workers ready", 120) is None:
            raise RuntimeError("ttft-relay run --workers did not start:\n" + "\n".join(self.lines[-30:]))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:  # drained to the end, or a worker blocks once the pipe fills
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.proc.wait()
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60) -> str | None:
        """The first line of its output that matches `pattern`; None if none came within
        `timeout` or before it exited."""
        rx = re.compile(pattern)

        def found() -> str | None:
            return next((ln for ln in self.lines if rx.search(ln)), None)
        with self._changed:
            self._changed.wait_for(lambda: found() is not None or (self.proc is not None and self.proc.poll() is not None),
                                   timeout)
            return found()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self) -> dict[str, int]:
        """"supervisor", "worker 1", "worker 2", ... → pid."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return {"supervisor": self.proc.pid, **{f"worker {n}": int(pid) for n, pid in enumerate(out.stdout.split(), 1)}}

    def workers(self) -> dict[int, int]:
        """Each live worker's index (as the supervisor numbers them, from 0) → its pid."""
        from ttft_relay.observe.metrics import WORKER_ENV

        out = {}
        for name, pid in self.processes().items():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            for entry in environ:
                if entry.startswith(WORKER_ENV.encode() + b"=") and name != "supervisor":
                    out[int(entry.split(b"=", 1)[1])] = pid
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(2)
            self.proc.wait(30)


def read_records(log: Path) -> list[dict]:
    """The timing records in a relay's JSONL log (none if it was never written)."""
    return [orjson.loads(line) for line in log.read_bytes().splitlines()] if log.exists() else []


RECORD_WAIT_S = 10
"""How long a record may take to reach the log: the relay's writer thread writes it moments after the flow ends."""


class TimingLog:
    """A relay's JSONL timing log, as the tests read it.

    Tests that share a relay find their own records by the `x-request-id` they sent
    (`of`). Each such look-up also states how many records the request id gets in all;
    `check_counts`, called once the relay stopped (stopping flushes the log), fails on
    any written later: a second record for one flow shows up there, not in a sleep.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._expected: dict[str, int] = {}

    def records(self) -> list[dict]:
        """Every record written so far: whole lines only (the relay's writer thread may be
        in the middle of one; a line crossing a page boundary shows up in two steps)."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        return [orjson.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()]

    def wait(self, count: int, timeout: float = RECORD_WAIT_S) -> list[dict]:
        """Every record once there are at least `count` (a relay of one test's own)."""
        return self._wait_for(lambda recs: len(recs) >= count, lambda recs: recs, f"{count} records", timeout)

    def of(self, request_id: str, count: int = 1, timeout: float = RECORD_WAIT_S) -> list[dict]:
        """The `count` records carrying `request_id`, waiting for them to be written; more fail."""
        self._expected[request_id] = count

        def mine(recs: list[dict]) -> list[dict]:
            return [r for r in recs if r.get("request_id") == request_id]

        found = self._wait_for(lambda recs: len(mine(recs)) >= count, mine, f"{count} records of {request_id!r}",
                               timeout)
        assert len(found) == count, f"{len(found)} records of {request_id!r}, expected {count}: {found}"
        return found

    def none_of(self, request_id: str) -> None:
        """`request_id` gets no record: `check_counts` says so once the relay stopped."""
        self._expected[request_id] = 0

    def check_counts(self) -> None:
        """Each request id looked up got exactly the records said: call once the relay stopped."""
        counts: dict[str, int] = {}
        for rec in self.records():
            counts[rec.get("request_id")] = counts.get(rec.get("request_id"), 0) + 1
        wrong = {rid: (counts.get(rid, 0), n) for rid, n in self._expected.items() if counts.get(rid, 0) != n}
        assert not wrong, "records per x-request-id (written, expected) once the relay stopped: " + repr(wrong)

    def _wait_for(self, done: Callable[[list[dict]], bool], pick: Callable[[list[dict]], list[dict]], what: str,
                  timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not done(recs := self.records()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.path} holds {len(recs)} records, not {what}, after {timeout} s")
            time.sleep(0.02)  # polling a file another process writes, bounded by the deadline
        return pick(recs)


def start_fake_upstream(*, tls_dir: Path | None = None, h2: bool = False,
                        wrap: Callable[[list[str]], list[str]] | None = None,
                        **knobs: object) -> tuple[subprocess.Popen[str], str]:
    """`ttft_relay.testing.fakes.upstream` as its own process (so it does not share the load
    generator's interpreter), with behaviour knobs as keyword arguments
    (`prefill_ms=50, chunks=20`); with `tls_dir`, serving HTTPS with a test CA written
    there (ca.pem), and with `h2` offering HTTP/2 too; `wrap` rewrites its command line
    (a far link's `Side.adopt`: in a network namespace). Returns the process and its base URL."""
    args = [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "ttft_relay.testing.fakes.upstream", "--port", "0"]
    if tls_dir is not None:
        args += ["--tls", "--certs-dir", str(tls_dir)] + (["--h2"] if h2 else [])
    for knob, value in knobs.items():
        args += [f"--{knob.replace('_', '-')}", str(value)]
    if wrap is not None:
        args = wrap(args)
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout
    line = proc.stdout.readline().split()
    if line[:1] != ["listening"]:
        proc.kill()
        raise RuntimeError(f"fake upstream did not start: {line}")
    return proc, line[1]


def connect_many(port: int, n: int) -> list[socket.socket]:
    """`n` non-blocking connects to a loopback listener, not waited for."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        out.append(s)
    return out


def handshakes_completed(sockets: list[socket.socket]) -> list[socket.socket]:
    """Those of `sockets` whose connect completed, i.e. the listener's kernel queue
    took them even if nobody accepts them yet. A connect whose SYN the kernel dropped
    (queue full) is not retried for 1 s; loopback handshakes complete at once, so
    half a second with nothing new ends the wait."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in sockets}
    for fd in by_fd:
        poller.register(fd, select.POLLOUT)
    done = []
    while len(done) < len(sockets) and (ready := poller.poll(500)):
        for fd, _ in ready:
            poller.unregister(fd)
            if not by_fd[fd].getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                done.append(by_fd[fd])
    return done


def metrics_url(relay: MitmdumpProcess) -> str:
    """The scrape URL a relay with `relay_metrics_listen` reported."""
    return re.search(r"(http://\S+/metrics)", relay.wait_for_output(r"metrics at http://")).group(1)


def scrape(url: str) -> dict[str, float]:
    """Sample name + sorted labels → value, from the text exposition at `url`."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        s.name + repr(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f"('{k}', '{v}')" for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.startswith(name + "[") and all(w in k for w in want))


def descendants(pid: int) -> list[tuple[int, str]]:
    """Live processes below `pid` (children, theirs, ...) as (pid, command line), from /proc
    (Linux; elsewhere none). Zombies are left out: they are gone, only not yet reaped."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            child = int(entry.name)
            children.setdefault(int(stat[1]), []).append(child)
            commands[child] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    found, todo = [], list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        found.append((p, commands.get(p, "?")))
        todo.extend(children.get(p, ()))
    return found
