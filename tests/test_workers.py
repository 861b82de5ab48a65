"""ttft-relay run --workers N (ttft_relay/workers.py): options as the workers see them, the generated HAProxy setup, and
N real workers behind a real HAProxy (skipped where haproxy is not installed)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from ttft_relay import workers
from ttft_relay.timing import ledger, metrics
from tests.conftest import reverse_to
from tests.fakes import client

REPO = Path(__file__).resolve().parent.parent
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def test_listener_options_are_stripped_in_every_spelling():
    args = ["--mode", "a", "-p8080", "--set", "mode=x", "--set=relay_timing_log=y", "--set", "relay_trim=false",
            "-m=b", "--listen-host", "0.0.0.0", "--listen-port=1", "-q"]
    assert workers.strip_options(args, workers.OVERRIDDEN) == ["--set", "relay_trim=false", "-q"]


def test_the_supervisor_checks_the_options_its_workers_start_with(tmp_path, monkeypatch):
    conf = tmp_path / "mitm.conf"
    conf.write_text("mode: [regular@9100, 'reverse:https://api.openai.com@9101']\nrelay_trim: false\n"
                    "relay_metrics_listen: 127.0.0.1:9999\n")
    monkeypatch.setenv("TTFT_RELAY_CONF", str(conf))
    args, opts = workers.worker_options(["--set", "relay_metrics_listen=", "--set", f"confdir={tmp_path}"])
    assert args == ["--set", "http2=false", "--set", "mode=regular@9100",
                    "--set", "mode=reverse:https://api.openai.com@9101", "--set", "relay_trim=false",
                    "--set", "listen_host=127.0.0.1",  # the relay's default: the file names no listen_host
                    "--set", "relay_metrics_listen=", "--set", f"confdir={tmp_path}"]
    assert opts.mode == ["regular@9100", "reverse:https://api.openai.com@9101"]
    assert opts.relay_metrics_listen == ""  # the command line wins
    args, opts = workers.worker_options(["--mode", "regular@9200", "--set", f"confdir={tmp_path}"])
    assert opts.mode == ["regular@9200"]
    # A config that cannot be applied stops the supervisor in one line.
    monkeypatch.setenv("TTFT_RELAY_CONF", str(tmp_path / "missing.conf"))
    with pytest.raises(SystemExit, match="cannot start the relay: cannot read"):
        workers.worker_options([])


def test_haproxy_config_and_worker_modes():
    listeners = [workers.Listener("reverse:https://api.openai.com@8001", "127.0.0.1", 8001, [5001, 5002])]
    cfg = workers.haproxy_config(listeners, [6001, 6002], Path("/run/x.sock"))
    assert "mode tcp" in cfg and "balance leastconn" in cfg
    assert "bind 127.0.0.1:8001 backlog" in cfg
    assert "server w1 127.0.0.1:5002 check port 6002" in cfg
    assert listeners[0].worker_spec(1) == "reverse:https://api.openai.com@127.0.0.1:5002"
    assert workers.worker_log("logs/timing.jsonl", 3) == "logs/timing.3.jsonl"


def test_listeners_haproxy_cannot_carry_are_refused():
    _, opts = workers.worker_options(["--mode", "wireguard@51820"])
    with pytest.raises(SystemExit, match="--workers 1"):
        workers.listeners(opts, 2)


def test_workers_flag():
    assert workers.split_workers(["--workers", "3", "-q"]) == (3, ["-q"])
    assert workers.split_workers(["--workers=1"]) == (1, [])
    assert workers.split_workers(["-q"]) == (1, ["-q"])  # ttft-relay run: one process
    # scripts/relay asks for one per core; the user's own --workers comes after and wins.
    assert workers.split_workers(["--workers", "auto"]) == (len(os.sched_getaffinity(0)), [])
    assert workers.split_workers(["--workers", "auto", "--workers", "2"]) == (2, [])
    with pytest.raises(SystemExit, match="at least 1, or auto"):
        workers.split_workers(["--workers", "0"])


# --- end to end -----------------------------------------------------------------------


class Supervised:
    """`ttft-relay run` as a subprocess, its stderr and stdout collected."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ttft_relay", "run", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**os.environ, "TTFT_RELAY_CONF": ""}, process_group=0,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match:
        rx = re.compile(pattern)
        with self.changed:
            found = self.changed.wait_for(lambda: next((m for ln in self.lines if (m := rx.search(ln))), None),
                                          timeout)
        assert found, f"no line matches {pattern!r}:\n" + "\n".join(self.lines)
        return found

    def children(self, name: str) -> list[int]:
        # By command name: arguments (paths, the test's own name) may contain anything.
        out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return [int(pid) for pid, comm in (ln.split(None, 1) for ln in out.stdout.splitlines()) if comm.strip() == name]


@pytest.mark.skipif(shutil.which("haproxy") is None,
                    reason="haproxy is not installed (Debian/Ubuntu: apt-get install haproxy)")
def test_workers_behind_haproxy(fake, tmp_path, confdir):
    port, metrics_port = workers.free_port(), workers.free_port()
    sup = Supervised(["--workers", "2", "--mode", reverse_to(fake).replace("@0", f"@{port}"),
                      "--listen-host", "127.0.0.1", "--set", f"confdir={confdir}",
                      "--set", f"relay_timing_log={tmp_path / 'timing.jsonl'}", "--set", "relay_trim=false",
                      "--set", f"relay_metrics_listen=127.0.0.1:{metrics_port}"])
    try:
        sup.wait_for(r"2 workers behind haproxy")

        def run(n: int) -> list[int]:
            statuses = []
            for _ in range(n):
                conn, resp = client.request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", CHAT,
                                            timeout=20)
                with conn:
                    resp.read()
                    statuses.append(resp.status)
            return statuses

        assert run(6) == [200] * 6
        pids = sup.children("mitmdump")
        assert len(pids) == 2 and len(sup.children("haproxy")) == 1
        # A stream held upstream after its first event, on one of the workers: the one
        # whose in-flight gauge (in the shared metrics directory) says so is killed.
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{pids[0]}/environ").read_text().split("\0") if "=" in v)
        metrics_dir = Path(environ["PROMETHEUS_MULTIPROC_DIR"])
        held, resp = client.request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", CHAT,
                                    {"x-fake-stall-after-chunks": "1", "x-request-id": "held"}, timeout=20)
        with held:
            next(resp.chunks())
            [busy] = [pid for pid in pids if metrics.in_flight_of(pid, metrics_dir) == 1]
            live = metrics_dir / f"gauge_livesum_{busy}.db"
            os.kill(busy, signal.SIGKILL)
            sup.wait_for(r"worker \d exited \(-9\) with 1 request\(s\) in flight \(the restarted worker records "
                         r"them as lost; .* out of rotation")
        assert not live.exists()  # its gauges left the sums: a dead worker's queue is nobody's
        assert run(4) == [200] * 4  # the other worker serves meanwhile
        sup.wait_for(r"worker \d back in rotation", timeout=60)
        assert len(sup.children("mitmdump")) == 2
        assert run(4) == [200] * 4

        logs = sorted(tmp_path.glob("timing.*.jsonl"))
        assert [p.name for p in logs] == ["timing.0.jsonl", "timing.1.jsonl"]
        deadline = time.time() + 10
        while sum(len(p.read_bytes().splitlines()) for p in logs) < 15 and time.time() < deadline:
            time.sleep(0.05)
        records = [[orjson.loads(line) for line in p.read_bytes().splitlines()] for p in logs]
        # The held stream, recorded by the restarted worker from its predecessor's ledger.
        [lost] = [r for recs in records for r in recs if r["request_id"] == "held"]
        assert lost["error"] == ledger.LOST_ERROR and lost["verdict"] == "error in relay"
        counts = [len([r for r in recs if r["request_id"] != "held"]) for recs in records]
        assert all(counts), counts  # both workers served
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        scraped = sum(float(m) for m in re.findall(r"^gen_ai_client_operation_duration_seconds_count\{.*\} (\S+)$",
                                                   text, re.M))
        # The killed worker may have died before its last records reached its log; its
        # metrics were in shared memory already.
        assert scraped == 14 >= sum(counts)

        report = subprocess.run([sys.executable, "-m", "ttft_relay", "report", str(tmp_path / "timing*.jsonl"), "--json"],
                                cwd=REPO, capture_output=True, check=True)
        (group,) = orjson.loads(report.stdout).values()
        assert group["requests"] == sum(counts) + 1  # the lost one too
    finally:
        children = sup.children("mitmdump") + sup.children("haproxy")
        sup.proc.send_signal(signal.SIGINT)  # as Ctrl-C
        assert sup.proc.wait(30) == 0
    for pid in children:  # all stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(shutil.which("haproxy") is None,
                    reason="haproxy is not installed (Debian/Ubuntu: apt-get install haproxy)")
def test_ctrl_c_with_streams_in_flight_records_and_tells_every_one(fake, tmp_path, confdir):
    port = workers.free_port()
    fake.behaviour.stall_after_chunks = 2
    sup = Supervised(["--workers", "2", "--mode", reverse_to(fake).replace("@0", f"@{port}"),
                      "--listen-host", "127.0.0.1", "--set", f"confdir={confdir}",
                      "--set", f"relay_timing_log={tmp_path / 'timing.jsonl'}", "--set", "relay_trim=false",
                      "--set", "relay_metrics_listen="])
    streams = []
    try:
        sup.wait_for(r"2 workers behind haproxy")
        for _ in range(8):
            conn, resp = client.request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, timeout=20)
            chunks = resp.chunks()
            streams.append((conn, resp, chunks, next(chunks).data))
        sup.proc.send_signal(signal.SIGINT)  # as Ctrl-C
        for conn, resp, chunks, first in streams:
            with conn:
                body = first + b"".join(chunk.data for chunk in chunks)
            assert resp.complete, body
            assert b"ttft-relay: relay shutting down" in body.rsplit(b"\n\n", 2)[-2]
    finally:
        sup.proc.send_signal(signal.SIGINT)
        assert sup.proc.wait(30) == 0
    recs = [orjson.loads(line) for p in tmp_path.glob("timing.*.jsonl") for line in p.read_bytes().splitlines()]
    assert len(recs) == len(streams) and all(r["error"] == "relay shutting down" for r in recs), recs


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("haproxy") is None,
                    reason="haproxy is not installed (Debian/Ubuntu: apt-get install haproxy)")
def test_the_supervisors_children_die_with_it_and_a_second_one_refuses_the_port(fake, tmp_path, confdir):
    port = workers.free_port()
    args = ["--workers", "2", "--mode", reverse_to(fake).replace("@0", f"@{port}"), "--listen-host", "127.0.0.1",
            "--set", f"confdir={confdir}", "--set", f"relay_timing_log={tmp_path / 'timing.jsonl'}",
            "--set", "relay_metrics_listen="]
    sup = Supervised(args)
    try:
        sup.wait_for(r"2 workers behind haproxy")
        second = Supervised(args)
        try:
            assert second.proc.wait(60) != 0
        finally:
            if second.proc.poll() is None:
                second.proc.send_signal(signal.SIGINT)
                second.proc.wait(30)
        second.wait_for(rf"127\.0\.0\.1:{port} is taken")
        conn, resp = client.request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, timeout=20)
        with conn:
            assert resp.status == 200 and resp.read()  # the first one still serves
        children = sup.children("mitmdump") + sup.children("haproxy")
        assert len(children) == 3
    finally:
        sup.proc.kill()  # kill -9: no chance to stop anything itself
        sup.proc.wait(30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval
    assert not [pid for pid in children if _alive(pid)]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
