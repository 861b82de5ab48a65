"""Pin test of ttft_relay/patches/fixes/error_replies.py (its behaviour end to end: tests/test_faults_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HttpStream

from ttft_relay.patches.fixes import eager_connects, error_replies
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(error_replies.PINS, error_replies)


def test_the_lines_it_depends_on():
    # The error goes to the client as one SendHttp, after the error hook.
    src = source(error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR)
    assert src.index("yield HttpErrorHook(self.flow)") < src.index("yield SendHttp(event, self.context.client)")


def test_install_and_uninstall_restore_mitmproxys_code():
    eager_connects.uninstall()  # an earlier test's keyed listeners
    error_replies.uninstall()  # and an earlier test's ErrorReplies (loaded to declare options)
    original_error, original_start = HttpStream.handle_protocol_error, modes.DestinationKnown.finish_start
    error_replies.install(lambda flow, message, head_sent: None)
    try:
        assert error_replies.installed()
        assert HttpStream.handle_protocol_error is not original_error
        assert modes.DestinationKnown.finish_start is not original_start
    finally:
        error_replies.uninstall()
    assert HttpStream.handle_protocol_error is original_error
    assert modes.DestinationKnown.finish_start is original_start
    assert not error_replies.installed()


def test_handlers_instead_of_errors_are_asked_in_order_a_first_one_before_the_others():
    asked = []

    def handler(name):
        return lambda stream, event: asked.append(name)  # returns None: the next is asked

    try:
        error_replies.instead_of_errors("pool", handler("pool"))
        error_replies.instead_of_errors("groups", handler("groups"))
        error_replies.instead_of_errors("groups' own", handler("groups' own"), first=True)
        for ask in error_replies._instead.values():
            ask(None, None)
        assert asked == ["groups' own", "pool", "groups"]
    finally:
        for by in ("pool", "groups", "groups' own"):
            error_replies.instead_of_errors(by, None)
    assert not error_replies._instead
