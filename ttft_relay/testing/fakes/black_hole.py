"""An address that answers no SYN, and a process that resolves names as a test says.

A dead IPv6 route (a VPS whose IPv6 is broken, a provider's address that drops
everything) neither refuses nor answers: the connect hangs while the kernel retries its
SYN. `BlackHole` makes one on loopback, for real: a listener whose accept queue is full
drops every further SYN (Linux, and gVisor, do not refuse then). `with_hosts` runs a
command in a mount namespace of its own whose /etc/hosts is the given file (root and
unshare(1)), so an upstream name can resolve to a black-holed [::1] and a live 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path


class BlackHole(contextlib.AbstractContextManager):
    """A listener on (`host`, `port`: 0 for any free one) whose queue is full: `port` says where."""

    def __init__(self, family: int, host: str, port: int = 0, fill: int = 8) -> None:
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET6:
            self.listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        self.listener.bind((host, port))
        self.listener.listen(0)
        self.port: int = self.listener.getsockname()[1]
        self.fillers = []
        for _ in range(fill):  # more than the queue holds: the rest of their SYNs go unanswered too
            filler = socket.socket(family, socket.SOCK_STREAM)
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect((host, self.port))
            self.fillers.append(filler)

    def close(self) -> None:
        for s in (self.listener, *self.fillers):
            s.close()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def hosts_file(path: Path, names: dict[str, list[str]]) -> Path:
    """`path` written as an /etc/hosts naming each of `names` with its addresses, in order."""
    lines = ["127.0.0.1 localhost"] + [f"{address} {name}" for name, addresses in names.items() for address in addresses]
    path.write_text("\n".join(lines) + "\n")
    return path


def with_hosts(hosts: Path, argv: list[str]) -> list[str]:
    """`argv` run with `hosts` as its /etc/hosts (a mount namespace of its own; root and unshare(1))."""
    return ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]
