"""`FarLink`: a real far (and lossy) network link for tests, in userspace.

tc netem is not available here, and a TCP forwarder (`forwarder.DelayingForwarder`)
does not make a far link: it terminates TCP, so each side's kernel measures the
round trip to the forwarder (microseconds) and never retransmits. This link works one
layer down. Two fresh network namespaces, `near` and `far`, each get a TUN device
(point-to-point, NEAR_IP <-> FAR_IP); a small forwarder process copies every IP packet
from one TUN to the other, holding it `delay_ms` in its direction and dropping a
`loss` fraction of them. The kernels on both ends see a real round trip (the TCP
handshake included) and retransmit what was lost, exactly as over a far network.

    with FarLink(delay_ms=75, loss=0.02) as link:          # 150 ms round trip, 2 % loss each way
        relay = MitmdumpProcess(...); link.far.adopt(relay.args)   # a process in a namespace
        with link.near.entered():                           # sockets this thread makes are near's
            sock = socket.create_connection((link.far.ip, port))

- `Side.adopt(argv)` prefixes a command with `nsenter --net=...`, so a subprocess (and its
  children: HAProxy, workers) runs in that namespace;
- `Side.entered()` moves the calling thread into the namespace for a `with` block
  (`setns` is per thread); a socket, or a thread started inside (an in-process fake
  upstream's loop), stays there;
- each namespace has its own loopback (up), so a relay and a fake upstream in `far`
  talk over `far`'s 127.0.0.1 while the client crosses the link;
- `jitter_ms` adds up to that much delay to each packet, drawn at random (packets stay in
  order: one held longer holds those behind it, as on a real queue);
- `set(direction, delay_ms=..., loss=...)` changes a direction while the link runs;
- `route(side, initcwnd=..., initrwnd=...)` gives a side's route to the other end those
  metrics (the initial congestion / receive window of its new connections, in segments);
- `forget()` black-holes every TCP connection the link has carried so far, both ways, from
  now on (as a NAT or firewall that lost its connection table: no reset, no answer), while
  new connections pass;
- `drops()` lists the packets the link dropped (when, which way, TCP ports, flags,
  payload length), so a test can hold each loss against the record it belongs to.

Namespaces are named `ttftlink-<pid>-<n>-near|far` (unique per run, so parallel test
runs never meet), and `close()` (the context's exit) stops the forwarder, ends every
process still in them and deletes them, whatever the test did. The forwarder dies
with the process that made it (PR_SET_PDEATHSIG); namespaces left by a killed run
(their pid is gone) are deleted by the next `FarLink`. `unavailable()` says why a
link cannot be built here (not Linux, not root, no /dev/net/tun, no `ip`/`nsenter`),
for a skip that names the reason.

The forwarder is `python -m ttft_relay.testing.fakes.link` (`forward()`): one process, one poll
loop over the two TUN descriptors, a FIFO per direction (a constant delay keeps
packets in order; drops are independent per packet, from a seeded generator per
direction, so the n-th packet each way is dropped or not whatever the other way
does; the jitter has generators of its own). Its commands on stdin: `set near|far
DELAY_MS LOSS`, `forget` and `stats`, each answered `ok ...`. It writes every drop to a
log the test reads (`drops()`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/run/netns")
PREFIX = "ttftlink"
NEAR_IP, FAR_IP = "10.200.0.1", "10.200.0.2"
"""Private to the two namespaces: every link has them, as no two links share a namespace."""
TUN_NAME = "ttftlink0"
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
NEAR, FAR = "near", "far"
"""Directions are named by the side a packet goes to."""
_counter = itertools.count(1)


def unavailable() -> str | None:
    """Why a link cannot be built on this machine, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces and TUN devices are Linux's"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "/dev/net/tun is missing or not usable"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    if not hasattr(os, "setns"):
        return "os.setns needs Python 3.12+"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Drop:
    """A packet the link dropped."""

    at: float
    """`time.time()` when the forwarder dropped it."""
    to: str
    """NEAR or FAR: the side it was going to."""
    sport: int
    dport: int
    flags: str
    """TCP flags as letters (F S R P A); empty for a packet that is not IPv4 TCP."""
    length: int
    """TCP payload bytes."""


class Side:
    """One namespace of a link: its name, its address on the link."""

    def __init__(self, name: str, ip: str) -> None:
        self.name = name
        self.ip = ip
        self.path = NETNS_DIR / name

    def adopt(self, argv: list[str]) -> list[str]:
        """`argv` run inside this namespace (its network only; the filesystem is the host's)."""
        return ["nsenter", f"--net={self.path}", *argv]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread in this namespace for the block: sockets it makes, and threads it
        starts, belong to it (and stay there after the block)."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(self.path, os.O_RDONLY)
        try:
            os.setns(target, CLONE_NEWNET)
            try:
                yield
            finally:
                os.setns(home, CLONE_NEWNET)
        finally:
            os.close(target)
            os.close(home)

    def pids(self) -> list[int]:
        """Processes in this namespace now."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def __repr__(self) -> str:
        return f"Side({self.name!r}, {self.ip})"


class FarLink:
    """Two namespaces joined by a delaying, lossy packet forwarder (see the module docstring).

    `delay_ms` and `loss` apply to each direction; `far_delay_ms`/`far_loss` (towards
    `far`) and `near_delay_ms`/`near_loss` (towards `near`) set one direction apart.
    `jitter_ms`: each packet is held up to that much longer, at random, both ways.
    `seed` makes the drops and the jitter repeatable.
    """

    def __init__(self, delay_ms: float = 0.0, loss: float = 0.0, *, far_delay_ms: float | None = None,
                 near_delay_ms: float | None = None, far_loss: float | None = None,
                 near_loss: float | None = None, jitter_ms: float = 0.0, seed: int = 1) -> None:
        stem = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.near = Side(f"{stem}-near", NEAR_IP)
        self.far = Side(f"{stem}-far", FAR_IP)
        self.shape = {
            FAR: (delay_ms if far_delay_ms is None else far_delay_ms, loss if far_loss is None else far_loss),
            NEAR: (delay_ms if near_delay_ms is None else near_delay_ms, loss if near_loss is None else near_loss),
        }
        self.jitter_ms = jitter_ms
        self.seed = seed
        self.forwarder: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._drop_log = Path(tempfile.mkstemp(prefix=f"{stem}-drops-")[1])

    def start(self) -> FarLink:
        if (reason := unavailable()) is not None:
            raise RuntimeError(f"cannot build a link: {reason}")
        remove_stale()
        try:
            for side in (self.near, self.far):
                _ip("netns", "add", side.name)
                _ip("-n", side.name, "link", "set", "lo", "up")
            (far_ms, far_loss), (near_ms, near_loss) = self.shape[FAR], self.shape[NEAR]
            self.forwarder = subprocess.Popen(
                [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "ttft_relay.testing.fakes.link", str(self.near.path),
                 str(self.far.path), f"{far_ms}", f"{far_loss}", f"{near_ms}", f"{near_loss}", str(self.seed),
                 str(self._drop_log), f"{self.jitter_ms}"],
                cwd=Path(__file__).resolve().parents[3], stdin=subprocess.PIPE,  # beside the package: -m finds this copy
                stdout=subprocess.PIPE, text=True)
            assert self.forwarder.stdout is not None
            if (line := self.forwarder.stdout.readline().strip()) != "ready":
                raise RuntimeError(f"link forwarder did not start: {line!r}")
            for side, peer in ((self.near, self.far), (self.far, self.near)):
                _ip("-n", side.name, "addr", "add", side.ip, "peer", peer.ip, "dev", TUN_NAME)
                _ip("-n", side.name, "link", "set", TUN_NAME, "up")
        except BaseException:
            self.close()
            raise
        return self

    def set(self, direction: str, *, delay_ms: float | None = None, loss: float | None = None) -> None:
        """Change one direction (NEAR: packets to `near`, FAR: to `far`) while the link runs."""
        old_ms, old_loss = self.shape[direction]
        self.shape[direction] = (old_ms if delay_ms is None else delay_ms, old_loss if loss is None else loss)
        self._command(f"set {direction} {self.shape[direction][0]} {self.shape[direction][1]}")

    def route(self, side: Side, **metrics: int) -> None:
        """The route from `side` to the other end with these metrics (`initcwnd=`, `initrwnd=`:
        segments), as `ip route change` sets them on a VPS's route; none: the kernel's defaults."""
        peer = self.far if side is self.near else self.near
        _ip("-n", side.name, "route", "replace", peer.ip, "dev", TUN_NAME, "proto", "kernel", "scope", "link",
            "src", side.ip, *(str(word) for name, value in metrics.items() for word in (name, value)))

    def forget(self) -> None:
        """Drop every packet of the TCP connections seen so far, from now on (new ones pass)."""
        self._command("forget")

    def stats(self) -> dict[str, dict[str, int]]:
        """Packets per direction so far: {NEAR|FAR: {"passed": n, "dropped": n}}."""
        reply = self._command("stats")
        numbers = [int(n) for n in reply.split()[1:]]
        return {FAR: {"passed": numbers[0], "dropped": numbers[1]},
                NEAR: {"passed": numbers[2], "dropped": numbers[3]}}

    def drops(self) -> list[Drop]:
        """Every packet dropped so far, oldest first."""
        found = []
        for line in self._drop_log.read_text().splitlines():
            at, to, sport, dport, flags, length = line.split()
            found.append(Drop(float(at), to, int(sport), int(dport), flags.strip("-"), int(length)))
        return found

    def _command(self, line: str) -> str:
        assert self.forwarder is not None and self.forwarder.stdin and self.forwarder.stdout
        with self._lock:
            self.forwarder.stdin.write(line + "\n")
            self.forwarder.stdin.flush()
            reply = self.forwarder.stdout.readline().strip()
        if not reply.startswith("ok"):
            raise RuntimeError(f"link forwarder: {line!r} -> {reply!r}")
        return reply

    def close(self) -> None:
        """Stop the forwarder, end whatever still runs in the namespaces, delete them."""
        if self.forwarder is not None:
            self.forwarder.kill()
            self.forwarder.wait(10)
            for stream in (self.forwarder.stdin, self.forwarder.stdout):
                if stream is not None:
                    stream.close()
            self.forwarder = None
        for side in (self.near, self.far):
            _delete(side.name)
        self._drop_log.unlink(missing_ok=True)

    def __enter__(self) -> FarLink:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _delete(name: str) -> None:
    """End every process in namespace `name` (a test's relay, its workers) and delete it."""
    if not (NETNS_DIR / name).exists():
        return
    side = Side(name, "")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = side.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while (pids := side.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for processes told to exit
        if not pids:
            break
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


_STALE = re.compile(rf"^{PREFIX}-(\d+)-\d+-(?:near|far)$")


def remove_stale() -> None:
    """Delete the namespaces of links whose test process is gone (killed before its cleanup)."""
    if not NETNS_DIR.is_dir():
        return
    for entry in NETNS_DIR.iterdir():
        if (m := _STALE.match(entry.name)) and not Path(f"/proc/{m.group(1)}").exists():
            _delete(entry.name)


# --- the forwarder process ------------------------------------------------------------


def _open_tun(netns: str) -> int:
    """A TUN device TUN_NAME made inside namespace `netns` (this thread returns home after)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns, os.O_RDONLY)
    try:
        os.setns(target, CLONE_NEWNET)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", TUN_NAME.encode(), IFF_TUN | IFF_NO_PI))
        return fd
    finally:
        os.setns(home, CLONE_NEWNET)
        os.close(target)
        os.close(home)


def tcp_ports(packet: bytes) -> frozenset[int] | None:
    """An IPv4 TCP packet's connection as its two ports (the link joins two addresses only); None otherwise."""
    if len(packet) < 40 or packet[0] >> 4 != 4 or packet[9] != 6:
        return None
    return frozenset(struct.unpack_from("!HH", packet, (packet[0] & 0xF) * 4))


def describe(packet: bytes) -> str:
    """An IPv4 TCP packet as a drop log's fields: source and destination port, flags, payload length."""
    if len(packet) < 40 or packet[0] >> 4 != 4 or packet[9] != 6:
        return f"0 0 - {len(packet)}"
    ihl = (packet[0] & 0xF) * 4
    sport, dport = struct.unpack_from("!HH", packet, ihl)
    offset, flags = packet[ihl + 12] >> 4, packet[ihl + 13]
    names = "".join(c for bit, c in zip((1, 2, 4, 8, 16), "FSRPA") if flags & bit) or "-"
    return f"{sport} {dport} {names} {len(packet) - ihl - offset * 4}"


def forward(near_ns: str, far_ns: str, shape: dict[str, list[float]], seed: int, drop_log: str,
            jitter_ms: float = 0.0) -> None:
    """Copy packets between the two namespaces' TUN devices, delayed (plus up to `jitter_ms`)
    and dropped per direction."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the test process
    with contextlib.suppress(PermissionError):
        os.nice(-10)  # a link's delay is its own, not the scheduler's on a loaded machine
    near_fd, far_fd = _open_tun(near_ns), _open_tun(far_ns)
    rngs = {FAR: random.Random(seed), NEAR: random.Random(seed + 1)}
    """One per direction: the n-th packet each way is dropped or not whatever the other way does."""
    jitters = {FAR: random.Random(-seed), NEAR: random.Random(-seed - 1)}
    # direction -> (queue of (due, packet), fd it goes out on); counted passed / dropped.
    queues: dict[str, deque[tuple[float, bytes]]] = {FAR: deque(), NEAR: deque()}
    out = {FAR: far_fd, NEAR: near_fd}
    source = {near_fd: FAR, far_fd: NEAR}
    counts = {FAR: [0, 0], NEAR: [0, 0]}
    seen: set[frozenset[int]] = set()
    forgotten: set[frozenset[int]] = set()
    """The connections `forget` black-holed."""
    drops = open(drop_log, "a")
    poller = select.poll()
    for fd in (near_fd, far_fd, sys.stdin.fileno()):
        poller.register(fd, select.POLLIN)
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        for direction, queue in queues.items():
            while queue and queue[0][0] <= now:
                _, packet = queue.popleft()
                with contextlib.suppress(OSError):  # the device gone or full: the packet is lost
                    os.write(out[direction], packet)
        dues = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, (min(dues) - time.monotonic()) * 1000) if dues else None
        for fd, _ in poller.poll(timeout):
            if fd == sys.stdin.fileno():
                command = sys.stdin.readline().split()
                if not command:
                    return  # stdin closed: the test is done with the link
                if command[0] == "set":
                    shape[command[1]] = [float(command[2]), float(command[3])]
                    print("ok", flush=True)
                elif command[0] == "forget":
                    forgotten |= seen
                    print("ok", flush=True)
                elif command[0] == "stats":
                    print("ok", *counts[FAR], *counts[NEAR], flush=True)
                else:
                    print(f"unknown command {command[0]}", flush=True)
                continue
            direction = source[fd]
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                delay_ms, loss = shape[direction]
                ports = tcp_ports(packet)
                if ports is not None:
                    seen.add(ports)
                if ports in forgotten or (loss and rngs[direction].random() < loss):
                    counts[direction][1] += 1
                    print(f"{time.time():.6f} {direction} {describe(packet)}", file=drops, flush=True)
                    continue
                counts[direction][0] += 1
                if jitter_ms:
                    delay_ms += jitters[direction].uniform(0.0, jitter_ms)
                # In order: the queue releases a packet only after every one before it.
                queues[direction].append((time.monotonic() + delay_ms / 1000, packet))


def main(argv: list[str]) -> None:
    near_ns, far_ns, far_ms, far_loss, near_ms, near_loss, seed, drop_log, jitter_ms = argv
    forward(near_ns, far_ns, {FAR: [float(far_ms), float(far_loss)], NEAR: [float(near_ms), float(near_loss)]},
            int(seed), drop_log, float(jitter_ms))


if __name__ == "__main__":
    main(sys.argv[1:])
