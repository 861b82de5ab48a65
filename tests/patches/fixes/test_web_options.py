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


def test_the_lines_the_flow_views_depend_on():
    # Every view of a flow mitmweb sends goes through the module's `flow_to_json` or `io`, looked
    # up at call time; the exports format through `export.formats`, looked up at call time.
    assert "flow_to_json(f) for f in self.view" in source(app.Flows.get)
    assert "flow_json = flow_to_json(f)" in source(app.ClientConnection.broadcast_flow)
    assert "fw = io.FlowWriter(bio)" in source(app.DumpFlows.get)
    from mitmproxy.addons import export

    assert "content = formats[format](f)" in source(export.Export.export_str)


def test_the_flow_wrap_installs_shows_and_uninstalls():
    from mitmproxy.addons import export
    from mitmproxy.test import tflow

    f = tflow.tflow()
    f.request.headers["authorization"] = "Bearer secret"

    def shown(flow):
        copy = flow.copy()
        copy.request.headers["authorization"] = "hidden"
        return copy

    web_options.install_flows(shown)
    try:
        assert app.flow_to_json(f)["request"]["headers"][-1] == ("authorization", "hidden")
        assert b"hidden" in export.formats["raw_request"](f) and b"secret" not in export.formats["raw_request"](f)
        assert app.io.FlowWriter is not web_options.io.FlowWriter
    finally:
        web_options.uninstall_flows()
    assert app.flow_to_json(f)["request"]["headers"][-1] == ("authorization", "Bearer secret")
    assert app.io is web_options.io and b"secret" in export.formats["raw_request"](f)
    assert f.request.headers["authorization"] == "Bearer secret"
