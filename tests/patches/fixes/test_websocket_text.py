"""Pin test of ttft_relay/patches/fixes/websocket_text.py, and what it changes in the frames
mitmproxy makes of a changed text message (end to end: tests/test_trim_clients_e2e.py, Codex
over its WebSocket with newest-first trimming)."""

from __future__ import annotations

import pytest
from mitmproxy.proxy.layers.websocket import Fragmentizer

from tests.patches.pins import assert_unchanged, source
from ttft_relay.patches.fixes import websocket_text


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(websocket_text.PINS, websocket_text)


def test_the_lines_it_depends_on():
    # Each piece of a changed text message is decoded alone, a character split between two replaced.
    assert 'data.decode(errors="replace")' in source(websocket_text._ORIGINAL_MSG)
    assert "FRAGMENT_SIZE" in source(Fragmentizer.__call__)


@pytest.fixture
def installed():
    websocket_text.install()
    try:
        yield
    finally:
        websocket_text.uninstall()
    assert Fragmentizer.msg is websocket_text._ORIGINAL_MSG


def pieces(content: bytes, original: list[bytes], is_text: bool = True) -> list:
    return list(Fragmentizer(original, is_text)(content))


# Chinese at every offset around the 4,000-byte piece boundary, and an emoji (4 bytes).
CHANGED = [("x" * n + "返回错误 🙂" * 700).encode() for n in range(3990, 4000)]


@pytest.mark.parametrize("content", CHANGED, ids=lambda c: str(len(c)))
def test_a_changed_text_message_keeps_its_characters(installed, content):
    events = pieces(content, [b"the message as it came"])
    assert len(events) > 1 and "".join(e.data for e in events).encode() == content
    assert [e.message_finished for e in events] == [False] * (len(events) - 1) + [True]


def test_without_it_a_split_character_is_replaced():
    events = pieces(CHANGED[0], [b"the message as it came"])
    assert "\ufffd" in "".join(e.data for e in events)


def test_what_it_leaves_as_mitmproxy_had_it(installed):
    # Not UTF-8 at all: replaced, as mitmproxy does; binary: as it was; the sizes it came in.
    assert "".join(e.data for e in pieces(b"ab\xff" * 3000, [])) == "ab\ufffd" * 3000
    binary = bytes(range(256)) * 40
    assert b"".join(e.data for e in pieces(binary, [], is_text=False)) == binary
    same = "返回".encode()
    assert [e.data for e in pieces(same, [same[:4], same[4:]])] == ["返", "回"]


def test_it_installs_and_uninstalls():
    websocket_text.install()
    assert websocket_text.installed() and Fragmentizer.msg is websocket_text._msg
    websocket_text.uninstall()
    assert not websocket_text.installed() and Fragmentizer.msg is websocket_text._ORIGINAL_MSG
