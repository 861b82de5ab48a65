"""Socket activation as systemd does it, for tests and benchmarks: the caller holds the
listening sockets (systemd's socket unit), and each start of the relay gets them as
sd_listen_fds(3) reads them (from descriptor 3 on, LISTEN_FDS counting them,
LISTEN_PID naming the process they are for). A restart is a stop of one process and a
start of the next on the same sockets: the port never closes in between.

    command(sockets, [argv...]) -> (argv of this launcher, the descriptors to pass)

Run as a program, `python -m ttft_relay.testing.socket_activation FD... -- ARGV...`: moves
the descriptors FD... to 3, 4, ..., sets LISTEN_FDS and LISTEN_PID (this process, whose
pid the exec keeps) and execs ARGV.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Sequence

FIRST_FD = 3


def command(sockets: Sequence[socket.socket], argv: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
    """The argv that runs `argv` with `sockets` passed as systemd passes them, and the
    descriptors subprocess must pass to it (`pass_fds`)."""
    fds = tuple(sock.fileno() for sock in sockets)
    return [sys.executable, "-m", __name__, *map(str, fds), "--", *argv], fds


def main(args: list[str]) -> None:
    split = args.index("--")
    fds, argv = [int(fd) for fd in args[:split]], args[split + 1:]
    # Out of the way first (above every target): a descriptor may sit where another one goes.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, FIRST_FD + len(fds)) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in enumerate(moved, FIRST_FD):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    os.environ.update(LISTEN_FDS=str(len(fds)), LISTEN_PID=str(os.getpid()))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
