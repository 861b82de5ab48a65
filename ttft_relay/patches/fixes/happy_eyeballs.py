"""mitmproxy's upstream connect races a name's addresses (RFC 8305), instead of trying them in turn.

`ConnectionHandler.open_connection` connects with `asyncio.open_connection(host, port,
local_addr=…)`, which tries the name's addresses one after another, each until the kernel
gives up: an upstream name with a black-holed IPv6 address (common on VPSs) holds every
connect until the relay's connect deadline fails the request, though its IPv4 address
answers at once. No hook or option reaches that call, and the function around it is
mitmproxy's whole connect (hooks, errors, the connection's task), so rather than replace
it, the patch gives the module it lives in (`mitmproxy.proxy.server`) its own view of
`asyncio`, the same module but for `open_connection`, which dials through the relay's
racing connect (`ttft_relay.dial`, handed to `install`). Every other name the module
reads from asyncio is the real one.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from typing import Any

from mitmproxy.proxy import server

PINS = {
    # calls `asyncio.open_connection(*address, local_addr=sockname)` for a TCP upstream
    "ConnectionHandler.open_connection": (server.ConnectionHandler.open_connection, "5e0b3cbaf7a4030a"),
    # the module whose view it gets (asyncio's package, the same on Python 3.12 and 3.13), and
    # the call the view answers in its own way (host, port, keywords), which the dial keeps to
    "asyncio": (asyncio, "61102f2b5f8fb832"),
    "asyncio.open_connection": (asyncio.open_connection, "ae527dfe10c91d04"),
}
ORIGINALS = {(server, "asyncio"): asyncio}
WITHOUT = ("an upstream name's addresses are tried one after another (mitmproxy's own connect): a "
           "black-holed address holds each connect until the connect deadline fails the request")

Opener = Callable[..., Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class _AsyncioDialling(types.ModuleType):
    """asyncio, but `open_connection` is `opener`."""

    def __init__(self, opener: Opener) -> None:
        super().__init__("asyncio")
        self.open_connection = opener

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)


def install(opener: Opener) -> None:
    server.asyncio = _AsyncioDialling(opener)  # the patch itself


def uninstall() -> None:
    server.asyncio = asyncio
