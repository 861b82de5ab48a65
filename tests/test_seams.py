"""Pins the mitmproxy code `addons/seams.py` patches: fails loudly if mitmproxy changes it.

mitmproxy is pinned ==12.3.1. On an upgrade, read the new versions of the functions
named here, check the reasoning in seams.py still holds, then update the digests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect

import pytest
from mitmproxy import version
from mitmproxy.proxy import mode_servers
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import Http2Connection
from mitmproxy.test import taddons

from addons import seams
from tests.harness import connect_many, handshakes_completed

# sha256 (first 16 hex digits) of the source of every function the seams patch or rely on.
PINNED = {
    "HttpStream.handle_protocol_error": (seams._ORIGINAL_HANDLE_PROTOCOL_ERROR, "59fc3b2eeeabf63a"),
    "DestinationKnown.finish_start": (seams._ORIGINAL_FINISH_START, "91f47432073a2bf6"),
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    "Http2Connection._handle_event": (Http2Connection._handle_event, "7fc814a8a507f234"),
    "AsyncioServerInstance.listen": (seams._ORIGINAL_LISTEN, "7670a9038b44170d"),
    "AsyncioServerInstance._start": (mode_servers.AsyncioServerInstance._start, "f96507081fa6236b"),
}


def digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def test_mitmproxy_is_the_pinned_version():
    assert version.VERSION == "12.3.1"


def test_patched_and_relied_on_code_is_unchanged():
    changed = {name: digest(fn) for name, (fn, pinned) in PINNED.items() if digest(fn) != pinned}
    assert not changed, f"mitmproxy code under the seams changed, re-check addons/seams.py: {changed}"


def test_the_lines_the_seams_depend_on():
    # 1: the error goes to the client as one SendHttp, after the error hook.
    src = inspect.getsource(seams._ORIGINAL_HANDLE_PROTOCOL_ERROR)
    assert src.index("yield HttpErrorHook(self.flow)") < src.index("yield SendHttp(event, self.context.client)")
    # 2: a failed eager connect ends the layer; the HTTP layer reports a context server's error.
    assert "self._handle_event = self.done" in inspect.getsource(seams._ORIGINAL_FINISH_START)
    assert "(None, self.context.server.error)" in inspect.getsource(HttpLayer.get_connection)
    # 3: every TCP listener comes from `listen`, and a running instance keeps its servers in `_servers`.
    assert "self._servers = await self.listen(host, port)" in inspect.getsource(mode_servers.AsyncioServerInstance._start)
    assert "asyncio.start_server(self.handle_stream, host, port)" in inspect.getsource(seams._ORIGINAL_LISTEN)


def test_install_and_uninstall_restore_mitmproxys_code():
    original_error, original_start = HttpStream.handle_protocol_error, modes.DestinationKnown.finish_start
    seams.install(lambda flow, message, head_sent: None)
    try:
        assert seams.installed()
        assert HttpStream.handle_protocol_error is not original_error
        assert modes.DestinationKnown.finish_start is not original_start
    finally:
        seams.uninstall()
    assert HttpStream.handle_protocol_error is original_error
    assert modes.DestinationKnown.finish_start is original_start
    assert not seams.installed()


def test_replacing_passes_hook_replies_to_the_original_generator():
    got = []

    def original():
        got.append((yield "hook"))
        yield "error to client"
        got.append((yield "after"))

    out = seams._replacing(original(), lambda c: ["a", "b"] if c == "error to client" else None)
    assert next(out) == "hook"
    assert out.send("reply") == "a"
    assert next(out) == "b"
    assert next(out) == "after"
    try:
        out.send("reply 2")
    except StopIteration:
        pass
    assert got == ["reply", "reply 2"]


# --- 3: the listen backlog ------------------------------------------------------------


class _NoConnections:
    connections: dict = {}

    @contextlib.contextmanager
    def register_connection(self, connection_id, handler):
        yield


@pytest.mark.parametrize("backlog", [0, 300])
def test_listeners_started_after_install_queue_the_backlog(backlog):
    async def queued() -> int:
        with taddons.context():
            instance = mode_servers.ServerInstance.make("reverse:http://127.0.0.1:9@127.0.0.1:0", _NoConnections())
            seams.set_listen_backlog(backlog)
            try:
                await instance.start()
                # No await from here on: the event loop accepts nothing while we connect.
                sockets = connect_many(instance.listen_addrs[0][1], 250)
                try:
                    return len(handshakes_completed(sockets))
                finally:
                    for s in sockets:
                        s.close()
            finally:
                seams.set_listen_backlog(0)
                await instance.stop()

    got = asyncio.run(queued())
    if backlog:
        assert got == 250
    else:  # mitmproxy's own: asyncio's 100 (the kernel queues one more)
        assert seams.ASYNCIO_DEFAULT_BACKLOG <= got <= seams.ASYNCIO_DEFAULT_BACKLOG + 1
