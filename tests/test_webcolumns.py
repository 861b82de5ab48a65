"""mitmweb's flow list gets the Comment column unless the user chose columns."""

from mitmproxy.test import taddons
from mitmproxy.tools.web.web_columns import AVAILABLE_WEB_COLUMNS
from mitmproxy.tools.web.webaddons import WebAddon

from ttft_relay.observe import webcolumns


def test_relay_columns_are_mitmweb_s_own_names():
    assert set(webcolumns.RELAY_WEB_COLUMNS) <= set(AVAILABLE_WEB_COLUMNS)


def test_default_columns_gain_the_comment():
    with taddons.context(WebAddon()) as tctx:
        tctx.master.addons.add(webcolumns.CommentColumn(argv=["mitmweb"]))
        assert tctx.options.web_columns == webcolumns.RELAY_WEB_COLUMNS


def test_a_user_s_columns_are_kept():
    with taddons.context(WebAddon()) as tctx:
        tctx.options.web_columns = ["path", "status"]
        tctx.master.addons.add(webcolumns.CommentColumn(argv=["mitmweb"]))
        assert tctx.options.web_columns == ["path", "status"]


def test_a_user_s_explicit_default_is_kept():
    with taddons.context(WebAddon()) as tctx:
        default = list(tctx.options.web_columns)
        tctx.master.addons.add(webcolumns.CommentColumn(argv=["mitmweb", "--set", f"web_columns={default[0]}"]))
        assert tctx.options.web_columns == default


def test_nothing_to_do_without_mitmweb():
    with taddons.context() as tctx:
        tctx.master.addons.add(webcolumns.CommentColumn(argv=["mitmdump"]))
        assert "web_columns" not in tctx.options
