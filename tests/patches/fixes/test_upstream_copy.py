"""Pin test of ttft_relay/patches/fixes/upstream_copy.py (its behaviour: tests/test_guard.py, tests/test_redaction_e2e.py)."""

from __future__ import annotations

from ttft_relay.patches.fixes import upstream_copy
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(upstream_copy.PINS, upstream_copy)


def test_the_lines_it_depends_on():
    # The request's head goes upstream as one SendHttp(RequestHeaders) after the request hook.
    src = source(upstream_copy._ORIGINAL_CONSUME_REQUEST_BODY)
    assert src.index("yield HttpRequestHook(self.flow)") < src.index("RequestHeaders(")
