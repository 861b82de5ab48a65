"""mitmproxy's CA is loaded once at start, not again just after the listeners are up.

`TlsConfig.running` loads the CA again (`configure("confdir")`, a workaround for a
configure call that sometimes never comes): 40 ms of key parsing on the event loop just
after the listeners are up, which the first request's upstream connect absorbs.
`load_ca_once` marks a TlsConfig whose store is already loaded (by then mitmproxy has
configured it with every option, and `fixes.ca_at_start` loaded one it had not); the
wrap of `running` skips the reload for it. Any later change of a CA option still reloads
in `configure`, which the wrap does not touch.
"""

from __future__ import annotations

from mitmproxy.addons import tlsconfig

from ..fixes import ca_at_start

_ORIGINAL_TLS_RUNNING = tlsconfig.TlsConfig.running
ORIGINALS = {(tlsconfig.TlsConfig, "running"): _ORIGINAL_TLS_RUNNING}
USES = (ca_at_start,)
PINS = {
    "TlsConfig.running": (_ORIGINAL_TLS_RUNNING, "b65f52307d81dc76"),
}
_CA_CURRENT = "_ttft_relay_ca_current"


def load_ca_once(addon: tlsconfig.TlsConfig | None, on: bool = True) -> None:
    """`addon` keeps the CA it loaded instead of loading it again in `running`."""
    tlsconfig.TlsConfig.running = _tls_running if on else _ORIGINAL_TLS_RUNNING  # type: ignore[method-assign]
    if addon is not None:
        setattr(addon, _CA_CURRENT, on and addon.certstore is not None)


def uninstall() -> None:
    load_ca_once(None, on=False)


def _tls_running(self: tlsconfig.TlsConfig) -> None:
    if getattr(self, _CA_CURRENT, False) and self.certstore is not None:
        return
    _ORIGINAL_TLS_RUNNING(self)
