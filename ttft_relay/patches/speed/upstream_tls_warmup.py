"""The upstream TLS context built at start, so the first handshake does not pay for it (no patch).

The first upstream TLS handshake builds mitmproxy's client-side TLS context
(`net_tls.create_proxy_server_context`: the trusted CA bundle, certifi by default,
loaded from disk), inside the handshake: first-use work recorded as the upstream's TLS.
The function is cached by its arguments, so `warm_upstream_tls` calls it at start with
the arguments `TlsConfig.tls_start_server` computes from the options for an upstream
without a client certificate or per-server cipher list (pinned: a change there misses
the cache and brings the cost back, nothing worse).
"""

from __future__ import annotations

from typing import Any

from mitmproxy.addons import tlsconfig
from mitmproxy.net import tls as net_tls

PINS = {
    # the arguments of the upstream TLS context, and its cache
    "TlsConfig.tls_start_server": (tlsconfig.TlsConfig.tls_start_server, "2e2dc9c25670cf64"),
    "create_proxy_server_context": (net_tls.create_proxy_server_context.__wrapped__, "e2d90d71c5744797"),
    "tlsconfig._default_ciphers": (tlsconfig._default_ciphers, "cea126ff70a9694f"),
}


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
