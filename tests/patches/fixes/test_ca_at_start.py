"""Pin test of ttft_relay/patches/fixes/ca_at_start.py (the addon: capacity.WarmStart; end to end:
tests/test_coldstart_e2e.py)."""

from __future__ import annotations

from mitmproxy.addons import tlsconfig
from mitmproxy.test import taddons

from ttft_relay.patches.fixes import ca_at_start
from ttft_relay.patches.speed import ca_once
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(ca_at_start.PINS, ca_at_start)


def test_the_lines_it_depends_on():
    # mitmproxy loads the store in `running`, and `configure` loads it for "confdir".
    assert 'self.configure("confdir")' in source(tlsconfig.TlsConfig.running)
    assert '"confdir" in updated' in source(tlsconfig.TlsConfig.configure)


def test_a_store_mitmproxy_has_not_loaded_is_loaded_before_the_listeners_accept(tmp_path):
    # With the default confdir mitmproxy loads the store only in `running`, after its
    # listeners are up: a request in between failed, and stopped mitmproxy at start.
    addon = tlsconfig.TlsConfig()
    with taddons.context(addon) as tctx:
        tctx.options.confdir = str(tmp_path)
        addon.certstore = None
        ca_at_start.load(addon)
        assert addon.certstore is not None and (tmp_path / "mitmproxy-ca.pem").exists()
        loaded = addon.certstore
        ca_at_start.load(addon)
        assert addon.certstore is loaded  # loaded once
        ca_once.load_ca_once(addon)  # with the speed patch, `running` keeps it too
        try:
            addon.running()
            assert addon.certstore is loaded
        finally:
            ca_once.load_ca_once(addon, on=False)
