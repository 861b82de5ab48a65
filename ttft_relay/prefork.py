"""How the supervisor starts a worker process (workers.py), and worker 0 before it has read
the options, on systemd's sockets.

A start on sockets systemd holds (deploy/ttft-relay.socket: a restart) keeps its clients
waiting in the sockets' queue until a worker serves. The supervisor's own start (Python,
mitmproxy's option table, the relay's addons that declare the options it reads: ≈ 0.9 s)
would come before worker 0's; `first_worker` starts worker 0 at once instead, before those
imports, on systemd's descriptors: the two start side by side, and worker 0 waits, once its
own imports are done, for what its supervisor tells it about those sockets (which listener
each serves: `LISTENERS_LATER_ENV`). This module imports nothing heavy for that reason.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

WORKER_ENV = "TTFT_RELAY_WORKER"
"""In a worker: its index (0 …): its in-flight ledger's name, its metrics' label."""
LISTEN_FDS_ENV = "TTFT_RELAY_LISTEN_FDS"
"""In a worker: its listening sockets, as JSON: {"listeners": {mode spec: [descriptors]},
"kept_open": [the specs whose sockets systemd holds], "backlog": the listen backlog}."""
LISTENERS_LATER_ENV = "TTFT_RELAY_LISTENERS_LATER"
"""In a worker started before its supervisor knew its listeners (`first_worker`): the pipe
on which the supervisor writes what LISTEN_FDS_ENV would hold, then closes it (closed
without a word: the supervisor did not start, nor does the worker)."""
READY_FD_ENV = "TTFT_RELAY_READY_FD"
"""In a worker: the pipe on which it says it is ready (accepting)."""
SYSTEMD_FIRST_FD = 3
"""sd_listen_fds(3): the first socket systemd passes; the others follow it."""
_SYSTEMD_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")

PR_SET_PDEATHSIG = 1
_SUPERVISOR_PID = os.getpid()
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
"""Looked up before any fork: the child only calls it."""


def _die_with_parent() -> None:
    """In a child, before exec: the kernel sends it SIGTERM when the supervisor dies,
    however it dies (kill -9 included). Linux only; elsewhere children outlive a
    killed supervisor."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != _SUPERVISOR_PID:  # the supervisor died before the prctl took
            os._exit(1)


@dataclass
class Spawned:
    """A worker process just started: its ready pipe (read end), and the pipe its listeners
    follow on (write end) if it was started before they were known."""

    proc: subprocess.Popen[bytes]
    ready_pipe: int
    listeners_pipe: int | None = None


def spawn(args: list[str], env: dict[str, str], pass_fds: tuple[int, ...], *,
          listeners_later: bool = False) -> Spawned:
    """Starts a worker: `args` in its own process group (Ctrl-C reaches the supervisor, which
    stops the workers once), SIGTERM when the supervisor dies (a clean stop: records written,
    clients told), the descriptors `pass_fds` and its ready pipe passed; with
    `listeners_later`, the pipe its listeners will follow on too."""
    ready_read, ready_write = os.pipe()
    later = os.pipe() if listeners_later else None
    child_env = {**env, READY_FD_ENV: str(ready_write)}
    fds = (*pass_fds, ready_write)
    if later is not None:
        child_env[LISTENERS_LATER_ENV] = str(later[0])
        fds += (later[0],)
    try:
        proc = subprocess.Popen(args, env=child_env, stdin=subprocess.DEVNULL, process_group=0,
                                preexec_fn=_die_with_parent, pass_fds=fds)
    except BaseException:
        os.close(ready_read)
        if later is not None:
            os.close(later[1])
        raise
    finally:
        os.close(ready_write)
        if later is not None:
            os.close(later[0])
    os.set_blocking(ready_read, False)
    return Spawned(proc, ready_read, later[1] if later is not None else None)


def worker_args(user_args: list[str]) -> list[str]:
    """A worker's command line: the relay on the user's arguments (workers.worker_main)."""
    return [sys.executable, "-m", "ttft_relay.workers", *user_args]


@dataclass
class FirstWorker:
    """Worker 0, started before the supervisor read its options (`first_worker`)."""

    spawned: Spawned
    metrics_dir: str
    """The prometheus-client multiprocess directory it records into: the supervisor's."""
    fds: tuple[int, ...]
    """systemd's descriptors, which it holds."""

    def abandon(self) -> None:
        """The supervisor does not start, or cannot use it: it has started nothing yet (it
        waits for its listeners), and is killed."""
        if self.spawned.listeners_pipe is not None:
            os.close(self.spawned.listeners_pipe)
            self.spawned.listeners_pipe = None
        os.close(self.spawned.ready_pipe)
        self.spawned.proc.kill()
        self.spawned.proc.wait()


def first_worker(user_args: list[str]) -> FirstWorker | None:
    """Worker 0 started now, on the sockets systemd passed this process (none: None, the
    supervisor starts it once it has bound its own), its listeners to follow."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or not os.environ.get("LISTEN_FDS", "").isdigit():
        return None
    fds = tuple(range(SYSTEMD_FIRST_FD, SYSTEMD_FIRST_FD + int(os.environ["LISTEN_FDS"])))
    metrics_dir = tempfile.mkdtemp(prefix="ttft-relay-metrics-")
    env = {name: value for name, value in os.environ.items() if name not in _SYSTEMD_ENV}
    env.update(PROMETHEUS_MULTIPROC_DIR=metrics_dir, **{WORKER_ENV: "0"})
    return FirstWorker(spawn(worker_args(user_args), env, fds, listeners_later=True), metrics_dir, fds)


def listeners_given() -> str | None:
    """In a worker: what its supervisor says about its listening sockets (LISTEN_FDS_ENV's
    JSON), waited for if it was started before they were known; None if its supervisor
    closed the pipe without a word."""
    if LISTENERS_LATER_ENV not in os.environ:
        return os.environ.pop(LISTEN_FDS_ENV)
    with open(int(os.environ.pop(LISTENERS_LATER_ENV)), "rb") as pipe:
        said = pipe.read()
    return said.decode() or None


def split_workers(argv: list[str]) -> tuple[int, list[str], bool]:
    """`--workers N|auto` (or `--workers=N`; the last one counts; default 1) out of the
    command line: (N, the rest, which is mitmdump's, whether a supervisor runs them). `auto`
    (one per core) is supervised even on one core: a reload then replaces the worker
    without dropping a turn; `--workers 1` (the default) is the one process, nothing between."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--workers", default="1")
    ns, rest = ap.parse_known_args(argv)
    if ns.workers == "auto":
        return default_workers(), rest, True
    if not ns.workers.isdigit() or int(ns.workers) < 1:
        raise SystemExit(f"--workers must be a number of at least 1, or auto (one per core), not {ns.workers!r}")
    return int(ns.workers), rest, int(ns.workers) > 1


def default_workers() -> int:
    """One per core this process may run on."""
    return len(os.sched_getaffinity(0))
