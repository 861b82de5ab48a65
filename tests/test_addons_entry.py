"""addons/relay.py, the entry point the design card names: `mitmdump -s addons/relay.py` and
`mitmweb -s addons/relay.py` from the checkout load the relay's addons, stream and record."""

from __future__ import annotations

import runpy

import pytest

from ttft_relay.workers import free_port
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import MITMWEB, REPO, RELAY_SCRIPT, MitmdumpProcess

ENTRY = REPO / "addons" / "relay.py"
BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def test_it_loads_the_same_addons_in_the_same_order_each_time_afresh():
    package = runpy.run_path(str(RELAY_SCRIPT))["addons"]
    first, again = (runpy.run_path(str(ENTRY))["addons"] for _ in range(2))
    assert [type(a) for a in first] == [type(a) for a in package] and len(first) > 10
    assert not {id(a) for a in first} & {id(a) for a in again}  # a reload gets new objects


@pytest.mark.parametrize("tool", ["mitmdump", "mitmweb"])
def test_the_tools_stream_and_record_through_it(tool, fake, confdir, tmp_path):
    fake.behaviour.gap_ms = 20
    options = {"relay_timing_log": tmp_path / "timing.jsonl", "relay_metrics_listen": ""}
    if tool == "mitmweb":
        options |= {"web_port": free_port(), "web_open_browser": "false"}
    relay = MitmdumpProcess([reverse_to(fake)], confdir, script=ENTRY, options=options)
    if tool == "mitmweb":
        relay.args[0] = str(MITMWEB)
    with relay.start():
        assert f"Loading script {ENTRY}" in relay.text()
        chunks = list(client.stream_post(relay.url() + "/v1/chat/completions", BODY))
        assert b"Hello" in b"".join(c.data for c in chunks)
        # The fake spaces its events 20 ms apart: they arrive spread out, not in one buffered piece
        # (half the pacing: a loaded machine delays one event and the next catches up with it).
        assert len(chunks) > 3 and chunks[-1].at - chunks[0].at >= 0.01 * (len(chunks) - 2)
        (record,) = relay.log.wait(1)
    assert record["api"] == "openai.chat" and record["status"] == 200
