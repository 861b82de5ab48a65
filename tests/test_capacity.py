"""The listen backlog, end to end: a burst of new connections larger than mitmproxy's backlog is queued, then served.

The relay process is frozen (SIGSTOP) while the burst connects, as an event loop
busy with other flows would be: only the kernel's accept queue decides who gets in.
Bare mitmdump, frozen the same way, shows what the relay fixes: it queues 101 and
leaves the rest to SYN retransmits.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
from pathlib import Path

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from ttft_relay import capacity
from ttft_relay.patches.speed import listen_backlog
from tests.conftest import reverse_to
from benchmarks._setups import BASELINE_SCRIPT
from ttft_relay.testing.harness import connect_many, handshakes_completed

BURST = 300
WAIT = 20  # seconds: a bound that turns a hang into a failure, not a sync


def _somaxconn() -> int:
    path = Path("/proc/sys/net/core/somaxconn")
    return int(path.read_text()) if path.exists() else 0


needs_queue_room = pytest.mark.skipif(_somaxconn() < BURST, reason=f"needs Linux with net.core.somaxconn >= {BURST}")


def burst_while_frozen(pid: int, port: int) -> tuple[list[socket.socket], list[socket.socket]]:
    os.kill(pid, signal.SIGSTOP)
    try:
        sockets = connect_many(port, BURST)
        return sockets, handshakes_completed(sockets)
    finally:
        os.kill(pid, signal.SIGCONT)


@needs_queue_room
def test_a_burst_beyond_mitmproxys_backlog_is_queued_and_served(fake, start_relay):
    relay = start_relay(reverse_to(fake), termlog_verbosity="debug")
    relay.wait_for_output("the running listeners queue up to 4096 new connections")
    sockets, queued = burst_while_frozen(relay.proc.pid, relay.port)
    try:
        assert len(queued) == BURST
        for s in queued:
            s.setblocking(True)
            s.settimeout(WAIT)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        for s in queued:
            assert s.recv(12).startswith(b"HTTP/1.1 "), "a queued connection was not served"
    finally:
        for s in sockets:
            s.close()


@needs_queue_room
def test_bare_mitmdump_queues_only_its_backlog(fake, start_relay):
    bare = start_relay(reverse_to(fake), script=BASELINE_SCRIPT)
    sockets, queued = burst_while_frozen(bare.proc.pid, bare.port)
    for s in sockets:
        s.close()
    # Linux queues one more than the backlog.
    assert listen_backlog.ASYNCIO_DEFAULT_BACKLOG <= len(queued) <= listen_backlog.ASYNCIO_DEFAULT_BACKLOG + 1


@pytest.mark.parametrize("backlog", [-1, capacity.MAX_BACKLOG + 1])
def test_a_backlog_out_of_range_is_refused(backlog):
    try:
        with taddons.context(capacity.ListenBacklog()) as tctx:
            with pytest.raises(exceptions.OptionsError, match="relay_listen_backlog"):
                tctx.configure(tctx.master.addons.get("listenbacklog"), relay_listen_backlog=backlog)
    finally:
        listen_backlog.set_listen_backlog(0)  # the rollback re-applied the default


def test_the_start_up_heap_is_frozen_once_the_relay_runs():
    addon = capacity.GcTuning()
    try:
        with taddons.context(addon) as tctx:
            addon.configure({"relay_gc_freeze"})
            assert gc.get_freeze_count() == 0  # not before it runs: start-up is still allocating
            addon.running()
            frozen = gc.get_freeze_count()
            assert frozen > 10_000  # the test process's modules, mitmproxy's among them
            tctx.configure(addon, relay_gc_freeze=False)
            assert gc.get_freeze_count() == 0
            tctx.configure(addon, relay_gc_freeze=True)
            assert gc.get_freeze_count() >= frozen
            tctx.configure(addon, relay_gc_threshold=50_000)
            assert gc.get_threshold()[0] == 50_000 and gc.get_freeze_count() >= frozen
            with pytest.raises(exceptions.OptionsError, match="relay_gc_threshold"):
                tctx.configure(addon, relay_gc_threshold=-1)
            addon.done()
            assert gc.get_freeze_count() == 0 and gc.get_threshold() == addon.python_threshold
    finally:
        gc.unfreeze()


def test_connection_lines_only_when_asked(caplog):
    addon = capacity.ConnectionLog()
    server_log = logging.getLogger(capacity.CONNECTION_LOGGER)
    with taddons.context(addon) as tctx:
        addon.configure({"relay_connection_log"})  # as at start-up: every option counts as updated
        with caplog.at_level(logging.INFO):
            server_log.info("client connect")
            server_log.warning("server connection error")
            tctx.configure(addon, relay_connection_log=True)
            server_log.info("client disconnect")
        addon.done()
    assert [r.getMessage() for r in caplog.records if r.name == capacity.CONNECTION_LOGGER] == [
        "server connection error", "client disconnect"]
    assert server_log.level == logging.NOTSET
