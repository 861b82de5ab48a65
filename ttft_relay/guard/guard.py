"""Guard: who may use the relay, and where its secrets may go.

A relay sits between its users and a paid API key. These addons keep it that way:

    Exposure        refuses to start (or to take an option change) that would serve
                    other machines without authentication or TLS: a non-loopback
                    listener without proxyauth (proxies) or relay access keys (reverse
                    listeners), or without a TLS certificate (`certs`, ttft_relay/guard/tls.py)
                    unless `relay_client_tls` is optional; or mitmweb on a
                    non-loopback web_host without web_password.
                    `relay_allow_open_proxy` overrides the listener check for relays
                    firewalled elsewhere.
    AccessKeys      reverse listeners: clients present a relay access key where their
                    SDK puts the API key; the relay checks it and swaps in the
                    upstream key from the environment, so a relay can be shared
                    without sharing the upstream key.
    ClientLimits    before any authentication: a deadline for each request head
                    (slowloris), a bounded number of client connections, a bounded
                    rate of HTTP/2 stream resets (rapid reset).
    WebSocketLimits WebSocket messages of bounded size (after inflating), fragments
                    and control frames, from the client and the upstream alike.
    OriginForm      reverse listeners send the configured upstream's origin-form
                    target, never a client's absolute-form one.
    FieldSyntax     no header value with CR, LF or NUL, no unknown HTTP version passes:
                    a request with them is refused, an answer's are replaced by spaces.
    RequestFraming  an HTTP/2 request body goes to an HTTP/1 upstream with its length.
    LogRedaction    credentials redacted, control characters escaped and lines
                    capped in every log record, mitmproxy's own included.
    SecretRedaction credentials are replaced by "REDACTED" in every flow once its
                    request has gone upstream, before mitmproxy's console dumper,
                    flow savers and mitmweb see the finished flow.
    WebOptions      mitmweb's option editor shows the secrets of proxyauth,
                    upstream_auth and web_password as REDACTED.

mitmweb's own access URL (`http://127.0.0.1:8081/?token=…`) is the one credential the log
keeps: it grants that UI only, which stays on loopback unless `web_password` is set (and
then mitmweb prints no token), and the operator opens the UI with it.

Keys are never written in options: `env:NAME` and `file:PATH` point at them, so
they stay out of mitm.conf, command lines and mitmweb's option editor.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import os
import re
import resource
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.utils import human
from mitmproxy.proxy import mode_specs

from .. import apis, flows, state
from ..apis.api import Api
from ..faults import apierrors
from ..route import members
from ..patches import connections, pins
from ..patches.fixes import (
    answer_on_head, client_resets, eager_connects, head_limit, upstream_copy, web_options, websocket_limits,
)
from ..patches.speed import early_connects
from ..text import (
    MIN_ACCESS_KEY_LENGTH, REDACTED, SECRET_PARAM_NAME, cut_text, is_secret_header, key_digest, know_secrets,
    knows_secrets, redacted_text, redacted_value, safe_log_text, without_known_secrets,
)

logger = logging.getLogger(__name__)

QUERY_SLOT = "?"
"""Leads a credential's slot that is a query parameter (`?key`); other slots are header names."""

DEFAULT_UPSTREAM_KEYS = [
    "api.openai.com=env:OPENAI_API_KEY",
    "api.anthropic.com=env:ANTHROPIC_API_KEY",
    "generativelanguage.googleapis.com=env:GEMINI_API_KEY",
]
HTTP_REVERSE_SCHEMES = ("http", "https", "http3")

"""API families, for the format of the relay's own error answers."""


# --- exposure ---------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether a listen host is this machine only. "" means every interface; names
    other than localhost are not resolved (and so count as exposed). Kept per host:
    `tls.ClientTLS` asks for every request, and parsing the address is most of what
    that hook costs."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_http_reverse(mode: mode_specs.ProxyMode) -> TypeGuard[mode_specs.ReverseMode]:
    return isinstance(mode, mode_specs.ReverseMode) and mode.scheme in HTTP_REVERSE_SCHEMES


def required_protection(mode: mode_specs.ProxyMode) -> str | None:
    """The option that protects a listener of this kind from strangers, or None
    when the relay has nothing to protect it with (transparent, DNS, raw TCP/UDP
    reverse, WireGuard: mitmproxy's own keys, not checked here)."""
    if is_http_reverse(mode):
        # proxyauth would demand Basic credentials here and reject SDKs' API keys.
        return "relay_access_keys"
    if isinstance(mode, (mode_specs.RegularMode, mode_specs.UpstreamMode, mode_specs.Socks5Mode)):
        return "proxyauth"
    return None


CLIENT_TLS_OFF_LOOPBACK, CLIENT_TLS_ALL, CLIENT_TLS_OPTIONAL = "off-loopback", "all", "optional"
"""`relay_client_tls` (ttft_relay/guard/tls.py): which listeners accept only TLS clients."""
TLS_CAPABLE = (mode_specs.ReverseMode, mode_specs.RegularMode, mode_specs.UpstreamMode)
"""Listener kinds on which mitmproxy terminates a client's TLS (socks5 cannot)."""


def requires_tls(client_tls: str, loopback: bool) -> bool:
    """Whether a listener accepts only TLS clients under the `relay_client_tls` policy."""
    return client_tls == CLIENT_TLS_ALL or (client_tls == CLIENT_TLS_OFF_LOOPBACK and not loopback)


def unprotected_listeners(
    modes: Sequence[str], listen_host: str, proxyauth: str | None, access_keys: bool,
    client_tls: str = CLIENT_TLS_OFF_LOOPBACK, certs: bool = False,
) -> list[str]:
    """One line per listener that would serve other machines without authentication,
    or without TLS: off loopback a listener needs both (or `client_tls` optional, the
    explicit opt-out for TLS that ends in front of the relay). TLS means a certificate
    from mitmproxy's `certs`, not one from mitmproxy's own CA."""
    protected = {
        "proxyauth": bool(proxyauth) and proxyauth != "any",  # "any" accepts every password
        "relay_access_keys": access_keys,
    }
    found = []
    for spec in modes:
        mode = mode_specs.ProxyMode.parse(spec)
        if mode.listen_port() is None:  # local/tun modes: no network listener
            continue
        host = mode.listen_host(listen_host)
        if is_loopback(host):
            continue
        needed = required_protection(mode)
        if needed is None:
            found.append(f"{spec} on {host or 'all interfaces'} (the relay cannot protect this kind of listener)")
            continue
        problems = [] if protected[needed] else [f"(set {needed})"]
        if requires_tls(client_tls, loopback=False):
            if not isinstance(mode, TLS_CAPABLE):
                problems.append("without TLS (this kind cannot have it: set relay_client_tls=optional)")
            elif not certs:
                problems.append("without TLS (set certs)")
        if problems:
            found.append(f"{spec} on {host or 'all interfaces'} {' '.join(problems)}")
    return found


def plain_http_listeners(modes: Sequence[str], listen_host: str, client_tls: str) -> list[str]:
    """Listeners off loopback that accept plain HTTP (relay_client_tls=optional)."""
    if client_tls != CLIENT_TLS_OPTIONAL:
        return []
    return [spec for spec in modes if (mode := mode_specs.ProxyMode.parse(spec)).listen_port() is not None
            and not is_loopback(mode.listen_host(listen_host))]


def web_ui_problem(web_host: str, web_password: str) -> str | None:
    """Why mitmweb's UI would be unsafe on `web_host`, or None.

    mitmweb always requires a password or, without one, a random token; but that
    token is printed to the console at every start, so anyone who reads the logs can
    drive a UI that shows every request and answer and can replay them.
    """
    if is_loopback(web_host) or web_password:
        return None
    return (
        f"mitmweb on web_host {web_host or 'all interfaces'} needs web_password "
        "(preferably an argon2 hash; without it the UI token is printed to the console)"
    )


class Exposure:
    """Refuses to serve other machines without authentication. Checked in
    `configure`, so it covers options from the command line, mitm.conf (applied
    before this addon loads) and later changes alike: at start an OptionsError
    makes mitmproxy exit, later it rejects the change."""

    WATCHED = {"mode", "listen_host", "proxyauth", "relay_access_keys", "relay_allow_open_proxy",
               "web_host", "web_password", "relay_client_tls", "certs"}

    def __init__(self) -> None:
        self.last_warning = ""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_allow_open_proxy",
            bool,
            False,
            "Serve non-loopback listeners without proxyauth / relay_access_keys. Only "
            "for relays that a firewall protects.",
        )

    def configure(self, updated: set[str]) -> None:
        if not updated & self.WATCHED:
            return
        opts = ctx.options
        if "web_host" in opts and (problem := web_ui_problem(opts.web_host, opts.web_password)):
            raise exceptions.OptionsError(f"refusing to start: {problem}")
        client_tls = opts.relay_client_tls if "relay_client_tls" in opts else CLIENT_TLS_OFF_LOOPBACK
        exposed = unprotected_listeners(opts.mode, opts.listen_host, opts.proxyauth, bool(opts.relay_access_keys),
                                        client_tls, bool(opts.certs))
        if exposed and not opts.relay_allow_open_proxy:
            raise exceptions.OptionsError(
                "refusing to start as an open proxy: " + "; ".join(exposed) + ". Listen on 127.0.0.1, "
                "or set relay_allow_open_proxy=true if a firewall protects these listeners."
            )
        warning = ""
        if exposed:
            warning = "serving without authentication (relay_allow_open_proxy): " + "; ".join(exposed)
        elif plain := plain_http_listeners(opts.mode, opts.listen_host, client_tls):
            warning = ("accepting plain HTTP off loopback (relay_client_tls=optional), safe only where TLS ends "
                       "in front of the relay: " + "; ".join(plain))
        elif opts.proxyauth and any(is_http_reverse(mode_specs.ProxyMode.parse(m)) for m in opts.mode):
            warning = ("proxyauth applies to reverse listeners too, where it demands Basic credentials "
                       "and so rejects API keys; protect reverse listeners with relay_access_keys instead")
        if warning and warning != self.last_warning:
            logger.warning(warning)
        self.last_warning = warning


# --- access keys --------------------------------------------------------------------


def read_secret(source: str, option: str) -> str:
    """The text behind `env:NAME` or `file:PATH`. Error messages name the source, never a value."""
    kind, _, where = source.partition(":")
    if kind == "env" and where:
        value = os.environ.get(where)
        if value is None:
            raise exceptions.OptionsError(f"{option}: environment variable {where} is not set")
        return value
    if kind == "file" and where:
        try:
            return Path(where).expanduser().read_text(encoding="utf8")
        except OSError as e:
            raise exceptions.OptionsError(f"{option}: cannot read {where}: {e.strerror}") from e
    # Do not echo the entry: it may be a key someone pasted in.
    raise exceptions.OptionsError(f"{option}: entries must be env:NAME or file:PATH")


def parse_keys(text: str) -> list[str]:
    """Keys separated by whitespace, commas or lines; `#` starts a comment."""
    return [key for line in text.splitlines() for key in re.split(r"[\s,]+", line.split("#", 1)[0]) if key]


def load_access_keys(sources: Sequence[str]) -> list[str]:
    keys = [key for source in sources for key in parse_keys(read_secret(source, "relay_access_keys"))]
    if sources and not keys:
        raise exceptions.OptionsError("relay_access_keys: the sources hold no keys")
    if any(len(key) < MIN_ACCESS_KEY_LENGTH for key in keys):
        raise exceptions.OptionsError(f"relay_access_keys: keys must be at least {MIN_ACCESS_KEY_LENGTH} characters")
    return keys


def load_upstream_keys(hosts: Iterable[str], entries: Sequence[str]) -> dict[str, str]:
    """The upstream key for each host in `hosts`, from `HOST=env:NAME|file:PATH` entries."""
    sources: dict[str, str] = {}
    for entry in entries:
        host, sep, source = entry.partition("=")
        if not sep:
            raise exceptions.OptionsError("relay_upstream_keys: entries must be HOST=env:NAME or HOST=file:PATH")
        sources[host.strip().lower()] = source.strip()
    keys = {}
    for host in hosts:
        if host not in sources:
            raise exceptions.OptionsError(
                f"relay_upstream_keys: no key for {host}, the upstream of a reverse listener (add {host}=env:NAME)"
            )
        keys[host] = read_secret(sources[host], "relay_upstream_keys").strip()
        if not keys[host]:
            raise exceptions.OptionsError(f"relay_upstream_keys: the key for {host} ({sources[host]}) is empty")
    return keys


def load_member_keys(groups: dict[str, tuple[members.Member, ...]], keys: dict[str, str]) -> dict[tuple[str, str], str]:
    """{(group, member): its upstream key} for each member of an upstream group: its own key
    source's, else the key `keys` holds for its host (`load_upstream_keys`)."""
    found = {}
    for group, listed in groups.items():
        for member in listed:
            key = keys[member.host] if member.key_source is None else \
                read_secret(member.key_source, members.OPTION).strip()
            if not key:
                raise exceptions.OptionsError(f"{members.OPTION}: the key for {member.name} ({member.key_source}) is empty")
            found[(group, member.name)] = key
    return found


def reverse_upstream_hosts(modes: Sequence[str]) -> set[str]:
    hosts = set()
    for spec in modes:
        mode = mode_specs.ProxyMode.parse(spec)
        if is_http_reverse(mode):
            hosts.add(mode.address[0].lower())
    return hosts


def presented_credentials(request: http.Request) -> dict[str, str]:
    """{slot: credential} for each place some API's clients put their key in
    (`apis.KEY_HEADERS`, `apis.KEY_PARAMS`) and the request carries one: a header name,
    or QUERY_SLOT and a parameter's. A Bearer token counts without its scheme; other
    schemes count whole (and so never match a relay key)."""
    found = {}
    for name in apis.KEY_HEADERS:
        if (value := request.headers.get(name)) is not None:
            scheme, _, token = value.partition(" ")
            found[name] = token.strip() if name == "authorization" and scheme.lower() == "bearer" else value
    for param in apis.KEY_PARAMS:
        if param in request.query:
            found[QUERY_SLOT + param] = request.query[param]
    return found


def rejection(credentials: dict[str, str], digests: Sequence[bytes]) -> str | None:
    """Why the credentials do not admit the request, or None. Every credential
    presented must be a relay key: a request that mixes in anything else is
    ambiguous about which one the upstream should see."""
    if not credentials:
        return "missing relay access key (send it where your SDK sends its API key)"
    for credential in credentials.values():
        presented = key_digest(credential)
        # A list, not a generator: no early exit, every key is compared.
        if not any([hmac.compare_digest(presented, digest) for digest in digests]):
            return "relay access key not accepted"
    return None


def swap_credentials(request: http.Request, slots: Iterable[str], upstream_key: str) -> None:
    """Put the upstream key where the client put its relay key, in the same form:
    each SDK already presents keys the way its API expects them."""
    for slot in slots:
        if slot.startswith(QUERY_SLOT):
            request.query[slot.removeprefix(QUERY_SLOT)] = upstream_key
        elif slot == "authorization":
            request.headers[slot] = f"Bearer {upstream_key}"
        else:
            request.headers[slot] = upstream_key


def api_shape(request: http.Request) -> Api:
    """Which API's error format a client expects. Read from the request itself: this
    runs before the scope addon, and covers paths outside its scope too."""
    return apis.for_refusal(request.path, request.headers)


def refusal(api: Api, status: int, message: str) -> http.Response:
    """The relay's own answer to a request it does not let through."""
    headers = {"www-authenticate": 'Bearer realm="ttft-relay"'} if status == 401 else None
    return apierrors.error_response(api, status, message, headers)


class AccessKeys:
    """Relay access keys for reverse listeners. When `relay_access_keys` is set,
    every request on a reverse HTTP listener, in scope or not, must present a relay
    key; the relay swaps in the upstream key of the listener's host
    (`relay_upstream_keys`) or answers 401 in the API's error format. Proxy
    listeners are unaffected: there clients send their own keys, and proxyauth
    guards the proxy.

    No upstream connection is opened for a client before its key is accepted (no
    eager connect on these listeners); once the key on a request's head is, the
    connect starts while the body uploads (`patches.speed.early_connects`), where a
    lazy connect would wait for the body and the request hooks."""

    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self.upstream_keys: dict[str, str] = {}
        self.member_keys: dict[tuple[str, str], str] = {}
        """Upstream groups' members' keys (`route.members`), by (group, member)."""
        self.refused: weakref.WeakKeyDictionary[http.HTTPFlow, str] = weakref.WeakKeyDictionary()
        """Why the relay answered a flow itself, for its timing record."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_access_keys",
            Sequence[str],
            [],
            "Relay access keys that reverse listeners require (empty: none required). "
            "Entries: env:NAME or file:PATH, each holding keys separated by whitespace, "
            f"commas or lines (# comments); keys have at least {MIN_ACCESS_KEY_LENGTH} characters.",
        )
        loader.add_option(
            "relay_upstream_keys",
            Sequence[str],
            DEFAULT_UPSTREAM_KEYS,
            "With relay_access_keys: the key sent upstream, per upstream host of a reverse "
            "listener, as HOST=env:NAME or HOST=file:PATH. Every reverse listener's host needs one.",
        )
        if pins.on(answer_on_head):
            answer_on_head.install(by="keys")

    def configure(self, updated: set[str]) -> None:
        if not updated & {"relay_access_keys", "relay_upstream_keys", members.OPTION, "mode", pins.SPEED_OPTION}:
            return
        keys = load_access_keys(ctx.options.relay_access_keys)
        upstream_keys, member_keys = {}, {}
        if keys:
            groups = members.parse_groups(getattr(ctx.options, members.OPTION, ()),
                                          members.listener_members(ctx.options.mode))
            hosts = reverse_upstream_hosts(ctx.options.mode) | {
                m.host for group in groups.values() for m in group if m.key_source is None}
            upstream_keys = load_upstream_keys(hosts, ctx.options.relay_upstream_keys)
            member_keys = load_member_keys(groups, upstream_keys)
        self.digests = [key_digest(key) for key in keys]
        self.upstream_keys = upstream_keys
        self.member_keys = member_keys
        know_secrets([*self.digests, *(key_digest(key) for key in [*upstream_keys.values(), *member_keys.values()])])
        # Keyed listeners open no upstream connection before a request's key is checked.
        if pins.on(eager_connects):
            eager_connects.defer(is_http_reverse if keys else None)
        if keys and pins.on(upstream_copy):
            upstream_copy.install(by="keys")
        else:
            upstream_copy.uninstall(by="keys")
        if keys and pins.on(early_connects):
            early_connects.install(by="keys")
        else:
            early_connects.uninstall(by="keys")

    def done(self) -> None:
        eager_connects.defer(None)
        answer_on_head.uninstall(by="keys")
        upstream_copy.uninstall(by="keys")
        early_connects.uninstall(by="keys")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        credentials = presented_credentials(flow.request)
        flows.note_client_key(flow, credentials.values())
        mode = flow.client_conn.proxy_mode
        if not self.digests or flow.response is not None or not is_http_reverse(mode):
            return
        status, reason = 401, rejection(credentials, self.digests)
        upstream_key = self.upstream_keys.get(mode.address[0].lower())
        if reason is None and upstream_key is None:
            # A connection still open on a listener that an option change removed.
            status, reason = 502, "the relay has no upstream key for this listener"
        if reason is not None:
            self.refused[flow] = reason
            # On the head: the body is never read, however large it says it is.
            answer_on_head.answer_now(flow, refusal(api_shape(flow.request), status, reason))
            return
        assert upstream_key is not None  # without one, `reason` says so and the flow was refused above
        # The upstream key goes only into what is sent: mitmweb shows flows in flight.
        swap_credentials(flow.request, credentials, REDACTED)
        upstream_copy.send_upstream_with(flow, lambda request: swap_credentials(
            request, credentials, self.key_for(flow, mode.address[0].lower(), upstream_key)))
        if (handler := connections.handler_of(flow.client_conn)) is not None:
            early_connects.connect_early(handler, flow)

    def key_for(self, flow: http.HTTPFlow, group: str, listener_key: str) -> str:
        """The upstream key for where `flow` goes as it is sent: its upstream group's member's
        (`FlowState.route`, the member it goes to now), else its listener's."""
        st = state.get(flow)
        if st is None or st.route is None:
            return listener_key
        return self.member_keys.get((group, st.route["upstream"]), listener_key)

    def error(self, flow: http.HTTPFlow) -> None:
        # A refused flow ends here (answered, then killed). The scope addon has
        # attached its state meanwhile, so the timing record (written in the same
        # hook, later in the chain) says the relay refused it, not the upstream.
        st = state.get(flow)
        if st is not None and (reason := self.refused.get(flow)) is not None:
            st.record_error(reason, phase="relay")


def _client_transport(side: websocket_limits.MessageLimits) -> Any:
    """The asyncio transport of the client connection `side` reads (None once it is gone)."""
    client = side.conn
    if not isinstance(client, connection.Client):
        return None
    transport = getattr(connections.writer(client, client), "transport", None)
    return transport if transport is not None and not transport.is_closing() else None


def _pause_reading(side: websocket_limits.MessageLimits) -> bool:
    if (transport := _client_transport(side)) is None:
        return False
    transport.pause_reading()
    return True


def _resume_reading(side: websocket_limits.MessageLimits) -> None:
    if (transport := _client_transport(side)) is not None:
        transport.resume_reading()


class WebSocketLimits:
    """WebSocket messages bounded as they are read, from either side
    (`ttft_relay/patches/fixes/websocket_limits.py`): a message's size once inflated
    (`relay_websocket_message_max`, 24 MiB: a permessage-deflate bomb is inflated no
    further), its fragments (4096) and the control frames around them (100 at once, then
    10/s). Past one the socket closes, 1009 or 1008 to both sides, with one warning.

    Why 24 MiB: to know a message is too big the relay must inflate it that far, in one go
    on the event loop, and a deflate bomb inflates slowly (zlib's distance-1 copies: 0.7 s
    for 64 MiB on this machine, every other stream waiting). 24 MiB holds the Realtime API's
    largest event (15 MiB of audio, 20 MiB as base64 JSON) and a turn's images, at about a
    third of that stall."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_websocket_message_max", str, "24m",
            "Largest WebSocket message, from the client or the upstream, once inflated (e.g. 16m, "
            "64m); a larger one closes the socket (1009). 0: no limit.",
        )
        loader.add_option(
            "relay_websocket_inflight_max", str, "64m",
            "WebSocket message bytes clients may have in flight together (read, not yet complete), across the "
            "relay; a client whose message passes it is paused (its socket not read) until there is room. "
            "0: no limit.",
        )

    def configure(self, updated: set[str]) -> None:
        if updated & {"relay_websocket_message_max", "relay_websocket_inflight_max"}:
            sizes = {}
            for name in ("relay_websocket_message_max", "relay_websocket_inflight_max"):
                try:
                    sizes[name] = human.parse_size(getattr(ctx.options, name)) or 0
                except ValueError as e:
                    raise exceptions.OptionsError(f"{name}: {e}") from e
            if pins.on(websocket_limits):
                websocket_limits.install(websocket_limits.Bounds(message_bytes=sizes["relay_websocket_message_max"],
                                                                 total_bytes=sizes["relay_websocket_inflight_max"]),
                                         _pause_reading, _resume_reading)

    def done(self) -> None:
        websocket_limits.uninstall()

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        websocket_limits.ended(flow.client_conn)

    def client_disconnected(self, client: connection.Client) -> None:
        websocket_limits.ended(client)

    def response(self, flow: http.HTTPFlow) -> None:
        # An upstream's 101 whose permessage-deflate parameters wsproto cannot take crashed the
        # connection's handler as the socket started (and every event after). Without them the
        # socket starts uncompressed: a compressed frame from that upstream then closes it 1002,
        # where a client of its own would have failed the connection at the handshake.
        response = flow.response
        if response is None or response.status_code != 101 or "sec-websocket-extensions" not in response.headers:
            return
        header = response.headers["sec-websocket-extensions"]
        kept = websocket_limits.valid_extensions(header)
        if kept != header:
            logger.warning("%s: the upstream's WebSocket handshake answer has invalid extensions, dropped: %r",
                           flow.request.host, header)
            if kept:
                response.headers["sec-websocket-extensions"] = kept
            else:
                del response.headers["sec-websocket-extensions"]


class OriginForm:
    """A reverse listener sends every request to its configured upstream, so the
    target it sends is that upstream's origin-form path. mitmproxy connects to the
    configured upstream but keeps an absolute-form target (`POST
    https://evil.example/v1/…`) in the request line it sends: with relay keys that
    request would carry the upstream key, addressed to someone else. (HTTP/2's
    `:authority` is the Host header, which mitmproxy sets to the upstream already.)"""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if request.authority and request.http_version.startswith("HTTP/1") and is_http_reverse(
            flow.client_conn.proxy_mode
        ):
            request.authority = ""


class RequestFraming:
    """Every request goes upstream with its body's length. HTTP/2 requests need no
    Content-Length (the stream's end ends the body), and mitmproxy translates one for
    an HTTP/1 upstream without adding it: the upstream reads a request without a body,
    then the body's bytes as the start of another request (a body that is itself a
    request head would be smuggled in). The relay buffers request bodies, so the
    length is known by the `request` hook; a Transfer-Encoding is left to frame it."""

    def request(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if (
            request.raw_content
            and request.http_version == "HTTP/2.0"
            and "content-length" not in request.headers
            and "transfer-encoding" not in request.headers
        ):
            request.headers["content-length"] = str(len(request.raw_content))


_UNSAFE_IN_VALUES = re.compile(r"[\r\n\x00]")
HTTP_VERSIONS = frozenset({"HTTP/1.0", "HTTP/1.1", "HTTP/2.0", "HTTP/3"})


def unsafe_fields(headers: http.Headers) -> list[str]:
    """The names of the fields whose values hold a CR, LF or NUL."""
    return [name for name, value in headers.items(multi=True) if _UNSAFE_IN_VALUES.search(value)]


class FieldSyntax:
    """What no HTTP/1 peer should be sent: header values with CR, LF or NUL in them (RFC 9110
    5.5: a recipient MUST reject the message or replace each with SP; a bare CR is a line end
    to some servers: a header smuggled in), and a version the relay does not speak
    (`HTTP/9.9`). mitmproxy passed both on verbatim. A request with them is refused on its
    head (400, or 505 for the version), in the API's format where the path is one; an
    upstream's answer has them replaced by SP."""

    def __init__(self) -> None:
        self.refused: weakref.WeakKeyDictionary[http.HTTPFlow, str] = weakref.WeakKeyDictionary()

    def load(self, loader) -> None:
        if pins.on(answer_on_head):
            answer_on_head.install(by="field syntax")

    def done(self) -> None:
        answer_on_head.uninstall(by="field syntax")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if request.http_version not in HTTP_VERSIONS:
            status, message = 505, f"HTTP version {request.http_version!r} not supported (HTTP/1.1 or HTTP/2)"
        elif names := unsafe_fields(request.headers):
            status, message = 400, f"header value with CR, LF or NUL in it: {', '.join(sorted(set(names)))}"
        else:
            return
        message = cut_text(message)
        self.refused[flow] = message
        answer_on_head.answer_now(flow, apierrors.error_response(api_shape(request), status, message,
                                                                 {"connection": "close"}))

    def error(self, flow: http.HTTPFlow) -> None:
        # As for AccessKeys: the scope addon attached its state meanwhile; the record says why.
        st = state.get(flow)
        if st is not None and (reason := self.refused.get(flow)) is not None:
            st.record_error(reason, phase="relay")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        headers = flow.response.headers if flow.response is not None else None
        if headers is None or not (names := unsafe_fields(headers)):
            return
        logger.debug("%s: CR, LF or NUL in the upstream's %s replaced by spaces", flow.request.host, names)
        for name in {n.lower() for n in names}:
            headers.set_all(name, [_UNSAFE_IN_VALUES.sub(" ", v) for v in headers.get_all(name)])


# --- limits before authentication ---------------------------------------------------

MAX_HEAD_BYTES = 64 * 1024
"""An HTTP/1 request head longer than this gets a 431 (nginx takes 32 KiB, Node 16)."""
RESET_WINDOW_S = 30
"""The window `relay_h2_max_resets` counts in (Netty: 200 resets per 30 s)."""
RESERVED_FDS = 100
"""Descriptors kept for everything but client connections: listeners, logs, the
tokenizer files, a metrics scrape."""


def default_connection_limit(fd_limit: int) -> int:
    """Client connections the relay takes with `fd_limit` descriptors: each client
    connection may hold one upstream connection too."""
    return max(1, (fd_limit - RESERVED_FDS) // 2)


def raise_fd_limit() -> int:
    """The soft limit on open descriptors raised to the hard one (as nginx and Go
    do); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


CONNECTION_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: 48\r\n\r\nttft-relay: connection limit reached, try again\n"
)


class OutOfDescriptors:
    """asyncio's accept loop, out of descriptors (EMFILE), reports it through the event loop's
    exception handler, a traceback each time it retries (147 of them in a log at the limit):
    one warning instead, then one a minute at most, with how often it happened meanwhile.
    Connections wait in the listen queue meanwhile (asyncio retries after a second)."""

    ACCEPT_FAILED = "socket.accept() out of system resource"
    EVERY_S = 60.0

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.previous: Any = None
        self.said_at = 0.0
        self.unsaid = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is None:
            self.loop, self.previous = loop, loop.get_exception_handler()
            loop.set_exception_handler(self._handle)

    def uninstall(self) -> None:
        if self.loop is not None and self.loop.get_exception_handler() == self._handle:
            self.loop.set_exception_handler(self.previous)
        self.loop = None

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != self.ACCEPT_FAILED:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if self.said_at and now - self.said_at < self.EVERY_S:
            self.unsaid += 1
            return
        more = f" ({self.unsaid} more times since)" if self.unsaid else ""
        logger.warning("out of file descriptors, cannot accept connections: %s; they wait in the listen "
                       "queue (relay_max_connections, the open-file limit)%s", context.get("exception"), more)
        self.said_at, self.unsaid = now, 0


class ClientLimits:
    """What a client gets before any authentication: bounded time for each request
    head, and a bounded number of connections.

    - `relay_header_timeout`: a client connection must deliver each request head
      within this many seconds of connecting (or of its previous answer ending);
      otherwise it is closed. mitmproxy's own `tcp_timeout` only bounds silence,
      so a head dribbled one byte at a time (slowloris) held a connection forever.
      Only HTTP listeners (reverse and regular) are timed, and there not tunnels
      (CONNECT), WebSockets or HTTP/2 connections with streams in flight.
    - a request head is at most MAX_HEAD_BYTES (64 KiB), or the client gets a 431.
    - `relay_h2_max_resets`: an HTTP/2 client that resets more streams than this
      within RESET_WINDOW_S gets GOAWAY (ENHANCE_YOUR_CALM) and its connection is
      closed (rapid reset, CVE-2023-44487); every client reset reaches its flow, so a
      reset request never goes upstream and one already there is cancelled.
    - `relay_max_connections`: beyond this many client connections a new one gets
      `503 … connection limit reached` and is closed. At the descriptor limit,
      accepting fails in a loop (a traceback per attempt) and nobody gets an answer;
      the default keeps below that limit (which the relay raises to the hard one).
    """

    def __init__(self) -> None:
        self.header_timeout = 0
        self.max_connections = 0
        self.timers: dict[str, asyncio.TimerHandle] = {}
        """Per client connection id waiting for a request head: its deadline."""
        self.active: dict[str, int] = {}
        """Flows in flight per client connection id."""
        self.refused = 0
        self.out_of_fds = OutOfDescriptors()

    def load(self, loader) -> None:
        if pins.on(head_limit):
            head_limit.limit_request_heads(MAX_HEAD_BYTES)
        loader.add_option(
            "relay_header_timeout", int, 30,
            "Seconds a client connection has for each request head, from connecting or "
            "from its previous answer; 0: no limit.",
        )
        loader.add_option(
            "relay_h2_max_resets", int, 200,
            f"Streams an HTTP/2 client connection may reset within {RESET_WINDOW_S} s; past them it "
            "gets GOAWAY (ENHANCE_YOUR_CALM) and is closed. 0: no limit.",
        )
        loader.add_option(
            "relay_max_connections", int, 0,
            "Client connections served at once; more are refused with a 503. 0: as many as "
            "the limit on open files allows (raised to its hard limit at start).",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_header_timeout" in updated:
            self.header_timeout = max(ctx.options.relay_header_timeout, 0)
        if "relay_h2_max_resets" in updated and pins.on(client_resets):
            client_resets.install(max(ctx.options.relay_h2_max_resets, 0), RESET_WINDOW_S)
        if "relay_max_connections" in updated:
            limit = ctx.options.relay_max_connections
            self.max_connections = limit if limit > 0 else default_connection_limit(raise_fd_limit())

    def running(self) -> None:
        self.out_of_fds.install(asyncio.get_running_loop())

    def done(self) -> None:
        self.out_of_fds.uninstall()
        head_limit.uninstall()
        client_resets.uninstall()

    def client_connected(self, client: connection.Client) -> None:
        if not connections.registered(client):
            return
        if connections.client_count() > self.max_connections:
            if not self.refused:
                logger.warning("connection limit (%d) reached: refusing new connections", self.max_connections)
            self.refused += 1
            client.error = "connection limit reached"
            if (writer := connections.writer(client, client)) is not None:
                writer.write(CONNECTION_REFUSAL)  # mitmproxy closes it next; the close sends this first
            return
        if self.refused and connections.client_count() <= self.max_connections // 2:
            logger.info("connection limit: %d connections refused, accepting again", self.refused)
            self.refused = 0
        self._arm(client)

    def client_disconnected(self, client: connection.Client) -> None:
        self._disarm(client)
        self.active.pop(client.id, None)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow.client_conn)  # a tunnel: what it carries is timed by its own flows

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow.client_conn)
        self.active[flow.client_conn.id] = self.active.get(flow.client_conn.id, 0) + 1

    def response(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        left = self.active.get(client.id, 1) - 1
        self.active[client.id] = left
        # A WebSocket or a tunnel may stay quiet; a finished HTTP exchange waits for the next head.
        if left <= 0 and flow.websocket is None and flow.request.method != "CONNECT" and client.connected:
            self._arm(client)

    def error(self, flow: http.HTTPFlow) -> None:
        self.response(flow)

    def _arm(self, client: connection.Client) -> None:
        self._disarm(client)
        mode = client.proxy_mode
        if self.header_timeout and (is_http_reverse(mode) or isinstance(mode, mode_specs.RegularMode)):
            loop = asyncio.get_running_loop()
            self.timers[client.id] = loop.call_later(self.header_timeout, self._timed_out, client)

    def _disarm(self, client: connection.Client) -> None:
        if timer := self.timers.pop(client.id, None):
            timer.cancel()

    def _timed_out(self, client: connection.Client) -> None:
        self.timers.pop(client.id, None)
        if client in connections.open_on(client):
            logger.info("%s: no request head within %d s, closing", human.format_address(client.peername),
                        self.header_timeout)
            connections.close(client, client)


# --- redaction ----------------------------------------------------------------------


def redact_flow(flow: http.HTTPFlow) -> None:
    """Replace every credential the flow holds: secret request headers, key and
    token query parameters (any case), the relay's own keys wherever they are, what
    its error message quotes of them (mitmproxy's smuggling check quotes header values,
    and the dumper prints the message), and the password proxyauth keeps in the metadata."""
    if flow.error is not None:
        flow.error.msg = redacted_text(flow.error.msg)
    headers = flow.request.headers
    if knows_secrets():
        for name in {name.lower() for name, value in headers.items(multi=True) if without_known_secrets(value) != value}:
            headers.set_all(name, [without_known_secrets(v) for v in headers.get_all(name)])
        flow.request.path = without_known_secrets(flow.request.path)
    for name in {name.lower() for name in headers if is_secret_header(name)}:
        headers.set_all(name, [redacted_value(name, v) for v in headers.get_all(name)])
    query = flow.request.query
    for name in {name for name in query if SECRET_PARAM_NAME.fullmatch(name)}:
        query.set_all(name, [REDACTED] * len(query.get_all(name)))
    if (auth := flow.metadata.get("proxyauth")) is not None:
        flow.metadata["proxyauth"] = (auth[0], REDACTED)


MITMWEB_LOGGERS = frozenset({"mitmproxy.tools.web.master", "mitmproxy.tools.web.webaddons"})
"""mitmweb's own loggers: they print its access URL, never a request."""
_WEB_ACCESS_URL = re.compile(r"(http://[^\s/?]+/\?token=)([0-9a-f]{32})(?![\w-])")
"""mitmweb's access URL with the random token it makes (`secrets.token_hex(16)`)."""


def web_log_text(text: str) -> str:
    """A line of mitmweb's own loggers as `safe_log_text` makes it, with mitmweb's access
    URL whole: its token is what the operator opens the UI with (loopback only, unless
    `web_password` is set, and then mitmweb prints no token)."""
    safe = safe_log_text(text)
    for prefix, token in _WEB_ACCESS_URL.findall(text):
        safe = safe.replace(f"{prefix}{REDACTED}", f"{prefix}{token}", 1)
    return safe


class LogRedaction:
    """Every log record of the process, mitmproxy's own included, passes
    `safe_log_text` before any handler (console, mitmweb's event log, a file) sees
    it (mitmweb's own lines `web_log_text`). mitmproxy logs some requests outside any flow, where flow redaction cannot
    reach: a bad request line, a head the client abandoned, both with the raw bytes
    (`Authorization: Bearer …`, `?key=…`). Done with the standard library's log
    record factory, so no handler is missed. A refused setting (OptionsError) is
    logged as one line with its reason instead of a traceback."""

    def __init__(self) -> None:
        self.previous: Callable[..., logging.LogRecord] | None = None

    def load(self, loader) -> None:
        if self.previous is None:
            self.previous = logging.getLogRecordFactory()
            logging.setLogRecordFactory(self._record)

    def done(self) -> None:
        if self.previous is not None and logging.getLogRecordFactory() == self._record:
            logging.setLogRecordFactory(self.previous)
        self.previous = None

    def _record(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        rec = (self.previous or logging.LogRecord)(*args, **kwargs)
        try:
            message = rec.getMessage()
        except Exception:  # a broken format string: the handler reports it as usual
            return rec
        if rec.exc_info and isinstance(rec.exc_info[1], exceptions.OptionsError):
            # A setting refused (the script loader logs it with a traceback): the
            # reason is the message, one line.
            message, rec.exc_info = f"{message}: {rec.exc_info[1]}", None
        safe = web_log_text(message) if rec.name in MITMWEB_LOGGERS else safe_log_text(message)
        if safe != rec.msg or rec.args:
            rec.msg, rec.args = safe, None
        return rec


class SecretRedaction:
    """Redacts credentials in each flow once its request has gone upstream: at
    `response` and `error`, or at shutdown for flows still in flight (the flow
    saver writes those too). Script addons come before mitmproxy's console dumper
    (flow_detail >= 2 prints headers), savers (save_stream_file, HAR) and mitmweb's
    view in the addon chain, so all of them get the redacted flow. While a request is in
    flight its flow must keep them (mitmproxy sends the request as the flow holds it):
    mitmweb's views of it get `shown_flow`'s redacted copy (`WebOptions`)."""

    def __init__(self) -> None:
        self.in_flight: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()

    def shown_flow(self, flow: Any) -> Any:
        """`flow` as mitmweb may show it: a redacted copy while it is in flight (its own
        redaction is still to come), else the flow itself."""
        if flow not in self.in_flight:
            return flow
        shown = flow.copy()
        shown.id, shown.live = flow.id, flow.live
        redact_flow(shown)
        return shown

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self.in_flight.add(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        redact_flow(flow)
        self.in_flight.discard(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.response(flow)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        redact_flow(flow)  # the dumper prints failed CONNECTs, Proxy-Authorization included

    def done(self) -> None:
        for flow in list(self.in_flight):
            self.response(flow)


SECRET_OPTIONS = ("proxyauth", "upstream_auth", "web_password")
"""mitmproxy options whose values hold a password."""


def shown_option_value(name: str, value: Any) -> Any:
    """An option's value as mitmweb's option editor may show it: the password in
    `proxyauth` (`user:password`, LDAP's bind password), `upstream_auth` and `web_password`
    redacted, `proxyauth`'s `any` and `@htpasswd-file` as they are, and the relay's own
    keys redacted wherever they were pasted."""
    if isinstance(value, str) and value:
        if name == "web_password":
            return REDACTED
        if name == "proxyauth" and value != "any" and not value.startswith("@"):
            if value.startswith(("ldap:", "ldaps:")):  # ldap[s]:server[:port]:bind-dn:password:subtree
                fields = value.split(":")
                return ":".join([*fields[:-2], REDACTED, fields[-1]]) if len(fields) >= 5 else REDACTED
            user, sep, _ = value.partition(":")
            return f"{user}:{REDACTED}" if sep else REDACTED
        if name == "upstream_auth":
            user, sep, _ = value.partition(":")
            return f"{user}:{REDACTED}" if sep else REDACTED
        return without_known_secrets(value)
    if isinstance(value, list | tuple):
        return [shown_option_value(name, v) for v in value]
    return value


class WebOptions:
    """mitmweb's option editor (`GET /options`, and its `options/update` messages) shows
    the passwords of `SECRET_OPTIONS` as REDACTED (ttft_relay/patches/fixes/web_options.py); the
    options keep their values. Its flow views (the list, its live updates, the dump, the
    exports) show a flow in flight redacted (`SecretRedaction.shown_flow`)."""

    def __init__(self, redaction: SecretRedaction) -> None:
        self.redaction = redaction

    def load(self, loader) -> None:
        if pins.on(web_options):
            web_options.install(shown_option_value)
            web_options.install_flows(self.redaction.shown_flow)

    def done(self) -> None:
        web_options.uninstall()


class Guard:
    """The guards as one addon, for relay.py's list."""

    def __init__(self) -> None:
        redaction = SecretRedaction()
        self.addons = [LogRedaction(), Exposure(), ClientLimits(), WebSocketLimits(), FieldSyntax(), OriginForm(),
                       RequestFraming(), AccessKeys(), redaction, WebOptions(redaction)]
