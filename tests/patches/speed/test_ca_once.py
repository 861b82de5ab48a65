"""Pin test of ttft_relay/patches/speed/ca_once.py (the addon: tests/test_capacity.py)."""

from __future__ import annotations

from mitmproxy.addons import tlsconfig
from mitmproxy.test import taddons

from ttft_relay.patches.speed import ca_once
from tests.patches.pins import assert_unchanged


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(ca_once.PINS, ca_once)


def test_the_ca_loaded_at_start_is_not_loaded_again_when_running(tmp_path):
    addon = tlsconfig.TlsConfig()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, confdir=str(tmp_path))
        loaded = addon.certstore
        ca_once.load_ca_once(addon)
        try:
            addon.running()
            assert addon.certstore is loaded  # kept, not loaded again
            tctx.configure(addon, key_size=3072)  # a CA option changed: configure reloads as ever
            assert addon.certstore is not loaded
            other = tlsconfig.TlsConfig()  # a store never loaded: running loads it, as mitmproxy does
            with taddons.context(other):
                ca_once.load_ca_once(other)
                other.certstore = None
                other.running()
                assert other.certstore is not None
        finally:
            ca_once.load_ca_once(addon, on=False)
    assert tlsconfig.TlsConfig.running is ca_once._ORIGINAL_TLS_RUNNING
