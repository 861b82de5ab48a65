"""Dialling an upstream: every address of its name raced as RFC 8305 (Happy Eyeballs v2) says.

A VPS's upstream name often has an IPv6 address that goes nowhere (the provider's or the
VPS's IPv6 broken, its packets dropped) beside a working IPv4 one. Tried in order, as
asyncio's `open_connection` does by default, the first address holds the connect until the
kernel gives up (minutes) or the relay's connect deadline fails the request, and every
request to that name waits for it. Here the name's addresses are tried as RFC 8305 says:
resolved once, the families interleaved (the resolver's first family first), a new attempt
started every `delay` seconds, or at once when the one before it failed, the first to connect
wins and the others are closed. A black-holed IPv6 address then costs `delay` (250 ms, the
RFC's recommended value), not the request.

A name whose first address lost a race has the winner tried first on its next dials, for
`PREFER_S` (RFC 8305 §4 lets historical data order the attempts): a broken IPv6 address costs
the first new connection its `delay`, not every one.

What each dial tried is kept (`Dial`): the address it used and, for each that failed or was
overtaken, why. The relay's record shows it (`upstream_dial`), so an operator sees which
family the relay used and which address is broken, and the connect's time stays in the
`upstream_connect` phase, where it went.

The dial is asyncio and sockets only; `HappyEyeballs`, the addon below, sends mitmproxy's
upstream connects through it (`patches/fixes/happy_eyeballs.py`), and keeps what each tried
for the record. The upstream pool dials through it too (`upstream_pool.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import functools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import connection, ctx, exceptions
from mitmproxy.proxy import server_hooks

from .patches import pins
from .patches.fixes import happy_eyeballs

logger = logging.getLogger(__name__)

ATTEMPT_DELAY_S = 0.25
"""RFC 8305's recommended Connection Attempt Delay."""

PREFER_S = 600.0
"""How long an address that won a race over the name's first one is tried first."""
PREFER_MAX = 1024
"""Names remembered so at most (the oldest forgotten first)."""

Address = tuple[Any, ...]
"""A socket address as getaddrinfo gives it: (host, port) or (host, port, flowinfo, scope_id)."""

_preferred: dict[tuple[str, int], tuple[tuple[int, Address], float]] = {}
"""(host, port) → (the candidate that won over the name's first address, until when it is tried first)."""


@dataclass(slots=True)
class Dial:
    """What one dial did: the address it connected to (None: none answered), and why each
    other address it tried did not serve (`address: reason`, in the order tried)."""

    used: str | None = None
    family: str | None = None
    failed: list[str] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        return {"address": self.used, "family": self.family, "failed": list(self.failed)}


last_dial: contextvars.ContextVar[Dial | None] = contextvars.ContextVar("last_dial", default=None)
"""The latest dial of the task that made it: mitmproxy runs an upstream connect and its
`server_connected` / `server_connect_error` hooks in one task, so those hooks read here what
the connect they follow tried."""


def address_text(address: Address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def family_name(family: int) -> str:
    return "ipv6" if family == socket.AF_INET6 else "ipv4" if family == socket.AF_INET else str(family)


def interleave(infos: Sequence[tuple[Any, ...]]) -> list[tuple[int, Address]]:
    """getaddrinfo's answers as RFC 8305 §4 orders the attempts: the first answer's family
    first, then the families alternating, each in the resolver's order; duplicates once."""
    seen: set[tuple[int, Address]] = set()
    by_family: dict[int, list[tuple[int, Address]]] = {}
    for family, _type, _proto, _name, address in infos:
        entry = (family, tuple(address))
        if entry not in seen:
            seen.add(entry)
            by_family.setdefault(family, []).append(entry)
    queues = list(by_family.values())
    ordered: list[tuple[int, Address]] = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def _reason(error: BaseException) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "refused"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return str(error) or type(error).__name__


async def _connect(family: int, address: Address, local_addr: Address | None) -> socket.socket:
    # IPPROTO_TCP named, and TCP_NODELAY set: asyncio sets it on a transport's socket only when
    # the socket says it is TCP (its proto), and without it Nagle holds a request's later writes
    # until the upstream acknowledges the first (a delayed ACK: 40 ms on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        if local_addr is not None:
            sock.bind(local_addr)
        await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


async def race(candidates: Sequence[tuple[int, Address]], dial: Dial, delay: float = ATTEMPT_DELAY_S,
               ) -> socket.socket:
    """The first of `candidates` to connect, each started `delay` after the one before (or
    as soon as every attempt so far failed); `dial` says what was tried. When none connects,
    the OSError of the one address tried, or one naming each (the system's words, as asyncio
    says them). Cancelled (a deadline, the client gone): every attempt closed."""
    if not candidates:
        raise OSError("the name resolved to no address")
    queue = list(candidates)
    running: dict[asyncio.Task[socket.socket], tuple[int, Address, float]] = {}
    errors: list[BaseException] = []
    try:
        while queue or running:
            if queue:
                family, address = queue.pop(0)
                task = asyncio.ensure_future(_connect(family, address, None))
                running[task] = (family, address, time.monotonic())
            done, _ = await asyncio.wait(running, timeout=delay if queue else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            winner = None
            for task in done:
                family, address, _started = running.pop(task)
                if task.exception() is None and winner is None:
                    winner = (task.result(), family, address)
                elif task.exception() is None:
                    task.result().close()  # two at once: the first wins
                else:
                    error = task.exception()
                    assert error is not None
                    errors.append(error)
                    dial.failed.append(f"{address_text(address)}: {_reason(error)}")
            if winner is not None:
                sock, family, address = winner
                dial.used, dial.family = address_text(address), family_name(family)
                return sock
        if len(errors) == 1:
            raise errors[0]
        raise OSError(f"Multiple exceptions: {'; '.join(str(e) for e in errors)}")
    finally:
        now = time.monotonic()
        for task, (_family, address, started) in running.items():
            task.cancel()
            task.add_done_callback(_close_late)
            dial.failed.append(f"{address_text(address)}: no answer in {(now - started) * 1000:.0f} ms")


def _close_late(task: asyncio.Task[socket.socket]) -> None:
    """An overtaken attempt that connected after all: closed."""
    if not task.cancelled() and task.exception() is None:
        task.result().close()


async def open_connection(host: str, port: int, *, local_addr: Address | None = None,
                          delay: float = ATTEMPT_DELAY_S) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """`asyncio.open_connection(host, port)`, its addresses raced (`race`); what it tried is
    in `last_dial` (on failure too, cancellation included)."""
    dial = Dial()
    last_dial.set(dial)
    resolved = interleave(await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM))
    candidates = preferred_first((host, port), resolved, time.monotonic())
    if local_addr is not None:
        # A fixed local address (mitmproxy's `connection.sockname`) pins the family: its own.
        local_family = socket.AF_INET6 if ":" in str(local_addr[0]) else socket.AF_INET
        sock = await _race_bound([c for c in candidates if c[0] == local_family], local_addr, dial)
    else:
        sock = await race(candidates, dial, delay)
    remember((host, port), resolved, sock, time.monotonic())
    return await asyncio.open_connection(sock=sock)


def preferred_first(name: tuple[str, int], candidates: list[tuple[int, Address]], now: float,
                    ) -> list[tuple[int, Address]]:
    """`candidates` with the address that last won over the name's first one in front, while it is remembered."""
    entry = _preferred.get(name)
    if entry is None or entry[1] < now or entry[0] not in candidates:
        return candidates
    return [entry[0], *(c for c in candidates if c != entry[0])]


def remember(name: tuple[str, int], resolved: list[tuple[int, Address]], sock: socket.socket, now: float) -> None:
    """After a dial: the winner tried first from now on if it was not the resolver's first answer."""
    won = (sock.family, tuple(sock.getpeername()))
    if resolved and won != resolved[0] and won in resolved:
        _preferred.pop(name, None)
        _preferred[name] = (won, now + PREFER_S)
        while len(_preferred) > PREFER_MAX:
            _preferred.pop(next(iter(_preferred)))
    elif (entry := _preferred.get(name)) is not None and entry[0] != won:
        _preferred.pop(name)  # the resolver's first answer serves again


async def _race_bound(candidates: Sequence[tuple[int, Address]], local_addr: Address, dial: Dial) -> socket.socket:
    """With a fixed local address, one attempt at a time (two sockets cannot both bind it)."""
    for family, address in candidates:
        try:
            sock = await _connect(family, address, local_addr)
        except OSError as e:
            dial.failed.append(f"{address_text(address)}: {_reason(e)}")
            continue
        dial.used, dial.family = address_text(address), family_name(family)
        return sock
    raise OSError(f"no address answered ({'; '.join(dial.failed) or 'none of its family'})")


_configured_delay_s: float | None = ATTEMPT_DELAY_S
"""`relay_connect_attempt_delay` in seconds (None: off), for `open_upstream`."""


async def open_upstream(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection the relay opens itself (the upstream pool's), dialled as mitmproxy's are."""
    if _configured_delay_s is None:
        return await asyncio.open_connection(host, port)
    return await open_connection(host, port, delay=_configured_delay_s)


_dials: weakref.WeakKeyDictionary[connection.Server, Dial] = weakref.WeakKeyDictionary()


def of(server: connection.Server) -> Dial | None:
    """What the connect that opened `server` tried (None: not dialled here)."""
    return _dials.get(server)


class HappyEyeballs:
    """mitmproxy's upstream connects race the name's addresses (`open_connection` above), and
    what each connect tried stays with its connection for the record (`of`)."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_connect_attempt_delay",
            int,
            round(ATTEMPT_DELAY_S * 1000),
            "Milliseconds an upstream connect waits on one address of the upstream's name before "
            "it also tries the next, the families interleaved (RFC 8305 Happy Eyeballs): a "
            "black-holed IPv6 address costs this, not the request. 0: mitmproxy's own connect, "
            "the addresses one after another.",
        )

    def configure(self, updated) -> None:
        global _configured_delay_s
        if "relay_connect_attempt_delay" not in updated:
            return
        delay_ms = ctx.options.relay_connect_attempt_delay
        if delay_ms < 0:
            raise exceptions.OptionsError("relay_connect_attempt_delay: milliseconds, 0 or more")
        if delay_ms and pins.on(happy_eyeballs):
            _configured_delay_s = delay_ms / 1000
            happy_eyeballs.install(functools.partial(open_connection, delay=_configured_delay_s))
        else:
            _configured_delay_s = None
            happy_eyeballs.uninstall()

    def done(self) -> None:
        happy_eyeballs.uninstall()

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._keep(data.server)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._keep(data.server)

    def _keep(self, server: connection.Server) -> None:
        # Same task as the connect (mitmproxy's `open_connection`), so its dial is the last one.
        if (dial := last_dial.get()) is not None:
            _dials[server] = dial
            last_dial.set(None)
            if dial.failed and dial.used:
                logger.debug("upstream connect used %s after %s", dial.used, "; ".join(dial.failed))
