"""Pin test of ttft_relay/patches/layer_events.py, the seam of the events the relay hands
mitmproxy's HTTP layer (its uses: tests/patches/fixes/test_stream_resets.py,
tests/patches/speed/test_early_connects.py; end to end: tests/test_h2_e2e.py, tests/test_preauth_e2e.py)."""

from __future__ import annotations

from dataclasses import dataclass

from mitmproxy.proxy.layers.http import HttpLayer

from ttft_relay.patches import layer_events
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(layer_events.PINS, layer_events)


def test_the_lines_it_depends_on():
    # Any event the layer does not know ends in an AssertionError: the wrap must see ours first.
    assert "raise AssertionError(f\"Unexpected event: {event}\")" in source(layer_events._ORIGINAL_HANDLE_EVENT)


@dataclass
class _Asked(layer_events.FlowEvent):
    pass


@dataclass
class _Other(layer_events.FlowEvent):
    pass


def test_the_wrap_is_in_while_some_event_is_handled():
    layer_events.uninstall()
    layer_events.handle(_Asked, lambda http_layer, event: iter(()))
    layer_events.handle(_Other, lambda http_layer, event: iter(()))
    try:
        assert HttpLayer._handle_event is not layer_events._ORIGINAL_HANDLE_EVENT
        layer_events.unhandle(_Asked)
        assert HttpLayer._handle_event is not layer_events._ORIGINAL_HANDLE_EVENT
        assert layer_events.handled(_Other) and not layer_events.handled(_Asked)
    finally:
        layer_events.unhandle(_Other)
    assert HttpLayer._handle_event is layer_events._ORIGINAL_HANDLE_EVENT


def test_an_event_nobody_handles_is_not_handed_and_its_sender_hears_so():
    layer_events.uninstall()
    heard = []

    class Handler:
        async def server_event(self, event):  # pragma: no cover - must not be reached
            raise AssertionError("handed")

    layer_events.hand(Handler(), _Asked(flow=None), heard.append)  # type: ignore[arg-type]
    assert heard == [False]
