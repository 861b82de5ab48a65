"""An upstream name with a black-holed IPv6 address, through a real mitmdump (ttft_relay/dial.py).

The upstream's name resolves to [::1] and 127.0.0.1 (the relay runs in a mount namespace of its
own whose /etc/hosts says so); [::1] on the fake's port answers no SYN (a listener whose queue
is full: a dead IPv6 route, for real), 127.0.0.1 is the fake. Racing the addresses, the relay
answers and its record names the family it used and the address that failed. Connecting in
turn (mitmproxy's own connect, `relay_connect_attempt_delay=0`) the same request waits on the
black hole for the kernel's SYN retries (~31 s here) or the connect deadline, and its record
has no `upstream_dial`: the test fails without the race.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAKE_OPENAI_KEY
from ttft_relay.testing.fakes.black_hole import BlackHole, hosts_file, with_hosts
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import MitmdumpProcess, TimingLog

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare(1) for a mount namespace with its own /etc/hosts")

NAME = "dual.test"
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def dual_stack_upstream(tmp_path) -> Iterator[tuple[int, Path]]:
    """The fake on 127.0.0.1:PORT, a black hole on [::1]:PORT, and a hosts file naming both."""
    with FakeUpstream() as fake, BlackHole(socket.AF_INET6, "::1", fake.port):
        yield fake.port, hosts_file(tmp_path / "hosts", {NAME: ["::1", "127.0.0.1"]})


def relay_seeing(hosts: Path, port: int, confdir: Path, log: Path, **options: object) -> MitmdumpProcess:
    from ttft_relay import config

    relay = MitmdumpProcess([f"reverse:http://{NAME}:{port}@0"], confdir, options={
        **config.MITMPROXY_DEFAULTS, "relay_timing_log": log, "relay_metrics_listen": "", "relay_timing_console": False,
        # Each client connection's own connect, whose record tells it: the pool's connects race
        # the addresses too, but a request on a pooled connection opened none of its own.
        "relay_upstream_pool": False, **options})
    relay.args = with_hosts(hosts, relay.args)
    return relay.start()


def ask(relay: MitmdumpProcess, rid: str) -> int:
    with HttpConnection(f"http://127.0.0.1:{relay.port}") as conn:
        response = conn.request("POST", "/v1/chat/completions", CHAT,
                                {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": rid})
        response.read()
        return response.status


def test_a_black_holed_ipv6_address_is_raced_past_and_named(dual_stack_upstream, confdir, tmp_path):
    port, hosts = dual_stack_upstream
    log = TimingLog(tmp_path / "raced.jsonl")
    relay = relay_seeing(hosts, port, confdir, log.path)
    try:
        assert ask(relay, "raced") == 200
        (rec,) = log.of("raced")
        assert ask(relay, "next") == 200  # a new client connection: a connect of its own
        (next_rec,) = log.of("next")
    finally:
        relay.stop()
    assert rec["verdict"] != "error" and rec["error"] is None
    dialled = rec["upstream_dial"]
    assert dialled["family"] == "ipv4" and dialled["address"] == f"127.0.0.1:{port}"
    assert len(dialled["failed"]) == 1 and dialled["failed"][0].startswith(f"[::1]:{port}: no answer in ")
    # the attempt delay is in the connect phase, where the time went
    assert rec["phases"]["upstream_connect"] >= 200
    assert rec["phases"].get("relay_queue", 0) < rec["phases"]["upstream_connect"]
    # the next connect tries the address that won first: the dead one costs nothing more
    assert next_rec["upstream_dial"] == {"address": f"127.0.0.1:{port}", "family": "ipv4", "failed": []}
    assert next_rec["phases"]["upstream_connect"] < rec["phases"]["upstream_connect"] / 2

