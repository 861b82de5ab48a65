"""A reverse proxy's eager upstream connect: answered when it fails, skipped where a key is checked first.

An eager upstream connect that fails (refused, DNS, connect timeout) makes mitmproxy's
`ReverseProxy` close the client connection before a request is read: no response, no
flow, no record. Its top layer is made directly, not through the `next_layer` hook, so
no hook can swap it. With `read_request_after_failure` (which `error_replies` turns
on) the wrap of `DestinationKnown.finish_start` carries on into the HTTP layer instead,
for reverse proxies only: the request is read, and the HTTP layer's own connection
lookup reports the failed connection's error on that flow, as a lazy connect would
(`HttpLayer.get_connection`: `self.context.server.error`).

The same wrap skips the eager connect for the listeners `defer` names (reverse
listeners with relay access keys: no client gets an upstream connection opened for it
before its request's key was checked; the upstream pool's listeners: a pooled connection
is taken when the request's head is here). Those flows connect as
`connection_strategy=lazy` would, after the request hooks (or once the key on the head
is accepted, `speed.early_connects`).

A TLS client makes the same eager connect another way: `TlsConfig.tls_clienthello`
asks for the upstream's TLS first (`establish_server_tls_first`, under the eager
strategy, to offer the client what the upstream speaks), so every TLS client of a keyed
listener got an upstream connection during its handshake, before any request (5 idle
TLS clients: 5 upstream connections). The wrap of `tls_clienthello` clears that for
the deferred listeners; their client's ALPN is chosen as under the lazy strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import tls
from mitmproxy.addons import tlsconfig
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers import tls as tls_layers
from mitmproxy.proxy.layers.http import HttpLayer

logger = logging.getLogger(__name__)

_ORIGINAL_FINISH_START = modes.DestinationKnown.finish_start
_ORIGINAL_TLS_CLIENTHELLO = tlsconfig.TlsConfig.tls_clienthello
ORIGINALS = {
    (modes.DestinationKnown, "finish_start"): _ORIGINAL_FINISH_START,
    (tlsconfig.TlsConfig, "tls_clienthello"): _ORIGINAL_TLS_CLIENTHELLO,
}
PINS = {
    "DestinationKnown.finish_start": (_ORIGINAL_FINISH_START, "91f47432073a2bf6"),
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
    "TlsConfig.tls_clienthello": (_ORIGINAL_TLS_CLIENTHELLO, "d85ce5b87dbdaf61"),
    # where a TLS client's hello makes the upstream connect first
    "ClientTLSLayer.receive_handshake_data": (tls_layers.ClientTLSLayer.receive_handshake_data, "a0ee021f92f6d0ff"),
}
_deferred: dict[str, Callable[[Any], bool]] = {}
"""Who defers eager connects, and on which listeners (by their proxy mode)."""
_read_after_failure = False


def defer(listener: Callable[[Any], bool] | None, by: str = "keys") -> None:
    """Skip the eager upstream connect on listeners for which `listener(proxy_mode)`
    holds (None: on none), for `by` (relay keys, the upstream pool): on the listeners
    any of them names."""
    if listener is None:
        _deferred.pop(by, None)
    else:
        _deferred[by] = listener
    _apply()


def _deferring(mode: Any) -> bool:
    return any(listener(mode) for listener in _deferred.values())


def deferred(mode: Any, *, besides: str) -> bool:
    """Whether another than `besides` skips the eager connect on `mode`'s listener (the relay keys do)."""
    return any(listener(mode) for by, listener in _deferred.items() if by != besides)


def read_request_after_failure(on: bool) -> None:
    """A reverse proxy whose eager connect failed reads the request, whose flow then
    fails with that connection's error."""
    global _read_after_failure
    _read_after_failure = on
    _apply()


def uninstall() -> None:
    _deferred.clear()
    read_request_after_failure(False)


def _apply() -> None:
    wrapped = bool(_deferred) or _read_after_failure
    modes.DestinationKnown.finish_start = _finish_start if wrapped else _ORIGINAL_FINISH_START  # type: ignore[method-assign]
    # assignment: mitmproxy's tls_clienthello has no return annotation; mypy then reads it as taking a second self.
    tlsconfig.TlsConfig.tls_clienthello = (  # type: ignore[method-assign]
        _tls_clienthello if _deferred else _ORIGINAL_TLS_CLIENTHELLO  # type: ignore[assignment]
    )


def _tls_clienthello(self: tlsconfig.TlsConfig, data: tls.ClientHelloData) -> None:
    _ORIGINAL_TLS_CLIENTHELLO(self, data)
    if _deferring(data.context.client.proxy_mode):
        data.establish_server_tls_first = False


def _finish_start(self: modes.DestinationKnown) -> layer.CommandGenerator[str | None]:
    if _deferring(self.context.client.proxy_mode):
        # What the original does without an eager connect.
        self._handle_event = self.child_layer.handle_event  # type: ignore[method-assign]
        yield from self.child_layer.handle_event(events.Start())
        return None
    err = yield from _ORIGINAL_FINISH_START(self)
    if err and isinstance(self, modes.ReverseProxy) and _read_after_failure:
        logger.debug("eager upstream connect failed (%s); reading the request to answer it", err)
        self._handle_event = self.child_layer.handle_event
        yield from self.child_layer.handle_event(events.Start())
        return None
    return err
