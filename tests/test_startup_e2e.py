"""A relay started as a user starts it (mitmproxy's default confdir, reverse listeners to the
real APIs' names) answers a client that connects the moment its listeners open: one
connected 3 ms after the listening line once made it exit ("Error logged during startup")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from ttft_relay.workers import free_port
from ttft_relay.testing.harness import REPO

WAIT = 30  # seconds: a bound that turns a hang into a failure


def test_a_request_at_the_first_moment_is_answered_and_the_relay_stays_up(tmp_path):
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path), "TTFT_RELAY_CONF": ""}  # ~/.mitmproxy: a fresh default confdir
    relay = subprocess.Popen(
        [sys.executable, "-m", "ttft_relay", "run", "--mode", f"regular@{port}",
         "--mode", "reverse:https://api.openai.com@0", "--set", "relay_metrics_listen=",
         "--set", f"relay_timing_log={tmp_path / 'timing.jsonl'}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + WAIT
        while True:  # connect as early as the listener takes it, and ask at once
            assert relay.poll() is None and time.monotonic() < deadline, relay.stdout.read()
            try:
                client = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                time.sleep(0.001)  # poll interval: the point is to be first
        with client:
            client.sendall(b"GET http://127.0.0.1:1/ HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n")
            client.settimeout(WAIT)
            answer = client.recv(1024)
        assert answer.startswith(b"HTTP/1.1 502"), answer  # nobody listens on port 1: answered, not dropped
        with pytest.raises(subprocess.TimeoutExpired):  # it exited on its own within a second of such a request
            relay.wait(1)
    finally:
        relay.terminate()
        output = relay.communicate(timeout=WAIT)[0]
    assert "Error logged during startup" not in output and "Traceback" not in output, output
