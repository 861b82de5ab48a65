"""Upstream TLS sessions resumed: a new upstream connection's handshake without the certificate.

Every upstream connection the relay opens (a client connection's own, mitmproxy's; one the
upstream pool opens ahead of requests; one for a request the pool could not serve: an HTTP/2
client's, a `keep_host_header` listener's, an HTTPS proxy's, the pool off) made a full TLS
handshake: the certificate chain over the far link, its verification, a key exchange. A
provider that issues session tickets (TLS 1.3 PSK; TLS 1.2 tickets or session ids) lets a
client resume instead: the same round trips on TLS 1.3, but no certificate chain in the
server's flight (several kB, often more than the initial congestion window on a cold path) and
no verification; TLS 1.2 saves a whole round trip. 0-RTT early data is never sent (a replayed
request is the user's bill).

`TlsResumption` keeps the newest session per upstream (address, SNI and the TLS context
mitmproxy made for it: a session only ever goes back to a connection with the same
verification, ciphers and client certificate — pyOpenSSL refuses another context's anyway),
taken from a connection once its first response came (on TLS 1.3 the tickets come after the
handshake, before the server's first bytes of data), and offers it on the next connection to
the same upstream (`tls_start_server`, after mitmproxy's `TlsConfig` made the connection).
`SESSIONS_MAX` upstreams are remembered (the least recently used forgotten first); a
handshake that fails with a session offered forgets it (`handshake_failed`). The record says whether the handshake
a request waited for resumed (`upstream_tls_resumed`, docs/records.md).

`relay_upstream_tls_resumption=false` makes every handshake a full one again.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Any

from mitmproxy import connection, ctx, http
from mitmproxy.tls import TlsData
from OpenSSL import SSL
# pyOpenSSL's own OpenSSL bindings, for what it has no public call for: whether a handshake
# resumed (SSL_session_reused), and a session as bytes and back (i2d/d2i_SSL_SESSION).
from OpenSSL._util import ffi as _ffi
from OpenSSL._util import lib as _openssl

logger = logging.getLogger(__name__)

SESSIONS_MAX = 256
"""Upstreams whose newest session is kept."""

SessionKey = tuple[str, int, str | None, SSL.Context]
"""(host, port, SNI, the TLS context): which connections may take a session."""

_sessions: OrderedDict[SessionKey, bytes] = OrderedDict()
"""The newest session per key, as bytes: each connection gets a copy of its own. (OpenSSL marks
the session an SSL holds unresumable when that SSL is freed without a TLS close, as most
upstream connections end: a session shared with its connection, or among several, was lost
with the first that ended so.)"""
_keys: weakref.WeakKeyDictionary[SSL.Connection, SessionKey] = weakref.WeakKeyDictionary()
"""Each upstream TLS connection made since the start, and its key."""
_established: weakref.WeakKeyDictionary[connection.Server, SSL.Connection] = weakref.WeakKeyDictionary()
"""Upstream connections whose handshake is done (an adopted pooled one too), and their TLS."""
_taken: weakref.WeakSet[SSL.Connection] = weakref.WeakSet()
"""TLS connections whose session was taken already (once each: one is enough)."""
_offered: weakref.WeakSet[SSL.Connection] = weakref.WeakSet()


def resumed(server: connection.Server) -> bool | None:
    """Whether `server`'s TLS handshake resumed a session (None: no TLS handshake known here)."""
    tls = _established.get(server)
    return None if tls is None else bool(_openssl.SSL_session_reused(tls._ssl))


def forget_all() -> None:
    _sessions.clear()


def handshake_failed(tls: SSL.Connection) -> None:
    """`tls`'s handshake failed (mitmproxy's `tls_failed_server`, the pool's own handshakes): if it
    offered a session, the next connection to its upstream makes a full handshake (a server
    that chokes on a resumption, or lost its ticket keys badly, costs one failure, not each)."""
    if tls in _offered and (key := _keys.get(tls)) is not None and _sessions.pop(key, None) is not None:
        logger.debug("upstream TLS handshake to %s:%d failed with a session offered: the next one is a full handshake",
                     key[0], key[1])


def session_bytes(session: SSL.Session) -> bytes:
    """`session` serialised (DER), its ticket, secret and peer certificate included."""
    raw = session._session
    size = _openssl.i2d_SSL_SESSION(raw, _ffi.NULL)
    buffer = _ffi.new("unsigned char[]", size)
    _openssl.i2d_SSL_SESSION(raw, _ffi.new("unsigned char **", buffer))
    return bytes(_ffi.buffer(buffer, size))


def session_from(der: bytes, context: SSL.Context) -> SSL.Session | None:
    """A new session from `session_bytes`, for a connection made with `context` (None: unreadable)."""
    buffer = _ffi.new("unsigned char[]", der)
    raw = _openssl.d2i_SSL_SESSION(_ffi.NULL, _ffi.new("unsigned char **", buffer), len(der))
    if raw == _ffi.NULL:
        return None
    session = SSL.Session.__new__(SSL.Session)
    session._session = _ffi.gc(raw, _openssl.SSL_SESSION_free)
    session._context = context  # set_session checks it is the connection's
    return session


def _key(data: TlsData) -> SessionKey | None:
    server = data.conn
    if not isinstance(server, connection.Server) or server.address is None or data.ssl_conn is None:
        return None
    host, port = server.address[0], server.address[1]
    return str(host), int(port), server.sni, data.ssl_conn.get_context()


class TlsResumption:
    """Upstream TLS handshakes resume the upstream's last session (see the module docstring)."""

    def load(self, loader: Any) -> None:
        loader.add_option(
            "relay_upstream_tls_resumption", bool, True,
            "Resume the upstream's last TLS session on a new upstream connection (session tickets: no "
            "certificate chain over the link, no verification; on TLS 1.2 one round trip less). Off: "
            "a full handshake on every upstream connection. Never sends early (0-RTT) data.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_upstream_tls_resumption" in updated and not ctx.options.relay_upstream_tls_resumption:
            forget_all()

    def done(self) -> None:
        forget_all()

    def tls_start_server(self, data: TlsData) -> None:
        # The relay's addons come before mitmproxy's TlsConfig (a script's addons sit at the
        # script loader's place): it makes the connection here, and leaves one made alone
        # when its own turn comes (as for any addon that provides `ssl_conn`).
        if not ctx.options.relay_upstream_tls_resumption or data.is_dtls:
            return
        if data.ssl_conn is None and (tlsconfig := ctx.master.addons.get("tlsconfig")) is not None:
            tlsconfig.tls_start_server(data)
        if (key := _key(data)) is None:
            return
        assert data.ssl_conn is not None
        _keys[data.ssl_conn] = key
        if (der := _sessions.get(key)) is None:
            return
        _sessions.move_to_end(key)
        if (session := session_from(der, key[3])) is None:
            del _sessions[key]
            return
        data.ssl_conn.set_session(session)
        _offered.add(data.ssl_conn)

    def tls_established_server(self, data: TlsData) -> None:
        if isinstance(data.conn, connection.Server) and data.ssl_conn is not None:
            _established[data.conn] = data.ssl_conn

    def tls_failed_server(self, data: TlsData) -> None:
        if data.ssl_conn is not None:
            handshake_failed(data.ssl_conn)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        # The first response on a connection came after its session tickets (TLS 1.3 sends them
        # after the handshake, before data): its session is a resumable one now.
        tls = _established.get(flow.server_conn)
        if tls is None or tls in _taken or not ctx.options.relay_upstream_tls_resumption:
            return
        _taken.add(tls)
        if (key := _keys.get(tls)) is None or (session := tls.get_session()) is None:
            return
        _sessions[key] = session_bytes(session)
        _sessions.move_to_end(key)
        while len(_sessions) > SESSIONS_MAX:
            _sessions.popitem(last=False)
