"""Pin test of ttft_relay/patches/fixes/web_options.py (end to end: tests/test_mitmweb_e2e.py)."""

from __future__ import annotations

import inspect

from mitmproxy import optmanager, options
from mitmproxy.tools.web import app, master

from ttft_relay.patches.fixes import web_options
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(web_options.PINS, web_options)


def test_the_lines_it_depends_on():
    # mitmweb's two option dumps call the module's function at call time (so the wrap reaches
    # both), and each dumped option carries its value under "value".
    assert "optmanager.dump_dicts(self.master.options)" in source(app.Options.get)
    assert "optmanager.dump_dicts(self.options, updated)" in source(master.WebMaster._sig_options_update)
    assert '"value": o.current(),' in source(web_options._ORIGINAL_DUMP_DICTS)
    assert not [m for m in inspect.getmembers(app) if m[1] is web_options._ORIGINAL_DUMP_DICTS]


def test_the_wrap_installs_shows_and_uninstalls():
    opts = options.Options(listen_host="10.1.2.3")
    web_options.install(lambda name, value: "hidden" if name == "listen_host" else value)
    try:
        assert optmanager.dump_dicts is web_options._dump_dicts
        assert optmanager.dump_dicts(opts, ["listen_host"])["listen_host"]["value"] == "hidden"
        assert optmanager.dump_dicts(opts)["listen_port"]["value"] is None
        assert opts.listen_host == "10.1.2.3"
    finally:
        web_options.uninstall()
    assert optmanager.dump_dicts is web_options._ORIGINAL_DUMP_DICTS
    assert optmanager.dump_dicts(opts, ["listen_host"])["listen_host"]["value"] == "10.1.2.3"
