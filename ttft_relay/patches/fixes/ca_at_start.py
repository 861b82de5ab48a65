"""mitmproxy's CA is loaded while the relay loads, before the listeners accept (no patch).

With `confdir` at its default (every user's case; the tests set it), mitmproxy loads its
CA store only in `TlsConfig.running`, after the listeners are up (the `configure` call
with "confdir" it expects never comes: a FIXME there says so). A request let in before
that (the relay's start waits on the upstreams' name lookups, `capacity.WarmStart`)
failed in TlsConfig's `request` hook and, that early, stopped mitmproxy ("Error logged
during startup, exiting"). `load` loads such a store as `running` would, while the relay
loads.
"""

from __future__ import annotations

from mitmproxy.addons import tlsconfig

PINS = {
    # running loads the CA (again); configure (re)loads it on "confdir" and every CA option
    "TlsConfig.running": (tlsconfig.TlsConfig.running, "b65f52307d81dc76"),
    "TlsConfig.configure": (tlsconfig.TlsConfig.configure, "efea05bd816190dc"),
}
WITHOUT = ("mitmproxy loads its CA only once its listeners are up: a request arriving in between (the "
           "first half second of a start) may fail, and stop mitmproxy while it starts")


def load(addon: tlsconfig.TlsConfig | None) -> None:
    """`addon`'s CA store loaded now if mitmproxy has not loaded it yet."""
    if addon is not None and addon.certstore is None:
        addon.configure({"confdir"})  # what its `running` does, before the listeners accept
