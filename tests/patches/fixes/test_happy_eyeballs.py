"""Pin test of ttft_relay/patches/fixes/happy_eyeballs.py (end to end: tests/test_dial_e2e.py)."""

from __future__ import annotations

import asyncio

from mitmproxy.proxy import server

from ttft_relay.patches.fixes import happy_eyeballs
from tests.patches.pins import assert_unchanged


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(happy_eyeballs.PINS, happy_eyeballs)


def test_only_open_connection_changes_in_mitmproxys_view_of_asyncio():
    async def opener(*args, **kwargs):
        raise AssertionError("not called here")

    happy_eyeballs.install(opener)
    try:
        assert server.asyncio.open_connection is opener
        assert server.asyncio.sleep is asyncio.sleep and server.asyncio.CancelledError is asyncio.CancelledError
        assert asyncio.open_connection is not opener, "asyncio itself untouched"
    finally:
        happy_eyeballs.uninstall()
    assert server.asyncio is asyncio
