"""The patches in `ttft_relay/patches/seams.py`: each behaves as documented, and the mitmproxy code
under them is pinned, so a change there fails loudly.

mitmproxy is pinned ==12.3.1. On an upgrade, read the new versions of the functions
named here, check the reasoning in seams.py still holds, then update the digests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect

import pytest
from mitmproxy import addonmanager, connection, ctx, exceptions, master, tls, version
from mitmproxy.addons import script, tlsconfig
from mitmproxy.hooks import UpdateHook
from mitmproxy.net import tls as net_tls
from mitmproxy.proxy import context, mode_servers, server
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HttpLayer, HttpRequestHook, HttpStream
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import Http2Connection
from h11._receivebuffer import ReceiveBuffer
from mitmproxy.test import taddons, tflow

from ttft_relay import capacity
from ttft_relay.patches import seams
from tests.harness import connect_many, handshakes_completed

# sha256 (first 16 hex digits) of the source of every function the seams patch or rely on.
PINNED = {
    "HttpStream.handle_protocol_error": (seams._ORIGINAL_HANDLE_PROTOCOL_ERROR, "59fc3b2eeeabf63a"),
    "DestinationKnown.finish_start": (seams._ORIGINAL_FINISH_START, "91f47432073a2bf6"),
    "HttpStream.check_killed": (seams._ORIGINAL_CHECK_KILLED, "368cad352d1e82b6"),
    "HttpStream.state_wait_for_request_headers": (HttpStream.state_wait_for_request_headers, "3706d5d5ce01dcd4"),
    "Http1Server.read_headers": (seams._ORIGINAL_READ_HEADERS, "3fe0945216bcf7bc"),
    "Http1Connection.read_body": (seams._ORIGINAL_READ_BODY, "aece271029af36e4"),
    "HttpStream.state_consume_request_body": (seams._ORIGINAL_CONSUME_REQUEST_BODY, "45459c1bbd8bdb1a"),
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    "Http2Connection._handle_event": (Http2Connection._handle_event, "7fc814a8a507f234"),
    "AsyncioServerInstance.listen": (seams._ORIGINAL_LISTEN, "7670a9038b44170d"),
    "AsyncioServerInstance._start": (mode_servers.AsyncioServerInstance._start, "f96507081fa6236b"),
    "AddonManager.trigger_event": (seams._ORIGINAL_TRIGGER_EVENT, "b763c59bc4992e33"),
    "AddonManager.register": (seams._ORIGINAL_REGISTER, "01ddcca314eebbd3"),
    "AddonManager.trigger": (seams._ORIGINAL_TRIGGER, "b19e37ceb2096421"),
    "AddonManager.invoke_addon_sync": (addonmanager.AddonManager.invoke_addon_sync, "212818268a95797b"),
    "AddonManager.invoke_addon": (addonmanager.AddonManager.invoke_addon, "13180532440359de"),
    "AddonManager._iter_hooks": (addonmanager.AddonManager._iter_hooks, "350b419ab7284091"),
    "AddonManager.remove": (addonmanager.AddonManager.remove, "2e93aab2204a39f6"),
    "AddonManager.clear": (addonmanager.AddonManager.clear, "5fd484329fa05882"),
    "AddonManager.add": (addonmanager.AddonManager.add, "6c26295c4f0f4eb9"),
    "addonmanager.traverse": (addonmanager.traverse, "bad3d9f88bdf9269"),
    # how the tree changes under plans (register, then the module set) and when
    # listeners start (before `running`, where the backlog reaches them)
    "Script.loadscript": (script.Script.loadscript, "f2972abb206ff2fe"),
    "ScriptLoader.configure": (script.ScriptLoader.configure, "d76470344008804a"),
    "Master.run": (master.Master.run, "45c44c14f8f79349"),
    # 5: the response head is read from the buffer the wrap takes interim heads out of
    "Http1Client.read_headers": (seams._ORIGINAL_READ_RESPONSE_HEADERS, "415454c5fa8b5981"),
    "ReceiveBuffer.maybe_extract_at_most": (ReceiveBuffer.maybe_extract_at_most, "a283b372f1fb7393"),
    # 6: where a live connection's socket is (selfwatch reads its TCP_INFO)
    "ServerInstance.handle_stream": (mode_servers.ServerInstance.handle_stream, "21eea06f208c752e"),
    "ConnectionHandler.open_connection": (server.ConnectionHandler.open_connection, "5e0b3cbaf7a4030a"),
    "LiveConnectionHandler.__init__": (server.LiveConnectionHandler.__init__, "2cb1077a21556ca9"),
    # 7: the arguments of the upstream TLS context, and its cache
    "TlsConfig.tls_start_server": (tlsconfig.TlsConfig.tls_start_server, "2e2dc9c25670cf64"),
    "create_proxy_server_context": (net_tls.create_proxy_server_context.__wrapped__, "e2d90d71c5744797"),
    # 8: running loads the CA again; configure (re)loads it on every CA option change
    "TlsConfig.running": (seams._ORIGINAL_TLS_RUNNING, "b65f52307d81dc76"),
    "TlsConfig.configure": (tlsconfig.TlsConfig.configure, "efea05bd816190dc"),
}


def digest(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def test_mitmproxy_is_the_pinned_version():
    assert version.VERSION == "12.3.1"


def test_patched_and_relied_on_code_is_unchanged():
    changed = {name: digest(fn) for name, (fn, pinned) in PINNED.items() if digest(fn) != pinned}
    assert not changed, f"mitmproxy code under the seams changed, re-check ttft_relay/patches/seams.py: {changed}"


def test_the_lines_the_seams_depend_on():
    # 1: the error goes to the client as one SendHttp, after the error hook.
    src = inspect.getsource(seams._ORIGINAL_HANDLE_PROTOCOL_ERROR)
    assert src.index("yield HttpErrorHook(self.flow)") < src.index("yield SendHttp(event, self.context.client)")
    # 2: a failed eager connect ends the layer; the HTTP layer reports a context server's error.
    assert "self._handle_event = self.done" in inspect.getsource(seams._ORIGINAL_FINISH_START)
    assert "(None, self.context.server.error)" in inspect.getsource(HttpLayer.get_connection)
    # 2b: without an eager connect, finish_start only hands the start to its child layer.
    assert inspect.getsource(seams._ORIGINAL_FINISH_START).rstrip().endswith(
        "self._handle_event = self.child_layer.handle_event  # type: ignore\n"
        "        yield from self.child_layer.handle_event(events.Start())\n        return None")
    # 2c: a flow killed in requestheaders ends in check_killed, before any body is read.
    src = inspect.getsource(HttpStream.state_wait_for_request_headers)
    assert src.index("yield HttpRequestHeadersHook(self.flow)") < src.index("if (yield from self.check_killed(True)):")
    assert src.index("if (yield from self.check_killed(True)):") < src.index("self.client_state = self.state_consume_request_body")
    assert "ResponseProtocolError(self.stream_id, \"killed\", ErrorCode.KILL)" in inspect.getsource(seams._ORIGINAL_CHECK_KILLED)
    # 2d: the head is buffered until it ends, with no bound.
    assert "FIXME: protect against header size DoS" in inspect.getsource(seams._ORIGINAL_READ_HEADERS)
    # 2e: the request's head goes upstream as one SendHttp(RequestHeaders) after the request hook.
    src = inspect.getsource(seams._ORIGINAL_CONSUME_REQUEST_BODY)
    assert src.index("yield HttpRequestHook(self.flow)") < src.index("RequestHeaders(")
    # 2f: trailers end the body reader with NotImplementedError, and a client's
    # protocol error sends the client nothing (the server side answers it).
    assert 'raise NotImplementedError(f"HTTP trailers are not implemented yet.")' in inspect.getsource(
        seams._ORIGINAL_READ_BODY)
    assert "if isinstance(event, ResponseProtocolError):" in inspect.getsource(seams._ORIGINAL_HANDLE_PROTOCOL_ERROR)
    # 3: every TCP listener comes from `listen`, and a running instance keeps its servers in `_servers`.
    assert "self._servers = await self.listen(host, port)" in inspect.getsource(mode_servers.AsyncioServerInstance._start)
    assert "asyncio.start_server(self.handle_stream, host, port)" in inspect.getsource(seams._ORIGINAL_LISTEN)
    # 6: a connection's handler is registered by its client's id; its transports hold asyncio writers.
    assert "register_connection(handler.layer.context.client.id, handler)" in inspect.getsource(
        mode_servers.ServerInstance.handle_stream)
    assert "self.transports[command.connection] = ConnectionIO(" in inspect.getsource(
        server.ConnectionHandler.open_connection)
    assert "self.transports[client] = ConnectionIO(" in inspect.getsource(server.LiveConnectionHandler.__init__)


def test_install_and_uninstall_restore_mitmproxys_code():
    seams.defer_eager_connects(None)  # an earlier test's keyed listeners
    seams.uninstall()  # and an earlier test's ErrorReplies (loaded to declare options)
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


def test_eager_connects_are_deferred_only_for_the_named_listeners():
    seams.defer_eager_connects(lambda mode: mode.listen_port() == 8001)
    try:
        assert modes.DestinationKnown.finish_start is seams._finish_start
    finally:
        seams.defer_eager_connects(None)
    assert modes.DestinationKnown.finish_start is seams._ORIGINAL_FINISH_START


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


# --- 4: hook dispatch from plans ------------------------------------------------------


class Recorder:
    """An addon whose `request` hook notes its name, and may fail or halt."""

    def __init__(self, name: str, log: list, *, then: type[BaseException] | None = None, children=()) -> None:
        self.name, self.log, self.then = name, log, then
        if children:
            self.addons = list(children)

    def request(self, flow) -> None:
        self.log.append(self.name)
        if self.then:
            raise self.then(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class AsyncRecorder(Recorder):
    async def request(self, flow) -> None:
        await asyncio.sleep(0)
        Recorder.request(self, flow)


class NotAHook:
    request = "not callable"

    def __repr__(self) -> str:
        return "NotAHook()"


def dispatch(addons_for_log, plans: bool, sync: bool, caplog) -> tuple[list, list[str], bool]:
    """Trigger one `request` event (with `trigger_event`, or the synchronous `trigger`)
    over the addons `addons_for_log(log)` builds: the order of the calls, the addon
    errors mitmproxy logged, and whether a plan served the event."""
    log: list = []
    left_to_mitmproxy: list[str] = []
    caplog.clear()

    def counted(original):
        def dispatch_by_mitmproxy(self, event):
            left_to_mitmproxy.append(event.name)
            return original(self, event)
        return dispatch_by_mitmproxy

    async def run() -> None:
        with taddons.context(*addons_for_log(log)) as tctx:
            try:
                if sync:
                    tctx.master.addons.trigger(HttpRequestHook(tflow.tflow()))
                else:
                    await tctx.master.addons.trigger_event(HttpRequestHook(tflow.tflow()))
            finally:
                await tctx.master.done()  # its log handler must not outlive this loop

    seams.install_hook_plans(plans)
    originals = seams._ORIGINAL_TRIGGER_EVENT, seams._ORIGINAL_TRIGGER
    seams._ORIGINAL_TRIGGER_EVENT, seams._ORIGINAL_TRIGGER = map(counted, originals)
    try:
        asyncio.run(run())
    finally:
        seams._ORIGINAL_TRIGGER_EVENT, seams._ORIGINAL_TRIGGER = originals
        seams.install_hook_plans(False)
    errors = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Addon error")]
    return log, errors, plans and "request" not in left_to_mitmproxy


SCENARIOS = {
    "order, nesting and async": lambda log: [
        Recorder("a", log, children=[Recorder("a.1", log), AsyncRecorder("a.2", log, children=[Recorder("a.2.i", log)])]),
        AsyncRecorder("b", log), Recorder("c", log)],
    "an error skips the rest of that addon's tree only": lambda log: [
        Recorder("a", log, children=[Recorder("a.1", log, then=ValueError), Recorder("a.2", log)]), Recorder("b", log)],
    "AddonHalt ends the event": lambda log: [
        Recorder("a", log), Recorder("b", log, then=exceptions.AddonHalt), Recorder("c", log)],
    "a non-callable hook attribute is mitmproxy's error": lambda log: [
        Recorder("a", log), NotAHook(), Recorder("c", log)],
}


@pytest.mark.parametrize("sync", [False, True], ids=["trigger_event", "trigger"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plans_call_what_mitmproxy_calls_in_its_order(scenario, sync, caplog):
    log, errors, _ = dispatch(SCENARIOS[scenario], False, sync, caplog)
    assert log  # the scenario ran
    planned_log, planned_errors, planned = dispatch(SCENARIOS[scenario], True, sync, caplog)
    assert (planned_log, planned_errors) == (log, errors)
    # Plans serve the event, but where mitmproxy must report an error of its own.
    assert planned == ("non-callable" not in scenario and not (sync and "async" in scenario))


def test_plans_follow_the_addon_tree_as_it_changes():
    log: list = []

    async def run() -> list[list]:
        seen = []
        plans = capacity.HookPlans()
        parent = Recorder("parent", log, children=[Recorder("child", log)])
        with taddons.context(plans, parent) as tctx:
            try:
                tctx.configure(plans, relay_hook_plans=True)
                assert seams.hook_plans_installed()

                async def event() -> None:
                    log.clear()
                    await tctx.master.addons.trigger_event(HttpRequestHook(tflow.tflow()))
                    seen.append(list(log))

                await event()
                late = Recorder("late", log)
                tctx.master.addons.add(late)  # a new top-level addon
                await event()
                tctx.master.addons.remove(late)
                await event()
                nested = Recorder("nested", log)
                parent.addons.append(nested)  # a managing addon registers what it adds
                tctx.master.addons.register(nested)
                await event()
                parent.addons.reverse()  # as the script loader reorders scripts, on an option change
                tctx.options.update(showhost=True)
                await event()
                tctx.configure(plans, relay_hook_plans=False)
                assert not seams.hook_plans_installed()
            finally:
                seams.install_hook_plans(False)
                await tctx.master.done()
        return seen

    assert asyncio.run(run()) == [
        ["parent", "child"],
        ["parent", "child", "late"],
        ["parent", "child"],
        ["parent", "child", "nested"],
        ["parent", "nested", "child"],
    ]


class TriggersOnLoad:
    """Fires an event while mitmproxy registers it: before it is in the tree."""

    def __init__(self, log: list) -> None:
        self.log = log

    def load(self, loader) -> None:
        ctx.master.addons.trigger(UpdateHook([]))

    def update(self, flows) -> None:
        self.log.append("update")


def test_an_event_fired_while_an_addon_registers_plans_nothing_stale():
    log: list = []

    async def run() -> None:
        with taddons.context() as tctx:
            seams.install_hook_plans(True)
            try:
                tctx.master.addons.trigger(UpdateHook([]))  # a plan for `update` without the addon
                tctx.master.addons.add(TriggersOnLoad(log))
                tctx.master.addons.trigger(UpdateHook([]))
            finally:
                seams.install_hook_plans(False)
                await tctx.master.done()

    asyncio.run(run())
    assert log == ["update"]


@pytest.mark.parametrize(
    "data, size",
    [
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\n", 40),
        (b"HTTP/1.1 100 Continue\r\n\r\n", 25),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n", 0),  # not complete yet
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", 0),  # the answer of an upgrade
        (b"HTTP/1.1 200 OK\r\n\r\n", 0),
        (b"HTTP/1.1 199 Whatever\r\n\r\n", 25),
        (b"garbage", 0),
    ],
)
def test_interim_heads_are_recognised(data, size):
    assert seams.interim_head_size(data) == size


def test_the_interim_skip_installs_and_uninstalls():
    from mitmproxy.proxy.layers.http._http1 import Http1Client

    seams.install_interim_skip()
    try:
        assert Http1Client.read_headers is seams._read_response_headers
    finally:
        seams.uninstall_interim_skip()
    assert Http1Client.read_headers is seams._ORIGINAL_READ_RESPONSE_HEADERS


@pytest.mark.parametrize("options", [{}, {"ssl_insecure": True}, {"tls_version_server_min": "TLS1_2"}])
def test_the_warmed_upstream_tls_context_is_the_one_the_first_handshake_uses(options, certs):
    addon = tlsconfig.TlsConfig()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, ssl_verify_upstream_trusted_ca=str(certs.ca_pem), **options)
        net_tls.create_proxy_server_context.cache_clear()
        seams.warm_upstream_tls(tctx.options)
        assert net_tls.create_proxy_server_context.cache_info().misses == 1
        ctx_ = context.Context(connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2)), tctx.options)
        ctx_.server.address = ("api.example.com", 443)
        addon.tls_start_server(tls.TlsData(ctx_.server, context=ctx_))
        info = net_tls.create_proxy_server_context.cache_info()
        assert (info.hits, info.misses) == (1, 1)  # built once, at start


def test_the_ca_loaded_at_start_is_not_loaded_again_when_running(tmp_path):
    addon = tlsconfig.TlsConfig()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, confdir=str(tmp_path))
        loaded = addon.certstore
        seams.load_ca_once(addon)
        try:
            addon.running()
            assert addon.certstore is loaded  # kept, not loaded again
            tctx.configure(addon, key_size=3072)  # a CA option changed: configure reloads as ever
            assert addon.certstore is not loaded
            other = tlsconfig.TlsConfig()  # a store never loaded: running loads it, as mitmproxy does
            with taddons.context(other):
                seams.load_ca_once(other)
                other.certstore = None
                other.running()
                assert other.certstore is not None
        finally:
            seams.load_ca_once(addon, on=False)
    assert tlsconfig.TlsConfig.running is seams._ORIGINAL_TLS_RUNNING
