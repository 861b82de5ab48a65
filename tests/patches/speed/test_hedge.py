"""Pin test of ttft_relay/patches/speed/hedge.py (end to end: tests/test_groups_e2e.py's hedges)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpLayer, HttpStream
from mitmproxy.test import tflow

from ttft_relay.patches import connections, layer_events
from ttft_relay.patches.speed import hedge
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(hedge.PINS, hedge)
    assert hedge.USES == (layer_events, connections)


def test_the_lines_it_depends_on():
    routed = source(HttpLayer.event_to_child)
    assert "stream = self.streams[command.event.stream_id]" in routed
    assert "conn = self.connections[command.connection]" in routed
    assert "self.command_sources[command] = child" in routed
    assert "stream = self.command_sources.pop(event)" in source(HttpLayer.get_connection)
    waiting = source(HttpStream.state_wait_for_response_headers).split("\n")
    assert waiting[4].strip() == "self.flow.response = event.response"  # before anything else
    assert "event.stream_id" not in source(HttpStream._handle_event)


def test_on_and_off():
    hedge.uninstall()
    hedge.install()
    try:
        assert hedge.installed()
    finally:
        hedge.uninstall()
    assert not hedge.installed()


def test_off_nothing_is_handed_and_nothing_races():
    hedge.uninstall()
    flow = tflow.tflow()
    started = []
    hedge.race(object(), flow, flow.request.copy(), lambda flow: None, started.append)
    assert started == [False] and not hedge.racing(flow) and not hedge.first_failed(flow)
    hedge.lose_second(flow)  # nothing to lose
