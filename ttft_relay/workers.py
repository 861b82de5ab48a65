"""`ttft-relay run --workers N`: the relay on every core, as N mitmdump workers behind HAProxy.

mitmproxy runs on one core, so under a burst of streams the relay becomes the slow
hop. This supervisor starts N identical workers (mitmdump with the relay's addons and
the user's arguments, one confdir and so one CA), each on its own loopback ports,
and HAProxy (TCP mode, least connections) on the listeners the relay would have
opened itself: regular-proxy clients (CONNECT) and reverse-mode clients alike.

- Options: the workers' command line is the user's with mitm.conf merged in
  (`config.merged_args`: code defaults < mitm.conf < command line), and the
  supervisor checks the options mitmdump makes of that same command line.
- A worker that dies is taken out of rotation at once (HAProxy runtime API), started
  again (with a growing pause if it keeps dying) and put back when it accepts.
  HAProxy's own health checks also take out a worker that stops accepting. Checks go
  to an extra loopback regular-proxy listener per worker (its health port): a connect
  to a reverse listener would make mitmproxy connect upstream at once (eager
  `connection_strategy`), one TLS handshake with the API per check.
- Each worker writes its own timing log, `<relay_timing_log stem>.<n>.jsonl`;
  `ttft-relay report 'logs/timing*.jsonl'` reads them together.
- Metrics: the workers record into one prometheus-client multiprocess directory and
  this process serves the one scrape endpoint (`relay_metrics_listen`).
- The children die with the supervisor, even on kill -9 (Linux: PR_SET_PDEATHSIG;
  the workers then stop cleanly), and a listen port already taken stops start-up.
- Ctrl-C (SIGINT) or SIGTERM stops every worker, each answering and recording its flows
  in flight, while HAProxy soft-stops (no new connections; what is under way goes on).
- SIGHUP goes on to every worker (each reopens its log and re-reads certificates).
- TLS to clients ends in the workers (HAProxy passes TCP): where HAProxy listens off
  loopback, the workers get `relay_client_tls=all`, since their own listeners are on
  loopback.

With `--workers 1` (the default of `ttft-relay run`), or without haproxy on PATH, it
runs the single process (exec, nothing in between). `scripts/relay` asks for
`--workers auto`: one per core.

    ttft-relay run [--workers N|auto] [mitmdump arguments ...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mitmproxy import optmanager
from mitmproxy.proxy import mode_specs

from . import config, launch
from .guard import guard, tls
from .timing import metrics, timing

HAPROXY_INSTALL = "Debian/Ubuntu: sudo apt-get install haproxy · Fedora: sudo dnf install haproxy · macOS: brew install haproxy"
WORKER_LISTEN_HOST = "127.0.0.1"
OVERRIDDEN = {"mode", "listen_host", "listen_port", "relay_timing_log"}
"""Options each worker gets from the supervisor instead of the user's command line."""
_FLAGS = {"--mode": "mode", "-m": "mode", "--listen-host": "listen_host",
          "--listen-port": "listen_port", "-p": "listen_port"}
BALANCEABLE = (mode_specs.RegularMode, mode_specs.ReverseMode, mode_specs.UpstreamMode, mode_specs.Socks5Mode)
"""Listener kinds HAProxy can pass on as plain TCP."""
FRONTEND_BACKLOG = 4096
"""HAProxy's accept queue per listener; the kernel caps it at net.core.somaxconn."""
READY_TIMEOUT = 60.0
RESTART_PAUSE = (1.0, 30.0)
"""Pause before restarting a dead worker: doubles from the first while it keeps dying
within a minute of its start, up to the second."""
STOP_TIMEOUT = 15.0


def _die_with_parent() -> None:
    """In a child, before exec: the kernel sends it SIGTERM when the supervisor dies,
    however it dies (kill -9 included). Linux only; elsewhere children outlive a
    killed supervisor."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != _SUPERVISOR_PID:  # the supervisor died before the prctl took
            os._exit(1)


PR_SET_PDEATHSIG = 1
_SUPERVISOR_PID = os.getpid()
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
"""Looked up before any fork: the child only calls it."""


def port_taken(host: str, port: int) -> bool:
    """Whether someone listens on host:port already. HAProxy binds with SO_REUSEPORT,
    so a second one would share a port a first one (or any relay) holds; binding
    without it tells."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return True
    return False


def log(msg: str) -> None:
    print(f"[ttft-relay] {msg}", file=sys.stderr, flush=True)


# --- options ------------------------------------------------------------------------

SUPERVISOR_READS = (guard.Exposure, guard.AccessKeys, tls.ClientTLS, timing.Timing, metrics.Metrics)
"""The addons whose options the supervisor reads (their `load` only declares them)."""


def worker_options(args: list[str]) -> tuple[list[str], optmanager.OptManager]:
    """The workers' command line (`args` with mitm.conf merged in, config.merged_args)
    and the options mitmdump makes of it, for the supervisor's own checks."""
    merged = launch.relay_args(args)
    return merged, config.started_options(merged, [addon() for addon in SUPERVISOR_READS])


def strip_options(args: list[str], names: set[str]) -> list[str]:
    """`args` without the settings of options `names`, in any spelling mitmdump
    accepts (`--mode X`, `--mode=X`, `-pX`, `--set mode=X`, ...)."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        flag, eq, _ = arg.partition("=")
        if flag in _FLAGS and _FLAGS[flag] in names:
            if not eq:
                next(it, None)
            continue
        if arg[:2] in _FLAGS and len(arg) > 2 and not arg.startswith("--") and _FLAGS[arg[:2]] in names:
            continue  # -p8080
        if flag == "--set":
            value = arg.split("=", 1)[1] if eq else next(it, "")
            if value.split("=", 1)[0].strip() in names:
                continue
            out += ["--set", value]
            continue
        out.append(arg)
    return out


# --- listeners and HAProxy ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((WORKER_LISTEN_HOST, 0))
        return s.getsockname()[1]


@dataclass
class Listener:
    """One of the relay's listeners: HAProxy binds it, each worker serves it on its own port."""

    spec: str
    """The mode as configured, e.g. `reverse:https://api.openai.com@8001`."""
    host: str
    port: int
    worker_ports: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"listener_{self.port}"

    def worker_spec(self, worker: int) -> str:
        """The same mode on the worker's loopback port."""
        head = self.spec.rpartition("@")[0] if "@" in self.spec else self.spec
        return f"{head}@{WORKER_LISTEN_HOST}:{self.worker_ports[worker]}"


def listeners(opts: optmanager.OptManager, workers: int) -> list[Listener]:
    out = []
    for spec in opts.mode:
        mode = mode_specs.ProxyMode.parse(spec)
        # "both" (reverse https also takes HTTP/3 over UDP): HAProxy passes the TCP side.
        if not isinstance(mode, BALANCEABLE) or mode.transport_protocol == "udp":
            raise SystemExit(f"listener {spec!r} cannot be balanced over TCP; run it with --workers 1")
        port = mode.listen_port(opts.listen_port)
        assert port is not None  # None only for modes that bind no address, which are not BALANCEABLE
        out.append(Listener(spec, mode.listen_host(opts.listen_host), port, [free_port() for _ in range(workers)]))
    return out


def haproxy_config(listeners: list[Listener], health_ports: list[int], runtime_socket: Path) -> str:
    """HAProxy in TCP mode, least connections, one `listen` section per listener; each
    worker is checked on its health port."""
    workers = len(health_ports)
    lines = [
        "global",
        f"    stats socket {runtime_socket} mode 600 level admin",
        # Never share a listen port with another process (a second relay, a stale HAProxy).
        "    noreuseport",
        "defaults",
        "    mode tcp",
        "    balance leastconn",
        "    timeout connect 5s",
        "    timeout queue 30s",
        # A streamed answer may stay silent for minutes (a long prefill); the relay and
        # the upstream have their own timeouts.
        "    timeout client 1h",
        "    timeout server 1h",
        # Once a worker has closed its side (it stopped, or closed an idle keep-alive
        # connection), the client has this long to close its own: a stop is not held
        # up for an hour by pooled connections.
        "    timeout client-fin 5s",
        # A connect refused by a worker that just died goes to another one.
        "    option redispatch",
        "    retries 3",
        # The supervisor takes a dead worker out at once; the checks are the second line,
        # rare because each shows as a client connect in the worker's console.
        "    default-server inter 5s fall 2 rise 1",
    ]
    for lst in listeners:
        host = f"[{lst.host}]" if ":" in lst.host else lst.host
        lines += ["", f"listen {lst.name}", f"    bind {host}:{lst.port} backlog {FRONTEND_BACKLOG}"]
        lines += [f"    server w{i} {WORKER_LISTEN_HOST}:{lst.worker_ports[i]} check port {health_ports[i]}"
                  for i in range(workers)]
    return "\n".join(lines) + "\n"


class HAProxy:
    """The HAProxy child process and its runtime API (a Unix socket)."""

    def __init__(self, workdir: Path, listeners: list[Listener], health_ports: list[int]) -> None:
        self.socket_path = workdir / "haproxy.sock"
        self.config_path = workdir / "haproxy.cfg"
        self.config_path.write_text(haproxy_config(listeners, health_ports, self.socket_path))
        self.listeners = listeners
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        check = subprocess.run(["haproxy", "-c", "-q", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise SystemExit(f"haproxy rejects the generated configuration:\n{check.stdout}{check.stderr}")
        # -db: stay in the foreground, so this process supervises it.
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.config_path)], process_group=0,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 10
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("haproxy did not start (are the listen ports free?)")
            time.sleep(0.05)

    def set_worker_state(self, worker: int, state: str) -> None:
        """`state`: "ready" (in rotation) or "maint" (out of it), for every listener."""
        commands = ";".join(f"set server {lst.name}/w{worker} state {state}" for lst in self.listeners)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(self.socket_path))
                s.sendall(commands.encode() + b"\n")
                s.recv(4096)
        except OSError as e:
            log(f"haproxy runtime API: {e}")


# --- workers ----------------------------------------------------------------------


def worker_client_tls(opts: optmanager.OptManager, listeners: list[Listener]) -> str | None:
    """The `relay_client_tls` a worker needs: workers listen on loopback, so where HAProxy
    listens off loopback, "off-loopback" must become "all" for them (None: leave it).
    Reverse listeners on loopback then accept only TLS too."""
    if opts.relay_client_tls == guard.CLIENT_TLS_OFF_LOOPBACK and any(
            not guard.is_loopback(lst.host) for lst in listeners):
        return guard.CLIENT_TLS_ALL
    return None


def worker_log(path: str, worker: int) -> str:
    """`logs/timing.jsonl` → `logs/timing.<worker>.jsonl`."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{worker}{p.suffix or '.jsonl'}"))


class Worker:
    """One mitmdump worker, restarted when it dies."""

    def __init__(self, index: int, args: list[str], env: dict[str, str], health_port: int) -> None:
        self.index = index
        self.args = args
        self.env = env
        self.health_port = health_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.in_rotation = False
        self.restart_at: float | None = None
        self.pause = RESTART_PAUSE[0]

    def start(self) -> None:
        # Its own process group: Ctrl-C reaches the supervisor, which stops workers once.
        # SIGTERM if the supervisor dies: a clean stop (records written, clients told).
        self.proc = subprocess.Popen(self.args, env=self.env, stdin=subprocess.DEVNULL, process_group=0,
                                     preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        self.restart_at = None

    def accepting(self) -> bool:
        try:
            socket.create_connection((WORKER_LISTEN_HOST, self.health_port), timeout=0.5).close()
        except OSError:
            return False
        return True

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


class Supervisor:
    def __init__(self, user_args: list[str], workers: int) -> None:
        merged, self.opts = worker_options(user_args)
        exposed = guard.unprotected_listeners(
            self.opts.mode, self.opts.listen_host, self.opts.proxyauth, bool(self.opts.relay_access_keys),
            self.opts.relay_client_tls, bool(self.opts.certs),
        )
        if exposed and not self.opts.relay_allow_open_proxy:
            # The workers listen on loopback and cannot see HAProxy's addresses: check here.
            raise SystemExit("refusing to start as an open proxy: " + "; ".join(exposed))
        self.listeners = listeners(self.opts, workers)
        if taken := [f"{lst.host or '*'}:{lst.port}" for lst in self.listeners if port_taken(lst.host, lst.port)]:
            raise SystemExit(f"refusing to start: {', '.join(taken)} is taken (another relay running?)")
        self.workdir = Path(tempfile.mkdtemp(prefix="ttft-relay-workers-"))
        health_ports = [free_port() for _ in range(workers)]
        self.haproxy = HAProxy(self.workdir, self.listeners, health_ports)
        metrics_dir = self.workdir / "metrics"
        metrics_dir.mkdir()
        self.metrics_dir = metrics_dir
        worker_args = strip_options(merged, OVERRIDDEN)
        if left := config.command_line_options(["mitmdump", *worker_args], self.opts) & OVERRIDDEN:
            raise SystemExit(f"cannot give the workers their own {', '.join(sorted(left))}: spell them "
                             "--mode, --listen-host, -p or --set NAME=VALUE")
        base = [launch.tool_path("mitmdump"), "-s", str(launch.ADDON), *worker_args]
        self.workers = []
        for i in range(workers):
            args = base + ["--listen-host", WORKER_LISTEN_HOST]
            for lst in self.listeners:
                args += ["--mode", lst.worker_spec(i)]
            args += ["--mode", f"regular@{WORKER_LISTEN_HOST}:{health_ports[i]}"]
            args += ["--set", f"relay_timing_log={worker_log(self.opts.relay_timing_log, i) if self.opts.relay_timing_log else ''}"]
            if client_tls := worker_client_tls(self.opts, self.listeners):
                args += ["--set", f"relay_client_tls={client_tls}"]
            env = {**os.environ, metrics.WORKER_ENV: str(i), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
            self.workers.append(Worker(i, args, env, health_ports[i]))
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGHUP, self._reload)
        try:
            for w in self.workers:
                w.start()
            self._wait_ready()
            self.haproxy.start()
            for w in self.workers:
                w.in_rotation = True
            if listen := self.opts.relay_metrics_listen:
                (host, port), _server = metrics.serve(listen, metrics.multiprocess_registry(self.metrics_dir))
                log(f"metrics of all workers at http://{host}:{port}/metrics")
            where = ", ".join(f"{lst.spec} on {lst.host or '*'}:{lst.port}" for lst in self.listeners)
            log(f"{len(self.workers)} workers behind haproxy: {where}")
            haproxy = self.haproxy.proc
            assert haproxy is not None  # started above
            while not self.stopping:
                if haproxy.poll() is not None:
                    log(f"haproxy exited ({haproxy.returncode}); stopping")
                    return 1
                for w in self.workers:
                    self._look_after(w)
                time.sleep(0.2)
            return 0
        finally:
            self._shutdown()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for w in self.workers:
            while not w.accepting():
                if w.exited() or self.stopping or time.monotonic() > deadline:
                    raise SystemExit(f"worker {w.index} did not start (see its output above)")
                time.sleep(0.1)

    def _look_after(self, w: Worker) -> None:
        now = time.monotonic()
        if w.restart_at is None and w.exited():
            assert w.proc is not None  # exited() says it ran
            self.haproxy.set_worker_state(w.index, "maint")
            lost = metrics.in_flight_of(w.proc.pid, self.metrics_dir)
            metrics.forget_process(w.proc.pid, self.metrics_dir)
            w.in_rotation = False
            w.pause = RESTART_PAUSE[0] if now - w.started_at > 60 else min(w.pause * 2, RESTART_PAUSE[1])
            w.restart_at = now + w.pause
            recorded = ("the restarted worker records them as lost" if self.opts.relay_timing_log
                        else "no record of them")
            in_flight = (f" with {lost} request(s) in flight ({recorded}; their clients saw the connection "
                         f"reset)") if lost else ""
            log(f"worker {w.index} exited ({w.proc.returncode}){in_flight}; out of rotation, "
                f"restarting in {w.pause:.0f} s")
        elif w.restart_at is not None and now >= w.restart_at:
            w.start()
        elif not w.in_rotation and w.restart_at is None and not w.exited() and w.accepting():
            self.haproxy.set_worker_state(w.index, "ready")
            w.in_rotation = True
            log(f"worker {w.index} back in rotation")

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _reload(self, signum, frame) -> None:
        # Each worker reopens its own log and re-reads certificates (ttft_relay/reload.py).
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGHUP)

    def _shutdown(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Workers first: each answers its flows in flight ("relay shutting down") and
        # records them. HAProxy soft-stops meanwhile (SIGUSR1: it stops listening and
        # passes on what is under way), so those answers still reach the clients.
        if self.haproxy.proc is not None and self.haproxy.proc.poll() is None:
            self.haproxy.proc.send_signal(signal.SIGUSR1)
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGINT)  # as Ctrl-C: done hooks run, logs are flushed
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in [*(w.proc for w in self.workers), self.haproxy.proc]:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def split_workers(argv: list[str]) -> tuple[int, list[str]]:
    """`--workers N|auto` (or `--workers=N`; the last one counts; default 1) out of the
    command line; the rest is mitmdump's."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--workers", default="1")
    ns, rest = ap.parse_known_args(argv)
    if ns.workers == "auto":
        return default_workers(), rest
    if not ns.workers.isdigit() or int(ns.workers) < 1:
        raise SystemExit(f"--workers must be a number of at least 1, or auto (one per core), not {ns.workers!r}")
    return int(ns.workers), rest


def default_workers() -> int:
    """One per core this process may run on."""
    return len(os.sched_getaffinity(0))


def main(argv: list[str]) -> int:
    workers, args = split_workers(argv)
    if workers > 1 and shutil.which("haproxy") is None:
        log(f"haproxy not found, so running one worker (one core). For {workers} workers install it "
            f"({HAPROXY_INSTALL}); --workers 1 silences this note.")
        workers = 1
    if workers == 1:
        launch.start("mitmdump", args)
    return Supervisor(args, workers).run()
