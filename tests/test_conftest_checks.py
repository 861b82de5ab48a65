"""The suite's own checks fail: a process a test left behind and an exception escaping one
of a relay's addons fail a run, with and without pytest-xdist workers; a shared relay's
log fails a request id with more records than its test counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ttft_relay.testing.harness import REPO, TimingLog

LEAKING = '''
import subprocess, sys
def test_leaks_a_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({pidfile!r}, "w").write(str(proc.pid))
'''

RAISING_ADDON = '''
class Raises:
    def client_connected(self, client):
        raise RuntimeError("boom from a test addon")
addons = [Raises()]
'''

TRIGGERS_ADDON_ERROR = '''
import contextlib
import socket
def test_a_relay_whose_addon_raises(start_relay):
    relay = start_relay("reverse:http://127.0.0.1:9@0", script={addon!r})
    with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
        # Whatever mitmproxy answers, the hook ran first; it may also reset the connection,
        # its upstream refusing before the request was read (a loaded suite run had that).
        with contextlib.suppress(ConnectionResetError):
            s.recv(1000)
    relay.wait_for_output("boom from a test addon")
'''


def run_inner(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "-p", "no:cacheprovider",
                           "-c", str(REPO / "pytest.ini"), "--rootdir", str(tmp_path), *args,
                           str(tmp_path / "test_inner.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TTFT_TEST_LEFTOVER_GRACE_S": "1"})


@pytest.mark.parametrize("workers", [["-p", "no:xdist"], ["-n", "1"]], ids=["serial", "xdist"])
def test_a_process_left_behind_fails_the_run(tmp_path, workers):
    """Serially the session looks below itself; under xdist a worker looks and the controller fails."""
    pidfile = tmp_path / "leaked.pid"
    done = run_inner(tmp_path, LEAKING.format(pidfile=str(pidfile)), *workers)
    leaked = int(pidfile.read_text())
    try:
        assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout[-2000:]
        assert "processes left behind by the tests" in done.stdout and f"{leaked} " in done.stdout
    finally:
        try:
            os.kill(leaked, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_an_addon_error_fails_the_test(tmp_path):
    """The check is start_relay's teardown: the same in a worker as in a serial session."""
    addon = tmp_path / "raises.py"
    addon.write_text(RAISING_ADDON)
    done = run_inner(tmp_path, TRIGGERS_ADDON_ERROR.format(addon=str(addon)))
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout[-2000:]
    assert "an addon raised" in done.stdout and "1 passed, 1 error" in done.stdout, done.stdout[-2000:]


def test_a_shared_log_gives_each_request_id_its_records_and_fails_a_late_second_one(tmp_path):
    log = TimingLog(tmp_path / "timing.jsonl")
    log.path.write_bytes(b'{"request_id": "a"}\n{"request_id": "b"}\n{"request_id": null}\n')
    assert log.of("a") == [{"request_id": "a"}]
    log.none_of("c")
    log.check_counts()
    with log.path.open("ab") as f:
        f.write(b'{"request_id": "a"}\n{"request_id": "c"}\n')  # a duplicate, and one that should not be
    with pytest.raises(AssertionError, match=r"'a': \(2, 1\), 'c': \(1, 0\)"):
        log.check_counts()
    with pytest.raises(AssertionError, match="not 1 records of 'd'"):
        log.of("d", timeout=0.1)
