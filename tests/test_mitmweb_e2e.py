"""End to end in mitmweb: a relayed stream is listed with its timing and shown as events.

"Watched in mitmweb" is how users look at the relay, and mitmweb's own addons (its
flow view among them) ride on the hook dispatch the relay replaces with plans
(`relay_hook_plans`), so both dispatches are checked.
"""

from __future__ import annotations

import time
import urllib.request

import orjson
import pytest

from ttft_relay.workers import free_port
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import MITMWEB, MitmdumpProcess

PASSWORD = "correct-horse-battery"
WAIT = 20  # seconds: a bound that turns a hang into a failure, not a sync
BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def web_get(port: int, path: str):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {PASSWORD}"})
    with urllib.request.urlopen(req, timeout=WAIT) as resp:
        return orjson.loads(resp.read())


@pytest.mark.parametrize("plans", [True, False], ids=["hook plans", "mitmproxy's dispatch"])
def test_mitmweb_shows_a_relayed_stream(plans, fake, confdir, tmp_path):
    web_port = free_port()
    relay = MitmdumpProcess([reverse_to(fake)], confdir, options={
        "web_port": web_port, "web_open_browser": "false", "web_password": PASSWORD,
        "relay_hook_plans": str(plans).lower(), "relay_timing_log": tmp_path / "timing.jsonl",
        "termlog_verbosity": "debug"})
    relay.args[0] = str(MITMWEB)
    with relay.start():
        relay.wait_for_output("Web server listening")
        relay.wait_for_output("events dispatched " + ("from hook plans" if plans else "by mitmproxy"))
        # mitmweb listens before it loads the relay: a request sent before the relay runs is
        # rightly `relay starting`. GcTuning's line comes from the last `running` hook.
        relay.wait_for_output("objects of the start-up heap alone")
        streamed = b"".join(chunk.data for chunk in client.stream_post(relay.url() + "/v1/chat/completions", BODY))
        assert b"Hello" in streamed

        deadline = time.monotonic() + WAIT
        while not (flows := [f for f in web_get(web_port, "/flows") if f.get("comment")]):
            assert time.monotonic() < deadline, "mitmweb never showed the flow with its timing comment"
            time.sleep(0.05)  # poll interval
        (flow,) = flows
        assert flow["request"]["path"] == "/v1/chat/completions"
        assert flow["response"]["status_code"] == 200
        assert flow["comment"].startswith("ok · ttft ")

        view = web_get(web_port, f"/flows/{flow['id']}/response/content/event-stream.json")
        assert view["view_name"] == "Event stream"
        assert "Hello" in orjson.dumps(view["text"]).decode()
