"""Pin test of ttft_relay/patches/speed/upstream_tls_warmup.py: the context it builds is the one mitmproxy's first handshake uses."""

from __future__ import annotations

import pytest
from mitmproxy import connection, tls
from mitmproxy.addons import tlsconfig
from mitmproxy.net import tls as net_tls
from mitmproxy.proxy import context
from mitmproxy.test import taddons

from ttft_relay.patches.speed import upstream_tls_warmup
from tests.patches.pins import assert_unchanged


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(upstream_tls_warmup.PINS, upstream_tls_warmup)


@pytest.mark.parametrize("options", [{}, {"ssl_insecure": True}, {"tls_version_server_min": "TLS1_2"}])
def test_the_warmed_upstream_tls_context_is_the_one_the_first_handshake_uses(options, certs):
    addon = tlsconfig.TlsConfig()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, ssl_verify_upstream_trusted_ca=str(certs.ca_pem), **options)
        net_tls.create_proxy_server_context.cache_clear()
        upstream_tls_warmup.warm_upstream_tls(tctx.options)
        assert net_tls.create_proxy_server_context.cache_info().misses == 1
        ctx_ = context.Context(connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2)), tctx.options)
        ctx_.server.address = ("api.example.com", 443)
        addon.tls_start_server(tls.TlsData(ctx_.server, context=ctx_))
        info = net_tls.create_proxy_server_context.cache_info()
        assert (info.hits, info.misses) == (1, 1)  # built once, at start
