"""The relay's patches into mitmproxy 12.3.1, for what hooks cannot shape.

mitmproxy pinned ==12.3.1 (requirements.txt); `tests/test_seams.py` fails loudly
if the code patched here changes shape. Everything else the relay does uses hooks.

1. Upstream failures reach the client as mitmproxy's own error, not the API's.
   When the upstream side fails (connect, DNS, TLS, reset, a connection the relay
   closed on a timeout) the HTTP layer fires the `error` hook and then hands the
   client side a `ResponseProtocolError`: HTTP/1 answers it with an HTML 502 page
   before the response head and with a bare close after it; HTTP/2 likewise
   (HTML, or RST_STREAM). Setting `flow.response` in the `error` hook changes
   none of that. The seam chosen is the one place both protocols share:
   `HttpStream.handle_protocol_error`, which sends that event. The wrap lets the
   original run unchanged (error hook, kill check, stream bookkeeping) and only
   replaces its `SendHttp(ResponseProtocolError, client)` by ordinary response
   events (`ResponseHeaders` / `ResponseData` / `ResponseEndOfMessage`), which
   `Http1Server` and `Http2Server` already know how to send: a complete error
   response before the head, or a last body chunk and a clean end after it.
   What to send is asked of a `Renderer`; None keeps mitmproxy's behaviour.
   (The per-protocol alternative, `Http1Server.send` plus the HTTP/2 equivalent,
   would be two patches that see a request but not its flow.)

2. An eager upstream connect that fails (refused, DNS, connect timeout) makes
   mitmproxy's `ReverseProxy` close the client connection before a request is
   read: no response, no flow, no record. Its top layer is made directly, not
   through the `next_layer` hook, so no hook can swap it. The wrap of
   `DestinationKnown.finish_start` carries on into the HTTP layer instead, for
   reverse proxies only: the request is read, and the HTTP layer's own
   connection lookup reports the failed connection's error on that flow, as a
   lazy connect would (`HttpLayer.get_connection`: `self.context.server.error`).

2b. The same wrap skips the eager connect for the listeners `defer_eager_connects`
   names (reverse listeners with relay access keys): no client gets an upstream
   connection opened for it before its request's key was checked. Those flows
   connect as `connection_strategy=lazy` would, after the request hooks.

2c. A request the relay refuses on its head (no relay key, the relay stopping)
   would still have its whole body read first: mitmproxy sends a response set in
   `requestheaders` only after the body, however large. Killing the flow there
   stops the body (`HttpStream.check_killed` after the hook), but the client gets
   a closed connection and no answer. The wrap of `check_killed` sends the
   response of a flow given to `answer_now` instead of that bare close, then
   closes the connection (HTTP/1; HTTP/2 ends the stream), so the body is never
   read into memory.

2d. mitmproxy buffers a request head until it ends, without a bound ("FIXME:
   protect against header size DoS" in `Http1Server.read_headers`): a head that
   never ends grows the process by gigabytes. The wrap of `read_headers` answers a
   head that has not ended within `limit_request_heads` bytes with a 431 and closes
   the connection.

2e. The relay swaps a client's relay key for the upstream key. Done on the flow,
   the upstream key would sit in it while the request is in flight, and mitmweb
   shows flows in flight. The wrap of `HttpStream.state_consume_request_body`
   leaves the flow as the client sent it (its key redacted) and applies the swap
   given to `send_upstream_with` to a copy of the request, the one whose head goes
   upstream (`SendHttp(RequestHeaders(...))`). A request streamed upstream
   (`flow.request.stream`, which the relay never sets on keyed listeners) would go
   out as the flow holds it.

2f. HTTP/1 trailers (fields after a chunked body's last chunk) make mitmproxy's
   `Http1Connection.read_body` raise NotImplementedError: "mitmproxy has crashed!",
   no answer, no record, and the client waits until it gives up. The wrap turns that
   into a protocol error of the flow: from a client, a 501 saying so
   (`REQUEST_TRAILERS`, mitmproxy's error page, as for its own 400s); from the
   upstream, `RESPONSE_TRAILERS` (an upstream failure like any other); then the
   connection closes.

3. mitmproxy listens with asyncio's default backlog of 100. In a burst of new
   connections larger than that, while the one event loop is busy, the kernel's
   accept queue overflows and the clients it drops wait for a SYN retransmit:
   1 s, then 3 s, added to their first token. No option sets the backlog. The wrap
   of `AsyncioServerInstance.listen` (every TCP listener, at every (re)start) calls
   `listen()` again on the new sockets with a larger backlog, which Linux and the
   BSDs apply to a socket that is already listening; the kernel caps it at
   `net.core.somaxconn`. mitmdump starts its listeners before it loads scripts, so
   those already running are found through the proxyserver addon's public
   `servers` and each instance's `_servers` (pinned by `AsyncioServerInstance._start`).

4. mitmproxy dispatches every event (each flow hook, the `update` event after
   each, every log record as an `add_log` event) by walking its whole addon tree:
   per top-level addon (36 in mitmdump, 40 in mitmweb) a context manager, nested
   generators, a `getattr` (and for `trigger_event` a coroutine), and the event's
   arguments rebuilt from its dataclass fields for every function called, whether
   or not any addon implements the hook. That walk was the largest single cost of a
   bare streaming mitmdump under py-spy. The wraps of `AddonManager.trigger_event`
   and `trigger` walk the tree once per hook name and keep the plan: per top-level
   addon, the hook functions of it and its children, in mitmproxy's order. They
   call them as mitmproxy does: each top-level addon's functions under `safecall`
   (an exception is logged and skips the rest of that addon's tree), awaiting what
   returns an awaitable, `AddonHalt` ending the event. Plans are dropped when the
   tree can change: an addon registered or removed (`AddonManager.register`, a new
   chain list) and any option change (`forget_hook_plans`, e.g. scripts
   reordered). An event already running when a script reloads keeps the functions
   it started with (mitmproxy's lazy walk would reach the new ones). mitmproxy's
   own dispatch still runs the lifecycle events (load, configure, running, done:
   rare, and when scripts load during the walk), a hook some addon names with a
   non-callable attribute, and a coroutine hook fired synchronously (mitmproxy
   reports both).

5. An upstream's interim answer (`100 Continue`, `103 Early Hints`) before its real
   one costs the real one: mitmproxy's `Http1Client` reads the 1xx head as the
   response (bodiless), passes it to the client as the answer, and then meets the
   real head as "unexpected data from server" — the client waits for an answer that
   never comes, and the record says 103. mitmproxy has one response per flow and no
   way to forward an interim head, so the wrap of `Http1Client.read_headers` drops
   interim heads (every 1xx but `101 Switching Protocols`, which is the answer of an
   upgrade) from the upstream's buffer before the original reads the real head.
   RFC 9110 §15.2 lets a client ignore 1xx answers it did not ask for; mitmproxy
   answers a client's `Expect: 100-continue` itself.

6. Reading mitmproxy's sockets (`selfwatch`: TCP_INFO of a flow's connections and of
   each listener) needs no patch, only two private paths: a live connection's
   socket is its handler's `transports[connection].writer` (an asyncio
   StreamWriter), the handler being the proxyserver addon's `connections[client.id]`
   (`ServerInstance.handle_stream`, `ConnectionHandler.open_connection`); the
   listening sockets are each running instance's `_servers` (as in 3.).

7. The first upstream TLS handshake builds mitmproxy's client-side TLS context
   (`net_tls.create_proxy_server_context`: the trusted CA bundle, certifi by
   default, loaded from disk), inside the handshake: first-use work recorded as the
   upstream's TLS. The function is cached by its arguments, so
   `warm_upstream_tls` calls it at start with the arguments
   `TlsConfig.tls_start_server` computes from the options for an upstream without
   a client certificate or per-server cipher list (pinned: a change there misses the
   cache and brings the cost back, nothing worse).

8. `TlsConfig.running` loads the CA again (`configure("confdir")`, a workaround for
   a configure call that sometimes never comes): 40 ms of key parsing on the event
   loop just after the listeners are up, which the first request's upstream
   connect absorbs. `load_ca_once` marks a TlsConfig whose store is already loaded
   (by then mitmproxy has configured it with every option); the wrap of `running`
   skips the reload for it. Any later change of a CA option still reloads in
   `configure`, which the wrap does not touch.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mitmproxy import addonmanager, exceptions, hooks, http
from mitmproxy.addons import tlsconfig
from mitmproxy.net import tls as net_tls
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, events, layer, mode_servers
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import (
    HttpLayer,
    HttpStream,
    RequestHeaders,
    ResponseData,
    ResponseEndOfMessage,
    ResponseHeaders,
    SendHttp,
)
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Connection, Http1Server, make_error_response

logger = logging.getLogger(__name__)

Renderer = Callable[[http.HTTPFlow, str, bool], "tuple[http.Response | None, bytes] | None"]
"""`render(flow, message, head_sent)`: what the client gets instead of mitmproxy's error.

`(response, body)` before the head (a complete response, `body` its content);
`(None, body)` after it (`body` is sent as the last piece of the streamed body);
None to leave mitmproxy's behaviour. `message` is mitmproxy's error text.
"""

_ORIGINAL_HANDLE_PROTOCOL_ERROR = HttpStream.handle_protocol_error
_ORIGINAL_FINISH_START = modes.DestinationKnown.finish_start
_ORIGINAL_CHECK_KILLED = HttpStream.check_killed
_ORIGINAL_READ_HEADERS = Http1Server.read_headers
_ORIGINAL_READ_BODY = Http1Connection.read_body
_ORIGINAL_CONSUME_REQUEST_BODY = HttpStream.state_consume_request_body
_ORIGINAL_LISTEN = mode_servers.AsyncioServerInstance.listen
_ORIGINAL_TRIGGER_EVENT = addonmanager.AddonManager.trigger_event
_ORIGINAL_TRIGGER = addonmanager.AddonManager.trigger
_ORIGINAL_REGISTER = addonmanager.AddonManager.register
_ORIGINAL_READ_RESPONSE_HEADERS = Http1Client.read_headers
_renderer: Renderer | None = None
_deferred_connects: Callable[[Any], bool] | None = None
"""Whether a listener (its proxy mode) must not connect upstream before a request."""
_answer_now: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
_answered: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
_max_head = 0
_outgoing: weakref.WeakKeyDictionary[http.HTTPFlow, Callable[[http.Request], None]] = weakref.WeakKeyDictionary()
_listen_backlog = 0
ASYNCIO_DEFAULT_BACKLOG = 100
"""What `asyncio.start_server` listens with, and so mitmproxy."""


def install(renderer: Renderer) -> None:
    """Patch both seams; `renderer` decides the client's error replies."""
    global _renderer
    _renderer = renderer
    HttpStream.handle_protocol_error = _handle_protocol_error
    modes.DestinationKnown.finish_start = _finish_start


def uninstall() -> None:
    global _renderer
    _renderer = None
    HttpStream.handle_protocol_error = _ORIGINAL_HANDLE_PROTOCOL_ERROR
    if _deferred_connects is None:
        modes.DestinationKnown.finish_start = _ORIGINAL_FINISH_START


def installed() -> bool:
    return HttpStream.handle_protocol_error is _handle_protocol_error


def _handle_protocol_error(self: HttpStream, event: Any) -> layer.CommandGenerator[None]:
    return _replacing(_ORIGINAL_HANDLE_PROTOCOL_ERROR(self, event), lambda command: _client_reply(self, command))


def _replacing(
    commands: layer.CommandGenerator[Any], replace: Callable[[Any], Iterable[Any] | None]
) -> layer.CommandGenerator[Any]:
    """Run a layer's command generator, with some commands replaced by others.

    Values the layer sends back (hook results) go to the original generator; its
    return value is returned.
    """
    reply = None
    while True:
        try:
            command = commands.send(reply)
        except StopIteration as end:
            return end.value
        replacement = replace(command)
        if replacement is None:
            reply = yield command
        else:
            yield from replacement
            reply = None


def _client_reply(stream: HttpStream, command: Any) -> list[SendHttp] | None:
    """The events that replace mitmproxy's error to the client, or None to keep it."""
    if not (
        isinstance(command, SendHttp)
        and isinstance(command.event, ResponseProtocolError)
        and command.connection is stream.context.client
        and _renderer is not None
    ):
        return None
    if stream.server_state == stream.state_stream_response_body:
        head_sent = True
    elif stream.server_state in (stream.state_wait_for_response_headers, stream.state_consume_response_body):
        head_sent = False
    else:  # done or already failed: nothing of ours to say
        return None
    try:
        reply = _renderer(stream.flow, command.event.message, head_sent)
    except Exception:  # the patch must never cost the client its error
        logger.exception("rendering the error reply failed; mitmproxy's own error goes out")
        return None
    if reply is None:
        return None
    response, body = reply
    sid, client = stream.stream_id, stream.context.client
    out = [] if response is None else [SendHttp(ResponseHeaders(sid, response, end_stream=False), client)]
    if body:
        out.append(SendHttp(ResponseData(sid, body), client))
    out.append(SendHttp(ResponseEndOfMessage(sid), client))
    return out


def defer_eager_connects(listener: Callable[[Any], bool] | None) -> None:
    """Skip the eager upstream connect on listeners for which `listener(proxy_mode)`
    holds (None: on none). See 2b above."""
    global _deferred_connects
    _deferred_connects = listener
    if listener is not None or _renderer is not None:
        modes.DestinationKnown.finish_start = _finish_start
    else:
        modes.DestinationKnown.finish_start = _ORIGINAL_FINISH_START


def answer_now(flow: http.HTTPFlow, response: http.Response) -> None:
    """From `requestheaders`: answer `flow` with `response` at once, without reading
    its body, and close the client connection (see 2c above)."""
    flow.response = response
    _answer_now.add(flow)
    HttpStream.check_killed = _check_killed
    flow.kill()


def _check_killed(self: HttpStream, emit_error_hook: bool) -> layer.CommandGenerator[bool]:
    return (yield from _replacing(_ORIGINAL_CHECK_KILLED(self, emit_error_hook), lambda c: _answer(self, c)))


def _answer(stream: HttpStream, command: Any) -> list[Any] | None:
    flow = stream.flow
    if not (
        isinstance(command, SendHttp)
        and isinstance(command.event, ResponseProtocolError)
        and command.event.code == ErrorCode.KILL
        and flow in _answer_now
        and flow.response is not None
    ):
        return None
    if flow in _answered:
        # The stream ended with the answer; a later error of the connection (the client
        # closing it) finds the flow killed again: nothing more to say on that stream.
        return []
    _answered.add(flow)
    sid, client = stream.stream_id, stream.context.client
    body = flow.response.raw_content or b""
    out = [
        SendHttp(ResponseHeaders(sid, flow.response, end_stream=False), client),
        *([SendHttp(ResponseData(sid, body), client)] if body else []),
        SendHttp(ResponseEndOfMessage(sid), client),
    ]
    if _http1_body_to_come(stream):
        # HTTP/1: close the connection after the answer, so the body is never read
        # (the connection itself, not the stream: by the time this runs the body may
        # have ended and the connection moved on). A request without a body is
        # complete, its connection kept; HTTP/2 ends the stream with the response.
        out.append(commands.CloseConnection(client))
    return out


def _http1_body_to_come(stream: HttpStream) -> bool:
    layer_ = next((lay for lay in reversed(stream.context.layers) if isinstance(lay, HttpLayer)), None)
    if layer_ is None or not isinstance(layer_.connections.get(stream.context.client), Http1Server):
        return False
    try:
        return http1.expected_http_body_size(stream.flow.request) != 0
    except ValueError:
        return True


def send_upstream_with(flow: http.HTTPFlow, change: Callable[[http.Request], None]) -> None:
    """Send `flow`'s request upstream as a copy changed by `change`; the flow keeps
    its own (see 2e above)."""
    _outgoing[flow] = change
    HttpStream.state_consume_request_body = _consume_request_body  # type: ignore[method-assign]


def _consume_request_body(self: HttpStream, event: events.Event) -> layer.CommandGenerator[None]:
    return (yield from _replacing(_ORIGINAL_CONSUME_REQUEST_BODY(self, event), lambda c: _outgoing_head(self, c)))


def _outgoing_head(stream: HttpStream, command: Any) -> list[SendHttp] | None:
    if not (
        isinstance(command, SendHttp)
        and isinstance(command.event, RequestHeaders)
        and command.connection is stream.context.server
        and (change := _outgoing.pop(stream.flow, None)) is not None
    ):
        return None
    sent = command.event.request.copy()
    change(sent)
    return [SendHttp(RequestHeaders(command.event.stream_id, sent, command.event.end_stream), command.connection)]


REQUEST_TRAILERS = "HTTP/1 request trailers are not supported by the relay (send the request without them)"
RESPONSE_TRAILERS = "the upstream sent HTTP/1 trailers, which the relay cannot pass on"


def answer_trailers() -> None:
    """Trailers become a flow's protocol error instead of a crash (see 2f above)."""
    Http1Connection.read_body = _read_body  # type: ignore[method-assign]


def _read_body(self: Http1Connection, event: events.Event) -> layer.CommandGenerator[None]:
    try:
        yield from _ORIGINAL_READ_BODY(self, event)
    except NotImplementedError as e:
        if "trailers" not in str(e):
            raise
        if isinstance(self, Http1Server):
            # As for mitmproxy's own 400s, the server side answers: a request error
            # sends nothing to the client.
            yield commands.SendData(self.conn, make_error_response(501, REQUEST_TRAILERS))
            error: Any = RequestProtocolError(self.stream_id, REQUEST_TRAILERS, ErrorCode.GENERIC_CLIENT_ERROR)
        else:
            error = ResponseProtocolError(self.stream_id, RESPONSE_TRAILERS, ErrorCode.GENERIC_SERVER_ERROR)
        yield ReceiveHttp(error)
        yield commands.CloseConnection(self.conn)
        self.state = self.done


def limit_request_heads(limit: int) -> None:
    """HTTP/1 request heads longer than `limit` bytes get a 431 (see 2d above); 0: no limit."""
    global _max_head
    _max_head = limit
    Http1Server.read_headers = _read_headers if limit > 0 else _ORIGINAL_READ_HEADERS  # type: ignore[method-assign]


def _read_headers(self: Http1Server, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
    # The head ends within the limit or is extracted at once: a longer buffer before
    # extraction is a head still going (a read brings at most 64 KiB).
    if isinstance(event, events.DataReceived) and 0 < _max_head < len(self.buf):
        if b"\r\n\r\n" not in bytes(self.buf)[: _max_head + 4]:
            yield commands.Log(f"request head over {_max_head} bytes without an end: refused (431)")
            yield commands.SendData(self.conn, make_error_response(431, f"request head over {_max_head} bytes"))
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            return
    yield from _ORIGINAL_READ_HEADERS(self, event)


def _finish_start(self: modes.DestinationKnown) -> layer.CommandGenerator[str | None]:
    if _deferred_connects is not None and _deferred_connects(self.context.client.proxy_mode):
        # What the original does without an eager connect.
        self._handle_event = self.child_layer.handle_event  # type: ignore[method-assign]
        yield from self.child_layer.handle_event(events.Start())
        return None
    err = yield from _ORIGINAL_FINISH_START(self)
    if err and isinstance(self, modes.ReverseProxy) and _renderer is not None:
        logger.debug("eager upstream connect failed (%s); reading the request to answer it", err)
        self._handle_event = self.child_layer.handle_event  # type: ignore[method-assign]
        yield from self.child_layer.handle_event(events.Start())
        return None
    return err


def set_listen_backlog(backlog: int, running: Iterable[Any] = ()) -> None:
    """TCP listeners queue up to `backlog` new connections: those of the server
    instances in `running` at once, every listener (re)started later when it starts.
    0: mitmproxy's own backlog, for both."""
    global _listen_backlog
    _listen_backlog = backlog
    mode_servers.AsyncioServerInstance.listen = _listen if backlog > 0 else _ORIGINAL_LISTEN  # type: ignore[method-assign]
    for instance in running:
        if isinstance(instance, mode_servers.AsyncioServerInstance):
            _relisten(instance._servers, backlog or ASYNCIO_DEFAULT_BACKLOG)


async def _listen(self: mode_servers.AsyncioServerInstance, host: str, port: int) -> list[Any]:
    servers = await _ORIGINAL_LISTEN(self, host, port)
    _relisten(servers, _listen_backlog or ASYNCIO_DEFAULT_BACKLOG)  # set to 0 while we awaited
    return servers


def _relisten(servers: Iterable[Any], backlog: int) -> None:
    for server in servers:
        for listening in getattr(server, "sockets", ()):  # asyncio servers; UDP ones have none
            if listening.type != socket.SOCK_STREAM:
                continue
            try:
                # a duplicate descriptor of the same socket: listen() applies to both
                with socket.socket(fileno=os.dup(listening.fileno())) as same:
                    same.listen(backlog)
            except OSError as e:  # the patch must never cost a listener
                logger.warning("cannot set the listen backlog of %s to %d: %s", listening.getsockname(), backlog, e)


def listening_sockets(instances: Iterable[Any]) -> list[socket.socket]:
    """The TCP listening sockets of mitmproxy's running server instances."""
    found = []
    for instance in instances:
        if isinstance(instance, mode_servers.AsyncioServerInstance):
            for server in instance._servers:
                found += [s for s in getattr(server, "sockets", ()) if s.type == socket.SOCK_STREAM]
    return found


def connection_socket(connections: Mapping[Any, Any], client: Any, conn: Any) -> socket.socket | None:
    """The socket of `conn` (the client's own connection or one of its upstream
    connections), from the proxyserver addon's `connections`; None once it is gone,
    or for a connection without a socket (UDP, WireGuard)."""
    handler = connections.get(client.id)
    io = handler.transports.get(conn) if handler is not None else None
    writer = io.writer if io is not None else None
    return writer.get_extra_info("socket") if isinstance(writer, asyncio.StreamWriter) else None


_ORIGINAL_TLS_RUNNING = tlsconfig.TlsConfig.running
_CA_CURRENT = "_ttft_relay_ca_current"


def load_ca_once(addon: tlsconfig.TlsConfig | None, on: bool = True) -> None:
    """`addon` keeps the CA it loaded instead of loading it again in `running` (8. above)."""
    tlsconfig.TlsConfig.running = _tls_running if on else _ORIGINAL_TLS_RUNNING  # type: ignore[method-assign]
    if addon is not None:
        setattr(addon, _CA_CURRENT, on and addon.certstore is not None)


def _tls_running(self: tlsconfig.TlsConfig) -> None:
    if getattr(self, _CA_CURRENT, False) and self.certstore is not None:
        return
    _ORIGINAL_TLS_RUNNING(self)


def warm_upstream_tls(options: Any) -> None:
    """Build (and cache) the upstream TLS context mitmproxy's first handshake would build."""
    min_version = net_tls.Version[options.tls_version_server_min]
    ciphers = options.ciphers_server.split(":") if options.ciphers_server else tlsconfig._default_ciphers(min_version)
    net_tls.create_proxy_server_context(
        method=net_tls.Method.TLS_CLIENT_METHOD,
        min_version=min_version,
        max_version=net_tls.Version[options.tls_version_server_max],
        cipher_list=tuple(ciphers),
        ecdh_curve=net_tls.get_curve(options.tls_ecdh_curve_server),
        verify=net_tls.Verify.VERIFY_NONE if options.ssl_insecure else net_tls.Verify.VERIFY_PEER,
        ca_path=options.ssl_verify_upstream_trusted_confdir,
        ca_pemfile=options.ssl_verify_upstream_trusted_ca,
        client_cert=None,
        legacy_server_connect=options.ssl_insecure,
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one event calls: per top-level addon that has any, its hook functions."""

    funcs: list[list[Callable]]
    sync: bool
    """No coroutine functions among them: the synchronous `trigger` may use the plan."""


class _HookPlans:
    """The plans of one addon tree, by hook name; None where mitmproxy's own dispatch
    must run (lifecycle events, a non-callable attribute named like the hook)."""

    __slots__ = ("chain", "generation", "by_name")

    def __init__(self, chain: list[Any], generation: int) -> None:
        # The list itself, not its id: `remove` and `clear` make a new list (and `add`
        # goes through `register`).
        self.chain = chain
        self.generation = generation
        self.by_name: dict[str, _Plan | None] = {}


_PLANS_ATTRIBUTE = "_ttft_relay_hook_plans"
"""Where a manager keeps its plans: on itself, so they live and die with it."""
_generation = 0
"""Bumped whenever some addon tree may have changed; older plans are dropped."""
_LIFECYCLE = frozenset({"load", "configure", "running", "done"})
"""Rare, and when the tree changes (scripts load) while mitmproxy's lazy walk runs."""


def install_hook_plans(on: bool) -> None:
    """Dispatch events from plans (see 4. above); False gives mitmproxy's dispatch back."""
    forget_hook_plans()
    manager = addonmanager.AddonManager
    manager.trigger_event = _trigger_event if on else _ORIGINAL_TRIGGER_EVENT  # type: ignore[method-assign]
    manager.trigger = _trigger if on else _ORIGINAL_TRIGGER  # type: ignore[method-assign]
    manager.register = _register if on else _ORIGINAL_REGISTER  # type: ignore[method-assign]


def hook_plans_installed() -> bool:
    return addonmanager.AddonManager.trigger_event is _trigger_event


def forget_hook_plans() -> None:
    global _generation
    _generation += 1


def _register(self: addonmanager.AddonManager, addon: Any) -> Any:
    # Forget after, not before: the tree changes only once this returns (`add`
    # appends the addon, a script addon sets its module), and events fired meanwhile
    # (from `load`, or `configure` of deferred options) may have planned the old one.
    try:
        return _ORIGINAL_REGISTER(self, addon)
    finally:
        forget_hook_plans()


def _plan_for(manager: addonmanager.AddonManager, name: str) -> _Plan | None:
    plans = getattr(manager, _PLANS_ATTRIBUTE, None)
    if plans is None or plans.generation != _generation or plans.chain is not manager.chain:
        plans = _HookPlans(manager.chain, _generation)
        setattr(manager, _PLANS_ATTRIBUTE, plans)
    try:
        return plans.by_name[name]
    except KeyError:
        pass
    try:
        plan = None if name in _LIFECYCLE else _plan(manager.chain, name)
    except Exception:  # an addon's attribute raised: mitmproxy's walk reports it
        plan = None
    plans.by_name[name] = plan
    return plan


def _plan(chain: list[Any], name: str) -> _Plan | None:
    funcs = []
    for top in chain:
        of_top = []
        for addon in addonmanager.traverse([top]):
            func = getattr(addon, name, None)
            if not func or isinstance(func, types.ModuleType):  # mitmproxy skips both
                continue
            if not callable(func):
                return None
            of_top.append(func)
        if of_top:
            funcs.append(of_top)
    return _Plan(funcs, sync=not any(inspect.iscoroutinefunction(f) for of_top in funcs for f in of_top))


def _planned(manager: addonmanager.AddonManager, event: hooks.Hook, sync: bool) -> tuple[list[list[Callable]], list[Any]] | None:
    """The hook functions per top-level addon and the event's arguments; None leaves
    the event to mitmproxy (see `_plan_for`; a coroutine hook fired synchronously,
    which mitmproxy reports)."""
    plan = _plan_for(manager, event.name)
    if plan is None or (sync and not plan.sync):
        return None
    return plan.funcs, event.args() if plan.funcs else []


async def _trigger_event(self: addonmanager.AddonManager, event: hooks.Hook) -> None:
    planned = _planned(self, event, sync=False)
    if planned is None:
        return await _ORIGINAL_TRIGGER_EVENT(self, event)
    funcs_by_addon, args = planned
    for funcs in funcs_by_addon:
        try:
            with addonmanager.safecall():
                for func in funcs:
                    result = func(*args)
                    if result is not None and inspect.isawaitable(result):
                        await result
        except exceptions.AddonHalt:
            return


def _trigger(self: addonmanager.AddonManager, event: hooks.Hook) -> None:
    planned = _planned(self, event, sync=True)
    if planned is None:
        return _ORIGINAL_TRIGGER(self, event)
    funcs_by_addon, args = planned
    for funcs in funcs_by_addon:
        try:
            with addonmanager.safecall():
                for func in funcs:
                    func(*args)
        except exceptions.AddonHalt:
            return


# --- 5. interim answers --------------------------------------------------------------


def install_interim_skip() -> None:
    Http1Client.read_headers = _read_response_headers


def uninstall_interim_skip() -> None:
    Http1Client.read_headers = _ORIGINAL_READ_RESPONSE_HEADERS


def interim_head_size(data: bytes) -> int:
    """The length of the interim (1xx, not 101) response head `data` starts with, once it
    is complete; 0 if `data` does not start with one (or its end has not arrived)."""
    if not (data.startswith(b"HTTP/1.") and data[8:10] == b" 1" and data[9:12] != b"101"):
        return 0
    end = data.find(b"\r\n\r\n")
    return end + 4 if end >= 0 else 0


def _read_response_headers(self: Http1Client, event: events.Event) -> layer.CommandGenerator[None]:
    if isinstance(event, events.DataReceived) and self.request is not None:
        while size := interim_head_size(bytes(self.buf)[:65536]):
            dropped = self.buf.maybe_extract_at_most(size)
            logger.debug("dropped an interim answer from %s: %r", self.conn.address, bytes(dropped or b"")[:80])
    return (yield from _ORIGINAL_READ_RESPONSE_HEADERS(self, event))
