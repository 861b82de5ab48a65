"""`ttft-relay run --workers N`: the relay on every core, as N mitmdump workers sharing its listeners.

mitmproxy runs on one core, so under a burst of streams the relay becomes the slow
hop. This supervisor binds every TCP listener the relay's options name, as mitmproxy
would (every address of the listen host, IPv4 and IPv6 for all interfaces;
`SO_REUSEADDR`, so a restart is not refused over connections in TIME-WAIT; the
relay's listen backlog), and starts N identical workers (the relay, one confdir and so
one CA) that inherit those sockets and accept from the same kernel queues: a pre-fork
server. A worker serves them through `patches/fixes/inherited_listeners.py`, which it
installs before mitmproxy starts (the supervisor checks its pins first: on a mitmproxy whose
code under it changed, `--workers N` refuses to start, saying so). So:

- each worker owns its clients' sockets: the client's address, `client_rtt_ms` and
  retransmits (TCP_INFO) are the client's own, with 1 worker and with N;
- a connection waits in the kernel until some worker accepts it; a busy worker accepts
  less (a few connections per turn of its event loop); the connections still queued when
  a worker dies are taken by the others, and no hop is added between client and worker.

- Options: each worker gets the user's command line, and merges mitm.conf under it as
  `ttft-relay run --workers 1` does (`launch.start`); the supervisor reads the options
  mitmdump makes of that same command line (`config.merged_args`). Each worker checks
  them as the single process does, open-proxy check on the listen addresses included.
- Start-up: worker 0 starts first; once it is ready (accepting), the others. On sockets
  systemd holds (a restart, whose clients wait in their queue), worker 0 starts before the
  supervisor reads the options, beside its imports (`prefork.first_worker`). Only a
  configuration no restart can fix stops the start, with exit status EXIT_START_FAILED,
  on which systemd does not restart the unit (deploy/ttft-relay.service) but shows it
  failed: worker 0 exiting on its own before any worker was ready (its own output says
  why: a bad option, a missing key file), a port already taken. Any other death is
  restarted, during start-up as after it (killed before it was ready: the OOM killer),
  with a growing pause if it keeps dying; the others serve meanwhile, and "N workers
  ready" counts the live ones.
- One timing log, the one the user named: every worker appends to it (`record.RecordWriter`
  says how, rotation included); each keeps its in-flight ledger beside it
  (`observe/ledger.py`), read by the worker that replaces it.
- Metrics: the workers record into one prometheus-client multiprocess directory and
  this process serves the one scrape endpoint (`relay_metrics_listen`; a port taken is a
  warning with the fix, as in the single process).
- The children die with the supervisor, even on kill -9 (Linux: PR_SET_PDEATHSIG;
  the workers then stop cleanly), and a listen port already taken stops start-up.
- Ctrl-C (SIGINT) or SIGTERM stops: the listeners first (listeners.py: no new
  connection, the queued ones served, then closed), then every worker finishes its
  flows in flight within relay_shutdown_grace, answering and recording what is left.
- SIGHUP reloads (systemctl reload): relay.conf and the command line read again, new
  workers started on the same sockets; once all are ready they take over and the old
  ones retire (listeners.RETIRE_SIGNAL: they finish their turns in flight, then exit).
  A configuration that cannot be read, or a new worker that cannot start, leaves the
  old ones serving. No signal reaches a worker before it can handle it. `ttft-relay
  reload` sends the SIGHUP, finding the supervisor by the pid file it keeps in the
  confdir (`pid_file`).
- Listeners that need UDP (WireGuard, HTTP/3, DNS) cannot be shared: the UDP side of a
  reverse https listener (HTTP/3) is not served, other UDP listeners need `--workers 1`.

With `--workers 1` (the default of `ttft-relay run`) it runs the single process (exec,
nothing in between). `scripts/relay` asks for `--workers auto`: one per core.

    ttft-relay run [--workers N|auto] [mitmdump arguments ...]
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mitmproxy import optmanager
from mitmproxy.proxy import mode_specs
from mitmproxy.utils import human

from . import capacity, config, launch, listeners, prefork
from .faults import addons as faults
from .patches import pins
from .patches.fixes import inherited_listeners
from .patches.speed import listen_backlog
from .observe import ledger, metrics
from .timing import addon as timing

from .prefork import LISTEN_FDS_ENV, SYSTEMD_FIRST_FD, split_workers

EXIT_START_FAILED = launch.EXIT_CONFIG
"""The relay could not start: the unit's RestartPreventExitStatus."""
READY_TIMEOUT = 60.0
RESTART_PAUSE = (1.0, 30.0)
"""Pause before restarting a dead worker: doubles from the first while it keeps dying
within a minute of its start, up to the second."""
STOP_MARGIN_S = 4.0


def stop_timeout(grace: float) -> float:
    """How long a stop waits for the workers before it kills them: their grace
    (relay_shutdown_grace), the answers to the flows they cut, letting go of the
    listeners, and a margin to exit. The systemd unit's TimeoutStopSec is more."""
    return grace + faults.CUT_WAIT_S + listeners.DRAIN_S + STOP_MARGIN_S

TICK_S = 0.2
"""How often the supervisor looks after its workers."""


def free_port() -> int:
    """A loopback port free right now (tests and benchmarks start relays on one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[ttft-relay] {msg}", file=sys.stderr, flush=True)


# --- options ------------------------------------------------------------------------

SUPERVISOR_READS = (capacity.ListenBacklog, timing.Timing, metrics.Metrics, faults.Shutdown)
"""The addons whose options the supervisor reads (their `load` only declares them)."""


def worker_options(args: list[str]) -> tuple[list[str], optmanager.OptManager]:
    """The command line a worker runs (`args` with mitm.conf merged in, config.merged_args)
    and the options mitmdump makes of it, for the supervisor's own use."""
    merged = launch.relay_args(args)
    return merged, config.started_options(merged, [addon() for addon in SUPERVISOR_READS])


# --- listeners ----------------------------------------------------------------------


class StartFailed(Exception):
    """The supervisor stops here, with this message and `exit_code`."""

    def __init__(self, message: str, exit_code: int = EXIT_START_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Listener:
    """One of the relay's TCP listeners, bound by the supervisor (or passed by systemd),
    served by every worker."""

    mode: mode_specs.ProxyMode
    sockets: list[socket.socket]
    kept_open: bool = False
    """systemd holds the socket (socket activation): it stays open across a stop, and the
    connections it queues meanwhile wait for the next start instead of being refused."""

    @property
    def where(self) -> str:
        """What a client connects to, written as mitmproxy writes it."""
        return " and ".join(dict.fromkeys(human.format_address(s.getsockname()) for s in self.sockets))


def bind_listeners(opts: optmanager.OptManager, specs: list[str] | None = None,
                   activated: list[socket.socket] | None = None) -> list[Listener]:
    """Every listener of `opts.mode` (or of `specs`, some of them): on the sockets of
    `activated` (systemd's, taken out of that list) on its port, else bound here, not
    listening yet: the first worker that serves listens (`inherited_listeners`), so that
    a client connects once it is served, not into a queue while the relay starts."""
    out: list[Listener] = []
    try:
        for spec in opts.mode if specs is None else specs:
            try:
                mode = mode_specs.ProxyMode.parse(spec)
            except ValueError as e:  # in mitmproxy's words
                raise StartFailed(f"Invalid proxy mode specification: {spec} ({e})") from None
            port = mode.listen_port(opts.listen_port)
            if mode.transport_protocol == "udp" or port is None:
                raise StartFailed(f"listener {spec!r} cannot be shared by workers (UDP, or no address of its "
                                  f"own); run it with --workers 1")
            # The socket unit says where a port listens (ListenStream=8443: every interface).
            passed = [sock for sock in activated or [] if sock.getsockname()[1] == port]
            if passed:
                for sock in passed:
                    assert activated is not None
                    activated.remove(sock)
                out.append(Listener(mode, passed, kept_open=True))
                continue
            out.append(Listener(mode, bind_tcp(mode.listen_host(opts.listen_host), port)))
    except BaseException:
        for lst in out:
            if not lst.kept_open:
                for sock in lst.sockets:
                    sock.close()
        raise
    return out


def bind_tcp(host: str, port: int, backlog: int | None = None) -> list[socket.socket]:
    """Sockets for `host`:`port` as asyncio's `start_server` binds them (and so mitmproxy):
    one per address of `host`, "" meaning every interface, IPv4 and IPv6; SO_REUSEADDR;
    IPv6 sockets IPv6-only. Port 0: one free port for all of them. Listening with
    `backlog` if given; else bound only (a port another listener holds is refused all the
    same: SO_REUSEADDR binds over connections in TIME-WAIT, not over a listener)."""
    where = f"{host or '*'}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise StartFailed(f"cannot listen on {where}: {e}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL and len(infos) > 1:
                    sockets.pop().close()  # that address family is off here (asyncio skips it too)
                    continue
                if e.errno == errno.EADDRINUSE:
                    raise StartFailed(f"refusing to start: {where} is taken (another relay running?)") from None
                raise StartFailed(f"cannot listen on {where}: {e.strerror or e}") from None
            if backlog is not None:
                sock.listen(backlog)
        if not sockets:
            raise StartFailed(f"cannot listen on {where}: no address to bind")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def systemd_sockets() -> list[socket.socket]:
    """The listening sockets systemd passed this process (socket activation:
    deploy/ttft-relay.socket), none if it passed none. As sd_listen_fds(3) reads them:
    LISTEN_FDS sockets from descriptor 3 on, if LISTEN_PID is this process; the variables
    leave the environment, so that no child takes them for its own."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if pid != str(os.getpid()) or not count.isdigit():
        return []
    out = []
    for fd in range(SYSTEMD_FIRST_FD, SYSTEMD_FIRST_FD + int(count)):
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise StartFailed(f"systemd passed descriptor {fd}, which is not a listening TCP socket: the socket "
                              "unit's ListenStream= lines must be the relay's listener ports")
        out.append(sock)
    return out


# --- workers ----------------------------------------------------------------------


def worker_main(args: list[str]) -> None:
    """A worker: the relay as `ttft-relay run --workers 1` runs it, on the listening sockets
    its supervisor bound (named in the environment)."""
    given = prefork.listeners_given()
    if given is None:  # started before its supervisor read the options, which did not start
        sys.exit(0)
    listening = json.loads(given)
    inherited_listeners.install(listening["listeners"], int(os.environ.pop(prefork.READY_FD_ENV)),
                                kept_open=listening["kept_open"], backlog=listening["backlog"])
    # The supervisor says where the relay listens, once; N workers would say it N times.
    logging.getLogger("mitmproxy.proxy.mode_servers").setLevel(logging.WARNING)
    try:
        launch.start("mitmdump", args)
    except launch.CannotStart as e:
        sys.exit(e.say())


class Worker:
    """One worker process, started again when it dies."""

    def __init__(self, index: int, args: list[str], env: dict[str, str], listening: list[Listener],
                 backlog: int) -> None:
        self.index = index
        self.args = args
        listen_fds = {lst.mode.full_spec: [s.fileno() for s in lst.sockets] for lst in listening}
        kept_open = [lst.mode.full_spec for lst in listening if lst.kept_open]
        self.listening = json.dumps({"listeners": listen_fds, "kept_open": kept_open, "backlog": backlog})
        self.env = {**env, prefork.WORKER_ENV: str(index), LISTEN_FDS_ENV: self.listening}
        self.pass_fds = tuple(fd for fds in listen_fds.values() for fd in fds)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready = False
        """It accepts (it said so since it was last started)."""
        self.served = False
        """It was ready at least once."""
        self.died = False
        """It exited at least once (and is restarted)."""
        self.restart_at: float | None = None
        self.pause = RESTART_PAUSE[0]
        self._ready_pipe: int | None = None

    def start(self) -> None:
        self._close_pipe()  # the last start's
        self._started(prefork.spawn(self.args, self.env, self.pass_fds))

    def adopt(self, first: prefork.FirstWorker) -> bool:
        """Takes `first` (worker 0 started before the options were read) as this worker's
        start, and tells it its listeners; False if it cannot serve them (a listener on a
        socket systemd did not pass): it exits, and this worker starts as any other."""
        listeners_pipe = first.spawned.listeners_pipe
        if listeners_pipe is None or not set(self.pass_fds) <= set(first.fds):
            first.abandon()
            return False
        first.spawned.listeners_pipe = None
        try:
            os.write(listeners_pipe, self.listening.encode())  # a few hundred bytes: within the pipe's buffer
        except BrokenPipeError:
            pass  # it died starting: looked after as any worker that did
        finally:
            os.close(listeners_pipe)
        self._started(first.spawned)
        return True

    def _started(self, spawned: prefork.Spawned) -> None:
        self.proc = spawned.proc
        self._ready_pipe = spawned.ready_pipe
        self.started_at = time.monotonic()
        self.ready = False
        self.restart_at = None

    def became_ready(self) -> bool:
        """Whether it said it is ready since the last look (it says so once)."""
        if self._ready_pipe is None:
            return False
        try:
            said = os.read(self._ready_pipe, 1)
        except BlockingIOError:
            return False
        self._close_pipe()  # said, or it exited without saying
        if said:
            self.ready = self.served = True
        return bool(said)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def signal(self, signum: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signum)

    def _close_pipe(self) -> None:
        if self._ready_pipe is not None:
            os.close(self._ready_pipe)
            self._ready_pipe = None

    def close(self) -> None:
        self._close_pipe()


class Supervisor:
    """Starts the workers, restarts any that dies, replaces them all on a reload (SIGHUP),
    and stops them (SIGINT, SIGTERM)."""

    def __init__(self, user_args: list[str], workers: int, first: prefork.FirstWorker | None = None) -> None:
        if (why := pins.problem(inherited_listeners)) is not None:
            raise StartFailed(f"--workers {workers} needs the relay's fix inherited_listeners, and {why}: run it "
                              f"with --workers 1, or install the mitmproxy it was written against: {pins.INSTALL}")
        self.user_args = user_args
        self.count = workers
        _, self.opts = worker_options(user_args)
        self.activated = systemd_sockets()
        """systemd's sockets no listener took (yet: a reload may name their port)."""
        self.listeners = bind_listeners(self.opts, activated=self.activated)
        for sock in self.activated:
            log(f"systemd passed a socket at {human.format_address(sock.getsockname())}, a port no listener of "
                "the relay names: nothing serves it")
        self.metrics_dir = Path(first.metrics_dir if first else tempfile.mkdtemp(prefix="ttft-relay-metrics-"))
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        self.args = prefork.worker_args(user_args)
        self.workers: list[Worker] = []
        self.retiring: list[Worker] = []
        """Workers a reload replaced, finishing their turns in flight."""
        self.workers = self._generation(self.listeners)
        self.incoming: list[Worker] = []
        """A reload's workers, starting; they replace `workers` once all are ready."""
        self.reloaded: tuple[list[Listener], optmanager.OptManager] | None = None
        """The listeners and options `incoming` start with."""
        self.unused: list[Listener] = []
        """Listeners a reload dropped: closed once the workers that served them are gone."""
        self.pid_file = pid_file(self.opts)
        self.stopping = False
        self.reload_asked = False
        self.serving = False
        """Start-up is over: every worker was ready once, or died trying."""
        self.first = first
        """Worker 0 if it started before the options were read (prefork.first_worker); `run` adopts it."""

    def _generation(self, listening: list[Listener]) -> list[Worker]:
        """`count` workers on `listening`, each with an index no live worker has (a worker's
        index names its in-flight ledger, which its process holds locked)."""
        taken = {w.index for w in [*self.workers, *self.retiring]}
        indices = [i for i in range(self.count + len(taken)) if i not in taken][: self.count]
        backlog = self.opts.relay_listen_backlog or listen_backlog.ASYNCIO_DEFAULT_BACKLOG
        return [Worker(i, self.args, self.env, listening, backlog) for i in indices]

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGHUP, self._reload)
        try:
            self.pid_file.write_text(f"{os.getpid()}\n")
        except OSError as e:  # `ttft-relay reload` cannot find it; a SIGHUP still reloads
            log(f"cannot write {self.pid_file} ({e.strerror}): `ttft-relay reload` will not find this relay")
        try:
            self._serve_metrics()
            # Alone: a configuration error shows once, in its output.
            if self.first is None or not self.workers[0].adopt(self.first):
                self.workers[0].start()
            self.first = None
            while not self.stopping:
                for w in [*self.workers, *self.incoming]:
                    self._look_after(w)
                self._look_after_retiring()
                self._progress()
                # A tick, not a wake-up on each worker's pipe: workers killed together (the OOM
                # killer, an operator) are then seen dead together, whichever the kernel reaps first.
                time.sleep(TICK_S)
            return 0
        except StartFailed as e:
            log(str(e))
            return e.exit_code
        finally:
            self._shutdown()

    def _serve_metrics(self) -> None:
        if not (listen := self.opts.relay_metrics_listen):
            return
        try:
            registry = metrics.multiprocess_registry(self.metrics_dir)
            metrics.watch_learned(registry, self.opts.relay_timing_log)
            (host, port), _server = metrics.serve(listen, registry)
        except (OSError, ValueError) as e:
            # asyncio words a bind error at length: the system's words are enough.
            why = f"[Errno {e.errno}] {os.strerror(e.errno)}" if isinstance(e, OSError) and e.errno else e
            log(f"cannot serve metrics at {listen}: {why}; the relay runs without them. "
                f"{metrics.LISTEN_FIX}")
            return
        log(f"metrics of all workers at http://{host}:{port}/metrics")

    def _progress(self) -> None:
        """Start-up's steps (worker 0, then the others, then "N workers ready") and a reload's."""
        first = self.workers[0]
        if not self.serving:
            if not first.served:
                return
            rest = self.workers[1:]
            if any(w.proc is None for w in rest):
                for w in rest:
                    w.start()
                return
            if all(w.served or w.died for w in rest):
                self.serving = True
                for lst in self.listeners:
                    log(f"{lst.mode.description} listening at {lst.where}")
                log(self._ready_line())
            return
        if self.incoming and all(w.ready for w in self.incoming):
            self._take_over()
        elif self.incoming and all(w.ready for w in self.incoming if w.proc is not None):
            next(w for w in self.incoming if w.proc is None).start()
        elif self.reload_asked and not self.incoming:
            self.reload_asked = False
            self._begin_reload()

    def _ready_line(self) -> str:
        ready = [w for w in self.workers if w.ready]
        if len(ready) == len(self.workers):
            return f"{len(ready)} workers ready"
        down = ", ".join(str(w.index) for w in self.workers if not w.ready)
        return f"{len(ready)} of {len(self.workers)} workers ready (restarting {down})"

    def _begin_reload(self) -> None:
        """A reload: relay.conf and the command line read again, new workers started on the
        listeners they name (the same sockets where an address stays); once all are ready they
        take over (`_take_over`), and the ones before them finish their turns."""
        try:
            _, opts = worker_options(self.user_args)
            kept, new = self._listeners_for(opts)
        except (SystemExit, Exception) as e:  # a config that cannot be read or bound: it says why
            log(f"reload refused, the workers keep serving as they were: {getattr(e, 'reason', e)}")
            return
        if opts.relay_metrics_listen != self.opts.relay_metrics_listen:
            log("reload: relay_metrics_listen changes on a restart, not a reload")
        for lst in new:
            log(f"reload: {lst.mode.description} listening at {lst.where}")
        self.reloaded = (kept + new, opts)
        self.incoming = self._generation(kept + new)
        log(f"reload: starting {len(self.incoming)} workers with the configuration read again")
        # One at a time: a worker's start takes a core for a second or two, which the
        # workers serving meanwhile need (all at once: first token p50 x10 during a reload).
        self.incoming[0].start()

    def _take_over(self) -> None:
        assert self.reloaded is not None
        for w in self.workers:
            # A ready worker finishes its turns; one not ready has none (nor a handler yet).
            w.signal(listeners.RETIRE_SIGNAL if w.ready else signal.SIGKILL)
        self.retiring += self.workers
        self.workers, self.incoming = self.incoming, []
        listening, self.opts = self.reloaded
        self.reloaded = None
        still = {id(lst.sockets) for lst in listening}
        dropped = [lst for lst in self.listeners if id(lst.sockets) not in still]
        for lst in dropped:  # nobody accepts there any more: no new connection waits in vain
            for sock in lst.sockets if not lst.kept_open else ():  # systemd's: queued for the next start
                listeners.refuse_handshakes(sock.fileno())
        self.unused += dropped
        self.listeners = listening
        log(f"reloaded: {self._ready_line()}; the {len(self.retiring)} before them finish their turns in flight")

    def _abandon_reload(self, why: str) -> None:
        for w in self.incoming:
            w.signal(signal.SIGKILL)
            if w.proc is not None:
                w.proc.wait()
            w.close()
        self.incoming = []
        if self.reloaded is not None:
            current = {id(lst.sockets) for lst in self.listeners}
            for lst in self.reloaded[0]:
                if id(lst.sockets) in current:
                    continue
                if lst.kept_open:  # systemd's: a later reload may name its port again
                    self.activated += lst.sockets
                    continue
                for sock in lst.sockets:
                    sock.close()
            self.reloaded = None
        log(f"reload failed: {why}; the workers keep serving as they were")

    def _listeners_for(self, opts: optmanager.OptManager) -> tuple[list[Listener], list[Listener]]:
        """The listeners `opts` names: (those on an address bound already, its sockets kept
        whatever the mode there now, those bound now)."""
        bound = {self._address(lst.mode, self.opts): lst for lst in self.listeners}
        kept, specs = [], []
        for spec in opts.mode:
            mode = mode_specs.ProxyMode.parse(spec)
            if (lst := bound.get(self._address(mode, opts))) is not None:
                kept.append(Listener(mode, lst.sockets, lst.kept_open))
            else:
                specs.append(spec)
        return kept, bind_listeners(opts, specs, self.activated)

    @staticmethod
    def _address(mode: mode_specs.ProxyMode, opts: optmanager.OptManager) -> tuple[str, int | None]:
        return mode.listen_host(opts.listen_host), mode.listen_port(opts.listen_port)

    def _look_after(self, w: Worker) -> None:
        now = time.monotonic()
        if w.proc is None:
            return
        if w.restart_at is None and w.exited():
            code = w.proc.returncode
            w.became_ready()  # whether it said so before it died
            w.close()
            lost = metrics.in_flight_of(w.proc.pid, self.metrics_dir)
            metrics.forget_process(w.proc.pid, self.metrics_dir)
            # Exited on its own before it was ready: its configuration (or a resource it
            # names) does not serve. Killed (a signal: the OOM killer, an operator) it is
            # restarted like any worker that died, start-up included.
            failed_start = not w.ready and code > 0
            if failed_start and not self.serving and not any(o.served for o in self.workers):
                raise StartFailed(f"worker {w.index} exited ({code}) before it was ready, see its output above; "
                                  "stopping")
            if failed_start and w in self.incoming:
                self._abandon_reload(f"worker {w.index} exited ({code}) before it was ready, see its output above")
                return
            w.ready = False
            w.died = True
            w.pause = RESTART_PAUSE[0] if now - w.started_at > 60 else min(w.pause * 2, RESTART_PAUSE[1])
            w.restart_at = now + w.pause
            if failed_start:
                log(f"worker {w.index} exited ({code}) before it was ready again, see its output above; "
                    f"next try in {w.pause:.0f} s")
                return
            recorded = ("the restarted worker records them as lost" if self.opts.relay_timing_log
                        else "no record of them")
            in_flight = (f" with {lost} request(s) in flight ({recorded}; their clients saw the connection "
                         f"reset)") if lost else ""
            others = "the others serve" if any(o.ready for o in self.workers) else "no worker serves meanwhile"
            log(f"worker {w.index} exited ({code}){in_flight}; {others}, restarting it in {w.pause:.0f} s")
        elif w.restart_at is not None and now >= w.restart_at:
            w.start()
        elif w.became_ready():
            if w.died:
                log(f"worker {w.index} ready again")
        elif not w.ready and w.restart_at is None and now - w.started_at > READY_TIMEOUT:
            log(f"worker {w.index} was not ready within {READY_TIMEOUT:.0f} s; killing it")
            w.signal(signal.SIGKILL)

    def _look_after_retiring(self) -> None:
        for w in list(self.retiring):
            if w.exited():
                assert w.proc is not None
                metrics.forget_process(w.proc.pid, self.metrics_dir)
                w.close()
                self.retiring.remove(w)
                log(f"worker {w.index} (before the reload) finished its turns and exited ({w.proc.returncode})")
        if not self.retiring and self.unused:
            for lst in self.unused:
                for sock in lst.sockets:
                    sock.close()
            self.unused = []

    def _all_listeners(self) -> list[Listener]:
        return [*self.listeners, *self.unused, *(self.reloaded[0] if self.reloaded else [])]

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _reload(self, signum, frame) -> None:
        self.reload_asked = True  # done by the main loop, once start-up is over

    def _record_what_the_dead_left(self) -> None:
        """Before a stop: a worker that died and whose replacement is not running yet (its
        restart pause) left requests in its ledger that only the replacement records. It
        starts now, records them, and stops with the others."""
        if not (self.serving and self.opts.relay_timing_log):
            return
        timing_log = Path(self.opts.relay_timing_log)
        left = [w for w in self.workers
                if (w.exited() or not w.ready) and ledger.left_in(ledger.ledger_path(timing_log, w.index))]
        for w in left:
            log(f"worker {w.index} starts once more before the stop, to record the requests its last run "
                "left in flight")
            if w.exited():  # else it is starting already
                w.start()
        deadline = time.monotonic() + READY_TIMEOUT
        while left and time.monotonic() < deadline:
            left = [w for w in left if not w.became_ready() and not w.exited()]
            time.sleep(TICK_S)

    def _shutdown(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # No new connection from here on; what the kernel queued is served (listeners.py). On
        # systemd's sockets the connections queue for the next start (a restart): none refused.
        refusing = [sock for lst in self._all_listeners() if not lst.kept_open for sock in lst.sockets]
        for sock in refusing:
            listeners.refuse_handshakes(sock.fileno())
        self._record_what_the_dead_left()
        everyone = [*self.workers, *self.incoming, *self.retiring]
        # Each worker answers its flows in flight ("relay shutting down") and records them.
        for w in everyone:
            w.signal(signal.SIGINT)  # as Ctrl-C: done hooks run, logs are flushed
        # The workers accept what the kernel queued, then let go: the supervisor's copies too,
        # so that the sockets close (connections refused, not left waiting) while they finish.
        fds = [sock.fileno() for sock in refusing if sock.fileno() >= 0]
        deadline = time.monotonic() + listeners.DRAIN_S
        while any(listeners.queued(fd) for fd in fds) and time.monotonic() < deadline:
            time.sleep(listeners.POLL_S)
        for lst in self._all_listeners():
            for sock in lst.sockets:
                sock.close()
        deadline = time.monotonic() + stop_timeout(self.opts.relay_shutdown_grace)
        for w in everyone:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.close()
        for lst in self._all_listeners():
            for sock in lst.sockets:
                sock.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        try:
            if self.pid_file.read_text().strip() == str(os.getpid()):
                self.pid_file.unlink()
        except OSError:
            pass


def pid_file(opts: optmanager.OptManager) -> Path:
    """Where a supervisor writes its pid for `ttft-relay reload`: in the relay's confdir,
    named by its first listener's port (two relays may share a confdir, not a port)."""
    first = mode_specs.ProxyMode.parse(opts.mode[0]) if opts.mode else None
    port = first.listen_port(opts.listen_port) if first is not None else opts.listen_port
    return Path(os.path.expanduser(opts.confdir)) / f"ttft-relay-{port}.pid"


def reload_main(argv: list[str]) -> int:
    """`ttft-relay reload [the run's arguments]`: SIGHUP to the supervisor that runs with them."""
    _, args, _ = split_workers(argv)
    _, opts = worker_options(args)
    path = pid_file(opts)
    try:
        pid = int(path.read_text())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError) as e:
        why = "no such process (a relay that was killed left it)" if isinstance(e, ProcessLookupError) else (
            f"cannot read {path}" if not isinstance(e, PermissionError) else f"not allowed to signal it ({path})")
        log(f"reload: no relay to reload: {why}. `ttft-relay reload` reaches a relay started by scripts/relay "
            "or `ttft-relay run --workers N|auto`, given the same options (the same confdir and first "
            "listener); under systemd: sudo systemctl reload ttft-relay")
        return 1
    log(f"reload: asked the relay (pid {pid}); its output says when the new workers have taken over")
    return 0


def main(argv: list[str], first: prefork.FirstWorker | None = None) -> int:
    """`ttft-relay run [--workers N|auto] ...`; `first`: worker 0 if cli.py started it
    already (`prefork.first_worker`)."""
    workers, args, supervised = split_workers(argv)
    if not supervised:
        launch.start("mitmdump", args)
    try:
        supervisor = Supervisor(args, workers, first)
    except BaseException as e:  # StartFailed, a configuration that cannot be read (launch.CannotStart)
        if first is not None:
            first.abandon()
            shutil.rmtree(first.metrics_dir, ignore_errors=True)  # the supervisor that would own it never ran
        if not isinstance(e, StartFailed):
            raise
        log(str(e))
        return e.exit_code
    return supervisor.run()


if __name__ == "__main__":
    worker_main(sys.argv[1:])
