"""The README's commands, run as a new user runs them, before the suite (`.ci/run`).

The suite builds its own environment and starts the relay its own way, which hides what a
user meets first: a `.venv` built by the first `scripts/relay`, the log path the README names,
the URL mitmweb prints, the listeners an installed package opens. This check `git clone`s the
checkout (its committed tree, as a user gets it) into a scratch directory and walks the README
there, on the README's own ports (8080, 8001, 8002, 8081), under `flock /tmp/ttft-ports.lock`
(the metrics port 9464 is not waited for: the relay starts with it taken):

  1. mitm.conf's two reverse listeners pointed at a fake upstream, as a user edits them for
     another upstream (README "Other upstreams"), and the HTTPS fake's CA trusted upstream;
     then `scripts/relay`, its first run (no .venv), with the default workers;
  2. the README's curl through 8001 streams, and its console line reads as a healthy
     request's (the upstream's own wait, the fake's prefill, leads); the Anthropic (8002)
     listener answers, and the proxy (8080) as HTTPS_PROXY: CONNECT, then TLS to an https
     upstream with the relay's certificate, trusted through ~/.mitmproxy/mitmproxy-ca-cert.pem;
  3. `scripts/report logs/timing.jsonl`;
  4. `scripts/diagnose --relay http://127.0.0.1:8001 --relay-log logs/timing.jsonl`, with
     `--upstream <the fake>` added (its direct probes would go to api.openai.com), and
     otherwise its defaults (5 rounds, 8k-token long probes: the fake's prefill, 150 ms +
     20 ms per 1k tokens, keeps them under a second each): the probes are joined with the
     relay's records, the context is weighed at the size of the requests above (in the
     relay's log), and the headline is what a healthy relay beside its client must read,
     `nothing stands out`, the long probe's rate said as a finding (issue 34: the headline
     followed the long probe's size; only `--long-tokens 2000` was ever run here);
  5. a stop (SIGTERM, as systemd and Docker stop it) while a 3 s stream runs over TLS through
     8080: the stream ends whole and is recorded; then `scripts/relay` again at once: it
     starts and streams; then a reload as `systemctl reload` sends it (the unit's ExecReload,
     `kill -HUP` to the relay) after an edit of mitm.conf (8001 to the https upstream), while
     a 15 s stream runs over TLS through 8080 and a client arrives every 100 ms on a
     connection of its own (CONNECT, TLS, a stream): the relay says the new workers took over
     while the stream was in flight, the stream ends whole and is recorded, every client is
     answered whole (none refused, none reset) and recorded, the old workers exit 0 once
     their turns are done, and the README's curl through 8001 reaches the edited upstream;
     then it stops;
  6. `.venv/bin/python -m ttft_relay web` (with `--set web_open_browser=false`: a headless
     machine): the URL it prints opens the UI (a real HTTP request with its token);
  7. `.venv/bin/mitmdump -s addons/relay.py --listen-host 127.0.0.1`: streams through its
     proxy listener and records;
  8. the installed package: `pip install .` into a fresh venv, then from an empty
     directory `ttft-relay --version`, `ttft-relay run --help`, `ttft-relay run` (the same
     listeners on 127.0.0.1; a request through its proxy listener), `ttft-relay report
     logs/timing.jsonl`, and `mitmdump -s "$(ttft-relay addon-path)" --listen-host 127.0.0.1`;
  9. the container (no Docker daemon here): the Dockerfile's COPY steps done by hand in a
     scratch WORKDIR, its `RUN ... ensure_venv requirements.txt` run as written (a real pip
     install), then its ENTRYPOINT with `--version` in the image's environment, its config
     not mounted: the image's .venv serves it as built. Its apt-get and useradd steps are
     not run. Then deploy/compose.yaml: the relay reads the relay.conf the README's step 5
     has the user copy and edit.

Every command above that the README shows is looked up in README.md first (`README_COMMANDS`):
a command the README no longer shows fails the check, and tests/test_readme.py checks the
same list in the suite. A step that fails is named with the output that says why; the check
goes on where the next steps do not need it, then exits 1. Every process it starts runs in
a process group of its own and is stopped, group and all.

    python3 .ci/quickstart.py [--keep]     (--keep: leave the scratch directory for a look)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PORTS_LOCK = "/tmp/ttft-ports.lock"
RELAY_PORTS = (8080, 8001, 8002)
WEB_PORT = 8081
PORTS_FREE_TIMEOUT = 120
"""A listener port of the README's taken before a start is waited for this long, then the step
fails. The metrics port (9464) is not waited for: a user's machine may have it taken (another
relay, an OpenTelemetry exporter), and the relay must start anyway."""
FIRST_RUN_TIMEOUT = 900  # the first scripts/relay installs mitmproxy and the rest into .venv
START_TIMEOUT = 90
STOP_TIMEOUT = 40
FAKE_KEY = "sk-quickstart-not-a-real-key"
FAKE_PREFILL_MS = 150
IN_FLIGHT = {"x-fake-chunks": "30", "x-fake-gap-ms": "100"}
"""The stream a stop meets: 30 chunks 100 ms apart (3 s), the stop sent after its first one."""
RELOAD_IN_FLIGHT = {"x-fake-chunks": "150", "x-fake-gap-ms": "100"}
"""The stream a reload meets: 150 chunks 100 ms apart (15 s), the reload sent after its first
one. A reload starts its new workers one at a time (4.5-7.7 s for 2 on 2 busy cores, clients
arriving): a 3 s stream would end before the old workers retire, and nothing would be in
flight when they do."""
ARRIVAL_S = 0.1
"""A new client, on a connection of its own, every 100 ms through a reload."""
RELOADED = r"^\[ttft-relay\] reloaded: (\d+) workers ready; the (\d+) before them finish their turns in flight$"
RETIRED = r"^\[ttft-relay\] worker \d+ \(before the reload\) finished its turns and exited \((-?\d+)\)$"
HEALTHY_VERDICT = "upstream wait (prefill/queue)"
"""What a healthy request's console line leads with while the relay learns an upstream · model
(ttft_relay/timing/phases.py UPSTREAM_WAIT): the fake's prefill, its own wait, is the wait;
`ok` once it has learned."""

# The README's own lines this check runs, verbatim (a trailing comment aside).
RUN = "scripts/relay"
CURL = ("curl -N http://127.0.0.1:8001/v1/chat/completions"
        " -H \"Authorization: Bearer $OPENAI_API_KEY\" -H 'content-type: application/json'"
        " -d '{\"model\":\"gpt-4o-mini\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'")
REPORT = "scripts/report logs/timing.jsonl"
DIAGNOSE = "scripts/diagnose --relay http://127.0.0.1:8001 --relay-log logs/timing.jsonl"
WEB = ".venv/bin/python -m ttft_relay web"
ADDONS = ".venv/bin/mitmdump -s addons/relay.py --listen-host 127.0.0.1"
PIP_INSTALL = "pip install ."
VERSION = "ttft-relay --version"
RUN_HELP = "ttft-relay run --help"
INSTALLED_RUN = "ttft-relay run"
INSTALLED_REPORT = "ttft-relay report logs/timing.jsonl"
INSTALLED_ADDON = 'mitmdump -s "$(ttft-relay addon-path)" --listen-host 127.0.0.1'
README_COMMANDS = (RUN, CURL, REPORT, DIAGNOSE, WEB, ADDONS, PIP_INSTALL, VERSION, RUN_HELP, INSTALLED_RUN,
                   INSTALLED_REPORT, INSTALLED_ADDON)
MITM_CONF_LISTENERS = ("reverse:https://api.openai.com@8001", "reverse:https://api.anthropic.com@8002")


class StepFailed(Exception):
    pass


# --- the README -------------------------------------------------------------------------


def shell_lines(markdown: str) -> list[str]:
    """The command lines of the fenced sh blocks (a list item's indented ones too), continuation
    lines joined and trailing comments (` # ...` outside quotes) removed."""
    lines: list[str] = []
    for block in re.findall(r"^ *```(?:sh|bash|shell)\n(.*?)^ *```", markdown, re.S | re.M):
        pending = ""
        for raw in block.splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            pending = ""
            if code := without_comment(line).strip():
                lines.append(code)
    return lines


def without_comment(line: str) -> str:
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def missing_from_readme(readme: Path = REPO / "README.md") -> list[str]:
    shown = set(shell_lines(readme.read_text(encoding="utf8")))
    return [command for command in README_COMMANDS if command not in shown]


# --- processes and ports ----------------------------------------------------------------


class Processes:
    """Every process the check starts, each in a process group of its own, its output in a file."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        proc.log_path = self.logs / f"{name}.log"  # type: ignore[attr-defined]
        self.running.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Sends `sig` to the process (as systemd does: the main process only), waits for it and
        then for its whole group; kills what is left after `timeout`. Returns its exit status."""
        if proc.poll() is None:
            proc.send_signal(sig)
        deadline = time.monotonic() + timeout
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_group(proc)
            raise StepFailed(f"it did not stop within {timeout:.0f} s of {signal.Signals(sig).name}") from None
        while group_alive(proc.pid):
            if time.monotonic() > deadline:
                self.kill_group(proc)
                raise StepFailed(f"it exited but left processes behind: {group_members(proc.pid)}")
            time.sleep(0.1)
        return proc.returncode

    @staticmethod
    def kill_group(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    def stop_all(self) -> None:
        for _, proc in self.running:
            if proc.poll() is None or group_alive(proc.pid):
                with contextlib.suppress(StepFailed):
                    self.stop(proc, signal.SIGTERM, 15)
                self.kill_group(proc)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))  # zombies only: gone


def group_members(pgid: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{stat.parent.name} {command[:80]}")
    return found


def accepting(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def wait_for_ports(proc: subprocess.Popen, ports: tuple[int, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(accepting(p) for p in ports):
        if proc.poll() is not None:
            raise StepFailed(f"it exited ({proc.returncode}) before listening on {ports}")
        if time.monotonic() > deadline:
            raise StepFailed(f"not listening on {[p for p in ports if not accepting(p)]} after {timeout:.0f} s")
        time.sleep(0.2)


def wait_ports_free(what: str, ports: tuple[int, ...] = (*RELAY_PORTS, WEB_PORT)) -> None:
    deadline = time.monotonic() + PORTS_FREE_TIMEOUT
    while taken := [p for p in ports if accepting(p)]:
        if time.monotonic() > deadline:
            raise StepFailed(f"port(s) {taken} taken before {what} starts (another relay running?)")
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float, after: int = 0) -> re.Match[str]:
    """The first line of `proc`'s output (from its `after`th character on) that matches `pattern`."""
    rx = re.compile(pattern, re.M)
    deadline = time.monotonic() + timeout
    while True:
        if m := rx.search(path.read_text(errors="replace"), after):
            return m
        if proc.poll() is not None or time.monotonic() > deadline:
            raise StepFailed(f"no output line matches {pattern!r}")
        time.sleep(0.2)


def run(command: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise StepFailed(f"exit status {done.returncode}\n{tail(done.stdout + done.stderr)}")
    return done


PIP_NOISE = re.compile(r"^WARNING: Location '.*' is ignored")
"""pip's word on a find-links folder some machines configure and lack: nothing to do with the relay."""


def tail(text: str, lines: int = 40) -> str:
    kept = [line for line in text.rstrip().splitlines() if not PIP_NOISE.match(line)]
    return "\n".join("    | " + line for line in kept[-lines:])


def counted(report: str) -> int:
    """The requests `scripts/report` counts, over its groups (`== upstream · model: N requests, ...`)."""
    return sum(int(n) for n in re.findall(r"^== .*?: (\d+) requests?,", report, re.M))


def records(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def chat_records(log: Path, after: int, since: float) -> list[dict]:
    """The records of the requests `CHAT` sends (a CONNECT has no model), from the `after`th on,
    of requests made from `since` on (wall clock): a request of the step before may be recorded
    a moment after it ended, as the relay's writer thread writes its batch."""
    return [r for r in records(log)[after:] if r.get("model") == CHAT["model"] and r.get("ts", 0) >= since]


# --- HTTP -------------------------------------------------------------------------------


def post_stream(url: str, body: dict, headers: dict[str, str], proxy: str | None = None, ca: Path | None = None,
                on_first_bytes=None) -> bytes:
    """POSTs `body`, returns the whole answer. An https `url` through `proxy` goes over CONNECT and
    TLS with the relay's certificate, trusted through `ca` (the client settings' HTTPS_PROXY row).
    `on_first_bytes()` runs once the first bytes of the answer are in (to stop the relay mid-stream)."""
    try:
        with client_opener(url, proxy, ca).open(post_request(url, body, headers), timeout=60) as resp:
            if on_first_bytes is None:
                return resp.read()
            first = resp.read1()
            on_first_bytes()
            return first + resp.read()
    except urllib.error.HTTPError as e:
        raise StepFailed(f"{url}: {e.code} {e.read()[:500]!r}") from None
    except OSError as e:
        raise StepFailed(f"{url}: {e}") from None


def client_opener(url: str, proxy: str | None, ca: Path | None) -> urllib.request.OpenerDirector:
    scheme = url.split(":", 1)[0]
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({scheme: proxy} if proxy else {})]
    if ca is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=str(ca))))
    return urllib.request.build_opener(*handlers)


def post_request(url: str, body: dict, headers: dict[str, str]) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"content-type": "application/json", **headers})


def client_outcome(url: str, body: dict, headers: dict[str, str], proxy: str, ca: Path) -> str:
    """What one client met, on a connection of its own: `whole` (a stream to its [DONE]), or
    `refused`, `reset`, `cut: ...`, the HTTP status, or the error."""
    try:
        with client_opener(url, proxy, ca).open(post_request(url, body, headers), timeout=30) as resp:
            answer = resp.read()
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read()[:200]!r}"
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, ConnectionRefusedError):
            return "refused"
        if isinstance(reason, ConnectionResetError):  # http.client.RemoteDisconnected too
            return "reset"
        return repr(reason)
    return "whole" if b"[DONE]" in answer else f"cut: ...{answer[-200:]!r}"


CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-3-5-haiku-latest", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_stream(body: bytes, what: str) -> None:
    if b"data: " not in body or b"[DONE]" not in body:
        raise StepFailed(f"{what}: not an OpenAI event stream: {body[:300]!r}")


# --- the walk ----------------------------------------------------------------------------


class QuickStart:
    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.fake_certs = scratch / "fake-certs"
        self.fake_https = ""
        self.clone = scratch / "ttft-relay"
        self.logs = scratch / "output"
        self.logs.mkdir(parents=True)
        self.procs = Processes(self.logs)
        self.env = {**os.environ, "OPENAI_API_KEY": FAKE_KEY, "ANTHROPIC_API_KEY": FAKE_KEY}
        for name in ("TTFT_RELAY_CONF", "VIRTUAL_ENV", "PYTHONPATH", "HTTPS_PROXY", "HTTP_PROXY", "https_proxy",
                     "http_proxy", "ALL_PROXY", "all_proxy"):
            self.env.pop(name, None)
        self.fake_port = free_port()
        self.fake_url = f"http://127.0.0.1:{self.fake_port}"
        self.relay_ca = Path(self.env.get("HOME", "~")).expanduser() / ".mitmproxy" / "mitmproxy-ca-cert.pem"
        self.results: list[tuple[str, str, float]] = []
        self.relay: subprocess.Popen | None = None
        self.fake: subprocess.Popen | None = None

    # Each step: a title, and whether the walk can go on without it.
    def step(self, title: str, fn, needed: bool = False) -> bool:
        print(f"[quickstart] {title}", flush=True)
        started = time.monotonic()
        before = len(self.procs.running)
        try:
            fn()
        except Exception as e:
            for _, proc in self.procs.running[before:]:  # what the step started goes with it: the next steps need the ports
                self.procs.kill_group(proc)
            took = time.monotonic() - started
            detail = str(e) if isinstance(e, StepFailed | subprocess.TimeoutExpired) else traceback.format_exc()
            print(f"[quickstart] FAILED: {title} ({took:.0f} s)\n  {detail}", flush=True)
            for name, proc in self.procs.running[-2:]:
                log = proc.log_path  # type: ignore[attr-defined]
                print(f"  last lines of {name} ({log}):\n{tail(log.read_text(errors='replace'), 25)}", flush=True)
            self.results.append(("FAILED", title, took))
            if needed:
                raise StepFailed(f"cannot go on without: {title}") from None
            return False
        took = time.monotonic() - started
        print(f"[quickstart] ok ({took:.0f} s)", flush=True)
        self.results.append(("ok", title, took))
        return True

    def walk(self) -> bool:
        steps = [
            ("README.md shows the commands this check runs", self.readme_lists_them, True),
            ("a git clone of the checkout, mitm.conf's reverse listeners pointed at a fake upstream",
             self.clone_checkout, True),
            (f"{RUN}: its first run (no .venv) starts with the default workers", self.first_run, True),
            ("the fake upstreams, HTTP and HTTPS (python -m ttft_relay.testing.fakes.upstream)", self.start_fake, True),
            ("the README's curl streams through 8001", self.readme_curl, False),
            ("the client settings' Anthropic (8002) and HTTPS proxy (8080, TLS through the CA) listeners answer",
             self.other_listeners, False),
            (REPORT, self.report, False),
            (DIAGNOSE, self.diagnose, False),
            ("a stop (SIGTERM) with a stream in flight over TLS through 8080: it ends whole and is recorded",
             self.stop_in_flight, False),
            (f"{RUN} again at once: it starts and streams", self.restart, False),
            ("a reload (systemctl reload: the unit's ExecReload) of an edited mitm.conf with a stream in flight over "
             "TLS through 8080 and a client arriving every 100 ms: none cut, none refused, the edit served",
             self.reload_in_flight, False),
            ("and stops", self.stop_again, False),
            (f"{WEB}: the printed URL opens the UI", self.web, False),
            (f"{ADDONS}: streams and records", self.addons_entry, False),
            (f"{PIP_INSTALL} into a fresh venv, then the installed commands", self.installed, False),
            ("the Dockerfile's steps, without Docker", self.dockerfile, False),
            ("deploy/compose.yaml mounts the relay.conf the README has the user edit", self.compose, False),
        ]
        try:
            for title, fn, needed in steps:
                self.step(title, fn, needed)
        except StepFailed as e:
            print(f"[quickstart] {e}", flush=True)
        finally:
            self.procs.stop_all()
        print("[quickstart] summary:")
        for status, title, took in self.results:
            print(f"  {status:<6} {took:4.0f} s  {title}")
        for title, _, _ in steps[len(self.results):]:
            print(f"  {'not run':<6}         {title}")
        return len(self.results) == len(steps) and all(status == "ok" for status, _, _ in self.results)

    # --- steps ---

    def readme_lists_them(self) -> None:
        if missing := missing_from_readme():
            raise StepFailed("README.md no longer shows " + "; ".join(missing) + " (update .ci/quickstart.py with it)")

    def clone_checkout(self) -> None:
        # What a user has: the committed tree, cloned (not this working tree's files).
        run(f"git clone -q {REPO} {self.clone}", self.scratch, self.env, timeout=300)
        conf = self.clone / "mitm.conf"
        text = conf.read_text()
        for listener in MITM_CONF_LISTENERS:
            if listener not in text:
                raise StepFailed(f"mitm.conf has no {listener}: the README's listeners changed")
            text = text.replace(listener, re.sub(r"https://[^@]+", self.fake_url, listener))
        # The HTTPS fake's certificate is its own CA's: the relay trusts it as it trusts a public API's.
        conf.write_text(text + f"\nssl_verify_upstream_trusted_ca: {self.fake_certs / 'ca.pem'}\n")
        if (self.clone / ".venv").exists():
            raise StepFailed("the clone has a .venv")

    def start_relay(self, name: str, timeout: float) -> None:
        wait_ports_free(RUN, (*RELAY_PORTS, WEB_PORT))
        self.relay = self.procs.start(name, RUN, self.clone, self.env)
        wait_for_ports(self.relay, RELAY_PORTS, timeout)
        # A user waits for the relay to say it listens (the sockets accept a moment before it serves).
        wait_for_line(self.relay.log_path, r"listening at 127\.0\.0\.1:8002$", self.relay, timeout)  # type: ignore[attr-defined]

    def first_run(self) -> None:
        self.start_relay("relay", FIRST_RUN_TIMEOUT)
        if not (self.clone / ".venv" / "bin" / "python").exists():
            raise StepFailed("no .venv after the first run")

    def start_fake(self) -> None:
        self.fake = self.procs.start(
            "fake-upstream", f".venv/bin/python -W ignore::RuntimeWarning -m ttft_relay.testing.fakes.upstream --port {self.fake_port} --prefill-ms {FAKE_PREFILL_MS} "
            "--prefill-ms-per-1k-tokens 20 --gap-ms 10", self.clone, self.env)
        wait_for_line(self.fake.log_path, r"^listening ", self.fake, START_TIMEOUT)  # type: ignore[attr-defined]
        tls = self.procs.start(
            "fake-upstream-https", f".venv/bin/python -W ignore::RuntimeWarning -m ttft_relay.testing.fakes.upstream "
            f"--port 0 --tls --certs-dir {self.fake_certs} --gap-ms 10", self.clone, self.env)
        self.fake_https = wait_for_line(tls.log_path, r"^listening (\S+)", tls, START_TIMEOUT).group(1)  # type: ignore[attr-defined]

    def readme_curl(self) -> None:
        done = run(CURL, self.clone, self.env, timeout=60)
        assert_openai_stream(done.stdout.encode(), "curl")
        # The console line the README shows, as a healthy request reads it: the fake upstream's
        # prefill is its own wait (while the relay learns an upstream · model), or `ok` (once it
        # knows what this prompt takes there); no hop out of line.
        assert self.relay is not None
        healthy = (rf"(?:ok|{re.escape(HEALTHY_VERDICT)} (\d+) ms) · ttft (\d+) ms \[[a-z_]+ \d+.*\] · "
                   rf"gpt-4o-mini 200 → 127\.0\.0\.1:{self.fake_port}$")
        try:
            m = wait_for_line(self.relay.log_path, healthy, self.relay, 30)  # type: ignore[attr-defined]
        except StepFailed:
            said = self.relay.log_path.read_text(errors="replace").splitlines()[-3:]  # type: ignore[attr-defined]
            raise StepFailed(f"no console line reads as a healthy request's ({healthy!r}):\n" + "\n".join(said)) from None
        if m.group(1) and int(m.group(1)) < FAKE_PREFILL_MS:
            raise StepFailed(f"the upstream's own wait is shorter than the fake's prefill: {m.group(0)}")

    def other_listeners(self) -> None:
        body = post_stream("http://127.0.0.1:8002/v1/messages", MESSAGES,
                           {"x-api-key": FAKE_KEY, "anthropic-version": "2023-06-01"})
        if b"event: message_stop" not in body:
            raise StepFailed(f"8002: not an Anthropic event stream: {body[:300]!r}")
        # HTTPS_PROXY=http://127.0.0.1:8080, trusting ~/.mitmproxy/mitmproxy-ca-cert.pem: CONNECT, then TLS
        # with the certificate the relay makes for the API's name.
        body = post_stream(f"{self.fake_https}/v1/chat/completions", CHAT, {"authorization": f"Bearer {FAKE_KEY}"},
                           proxy="http://127.0.0.1:8080", ca=self.relay_ca)
        assert_openai_stream(body, "over TLS through the proxy listener 8080")

    def report(self) -> None:
        done = run(REPORT, self.clone, self.env, timeout=120)
        if counted(done.stdout) != 3:
            raise StepFailed(f"the report counts {counted(done.stdout)} requests, not the 3 sent:\n{tail(done.stdout)}")

    def diagnose(self) -> None:
        done = run(f"{DIAGNOSE} --upstream {self.fake_url}", self.clone, self.env, timeout=300)
        if "no record in" in done.stderr or "relay" not in done.stdout:
            raise StepFailed(f"the probes were not joined with the relay's records:\n{tail(done.stdout + done.stderr)}")
        verdict = next((line for line in done.stdout.splitlines() if line.startswith("verdict: ")), "no verdict")
        if verdict != "verdict: nothing stands out — every finding is below its threshold.":
            raise StepFailed(f"a healthy relay beside its client reads {verdict!r}:\n{tail(done.stdout, 20)}")
        if not re.search(r"context length: .*requests in the relay's log.*every \S+ tokens of history add", done.stdout):
            raise StepFailed(f"the context is not weighed at the requests in the relay's log:\n{tail(done.stdout, 20)}")
        print(tail(done.stdout, 12), flush=True)

    def stop_in_flight(self) -> None:
        """systemctl stop (SIGTERM to the main process) while a stream runs over TLS through the proxy
        listener: the stream ends whole, the relay records it and exits."""
        assert self.relay is not None
        log = self.clone / "logs" / "timing.jsonl"
        before = len(records(log))
        relay = self.relay
        stopped: list[int] = []

        def stop() -> None:
            stopper = threading.Thread(target=lambda: stopped.append(self.procs.stop(relay)), daemon=True)
            stopper.start()

        body = post_stream(f"{self.fake_https}/v1/chat/completions", CHAT,
                           {"authorization": f"Bearer {FAKE_KEY}", **IN_FLIGHT}, proxy="http://127.0.0.1:8080",
                           ca=self.relay_ca, on_first_bytes=stop)
        if b"[DONE]" not in body or b"shutting down" in body:
            raise StepFailed(f"the stop cut the stream in flight: ...{body[-300:]!r}")
        deadline = time.monotonic() + STOP_TIMEOUT
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.1)
        if not stopped or stopped[0] not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
            raise StepFailed(f"the stop exited {stopped[0] if stopped else 'not at all'}")
        finished = records(log)[before:]
        if not any(r.get("status") == 200 and not r.get("error") and r.get("chunks", 0) >= 30 for r in finished):
            raise StepFailed(f"no whole record of the stream in flight: {[r.get('error') for r in finished]}")

    def restart(self) -> None:
        self.start_relay("relay-restarted", START_TIMEOUT)
        self.readme_curl()

    def reload_in_flight(self) -> None:
        """systemctl reload (the unit's ExecReload: SIGHUP to the main process) after an edit of
        mitm.conf (8001 to the https upstream), while a stream runs over TLS through the proxy
        listener and a client arrives every 100 ms on a connection of its own: the relay says the
        new workers took over while the stream was in flight, the stream ends whole and is
        recorded, every client is answered whole (none refused, none reset), the old workers exit
        once their turns are done, and 8001 forwards where the edit says."""
        assert self.relay is not None
        relay, output = self.relay, self.relay.log_path  # type: ignore[attr-defined]
        log = self.clone / "logs" / "timing.jsonl"
        before = len(records(log))
        began_at = time.time()
        mark = len(output.read_text(errors="replace"))
        exec_reload = unit_setting(self.clone / "deploy" / "ttft-relay.service", "ExecReload")
        conf = self.clone / "mitm.conf"
        as_it_was = conf.read_text()
        edited = as_it_was.replace(f"reverse:{self.fake_url}@8001", f"reverse:{self.fake_https}@8001")
        if edited == as_it_was:
            raise StepFailed(f"mitm.conf has no reverse:{self.fake_url}@8001 to edit")
        proxied = (f"{self.fake_https}/v1/chat/completions", CHAT, {"authorization": f"Bearer {FAKE_KEY}"},
                   "http://127.0.0.1:8080", self.relay_ca)
        outcomes: list[tuple[float, str]] = []
        took_over: list[float] = []
        done = threading.Event()

        def arrive() -> None:
            while not done.is_set():
                began = time.monotonic()
                outcomes.append((began, client_outcome(*proxied)))
                done.wait(max(0.0, ARRIVAL_S - (time.monotonic() - began)))

        def watch() -> None:  # when the relay says the new workers took over
            while not done.is_set() and not took_over:
                if re.search(RELOADED, output.read_text(errors="replace")[mark:], re.M):
                    took_over.append(time.monotonic())
                done.wait(0.05)

        hup: list[float] = []

        def reload() -> None:
            hup.append(time.monotonic())
            run(exec_reload, self.clone, {**self.env, "MAINPID": str(relay.pid)}, timeout=30)

        threads = [threading.Thread(target=arrive, daemon=True), threading.Thread(target=watch, daemon=True)]
        conf.write_text(edited)
        try:
            for t in threads:
                t.start()
            url, body, headers, proxy, ca = proxied
            streamed = post_stream(url, body, {**headers, **RELOAD_IN_FLIGHT}, proxy=proxy, ca=ca,
                                   on_first_bytes=reload)
            ended = time.monotonic()
            reloaded = wait_for_line(output, RELOADED, relay, START_TIMEOUT, after=mark)
            retiring = int(reloaded.group(2))
            deadline = time.monotonic() + STOP_TIMEOUT
            while len(exits := re.findall(RETIRED, output.read_text(errors="replace")[mark:], re.M)) < retiring:
                if time.monotonic() > deadline:
                    raise StepFailed(f"{len(exits)} of the {retiring} workers before the reload exited within "
                                     f"{STOP_TIMEOUT} s of the stream's end")
                time.sleep(0.1)
        finally:
            done.set()
            for t in threads:
                t.join(60)
            conf.write_text(as_it_was)  # the steps below start from the README's mitm.conf
        # Every check below is made, and what fails is said together: one run tells all.
        took_over_at = took_over[0] if took_over else time.monotonic()  # seen after the stream, if not by then
        said = output.read_text(errors="replace")[mark:]
        problems = []
        if b"[DONE]" not in streamed or b"shutting down" in streamed:
            problems.append(f"the reload cut the stream in flight: ...{streamed[-300:]!r}")
        if took_over_at > ended:
            problems.append(f"the new workers took over {took_over_at - hup[0]:.1f} s after the reload, after the "
                            f"stream ended ({ended - hup[0]:.1f} s): nothing was in flight when the old workers retired")
        if any(code != "0" for code in exits):
            problems.append(f"the workers before the reload exited {exits}, not 0")
        whole = sum(outcome == "whole" for _, outcome in outcomes)
        during = sum(hup[0] <= began < took_over_at for began, _ in outcomes)
        after = sum(began >= took_over_at for began, _ in outcomes)
        if whole < len(outcomes) or not during or not after:
            missed = "; ".join(f"{outcome} (began {began - took_over_at:+.2f} s from the take-over)"
                               for began, outcome in outcomes if outcome != "whole")
            problems.append(f"of {len(outcomes)} clients arriving every {ARRIVAL_S * 1000:.0f} ms ({during} during the "
                            f"reload, {after} after it), {len(outcomes) - whole} were not answered whole: {missed}")
        print(f"    reloaded {took_over_at - hup[0]:.1f} s after the SIGHUP, {ended - hup[0]:.1f} s into the stream; "
              f"{whole} of {len(outcomes)} clients answered whole ({during} arrived during the reload)", flush=True)
        curl_mark = len(output.read_text(errors="replace"))
        assert_openai_stream(run(CURL, self.clone, self.env, timeout=60).stdout.encode(), "curl after the reload")
        upstream = self.fake_https.split("://", 1)[1]
        try:
            wait_for_line(output, rf"gpt-4o-mini 200 → {re.escape(upstream)}$", relay, 30, after=curl_mark)
        except StepFailed:
            problems.append(f"after the reload, 8001 does not forward to the upstream the edited mitm.conf names "
                            f"({upstream}):\n{tail(output.read_text(errors='replace')[curl_mark:])}")
        expected = 1 + whole + 1  # the stream, the clients answered, the curl
        deadline = time.monotonic() + 30
        while len(finished := chat_records(log, before, began_at)) < expected and time.monotonic() < deadline:
            time.sleep(0.2)
        if len(finished) != expected:
            problems.append(f"{len(finished)} new records, not {expected} (the stream, {whole} clients answered, "
                            "the curl)")
        chunks = int(RELOAD_IN_FLIGHT["x-fake-chunks"])
        if not any(r.get("status") == 200 and not r.get("error") and r.get("chunks", 0) >= chunks for r in finished):
            problems.append(f"no whole record of the stream in flight: {[r.get('error') for r in finished]}")
        if problems:
            raise StepFailed("\n  ".join(problems) + f"\n  the relay's output from the reload on:\n{tail(said)}")

    def stop_again(self) -> None:
        assert self.relay is not None
        self.procs.stop(self.relay)

    def web(self) -> None:
        wait_ports_free(WEB)
        web = self.procs.start("web", f"{WEB} --set web_open_browser=false", self.clone, self.env)
        m = wait_for_line(web.log_path, r"Web server listening at (\S+)", web, START_TIMEOUT)  # type: ignore[attr-defined]
        url = m.group(1)
        if "REDACTED" in url or "?token=" not in url:
            raise StepFailed(f"mitmweb's printed URL cannot open its UI: {m.group(0)}")
        with urllib.request.urlopen(url, timeout=30) as resp:
            if resp.status != 200 or b"<html" not in resp.read().lower():
                raise StepFailed(f"{url}: {resp.status}")
        try:
            urllib.request.urlopen(url.split("?")[0], timeout=30)
            raise StepFailed("the UI opened without its token")
        except urllib.error.HTTPError as e:
            if e.code != 403:
                raise
        wait_for_ports(web, RELAY_PORTS, START_TIMEOUT)
        assert_openai_stream(post_stream("http://127.0.0.1:8001/v1/chat/completions", CHAT,
                                         {"authorization": f"Bearer {FAKE_KEY}"}), "through mitmweb's 8001")
        token = url.split("?token=")[1]
        with urllib.request.urlopen(f"{url.split('?')[0]}flows?token={token}", timeout=30) as resp:
            flows = json.loads(resp.read())
        if not any(f["request"]["path"] == "/v1/chat/completions" and f.get("comment") for f in flows):
            raise StepFailed(f"the UI lists no flow with its timing: {str(flows)[:300]}")
        self.procs.stop(web, signal.SIGINT)  # Ctrl-C

    def addons_entry(self) -> None:
        log = self.clone / "logs" / "timing.jsonl"
        before = len(records(log))
        wait_ports_free(ADDONS)
        dump = self.procs.start("mitmdump-addons", ADDONS, self.clone, self.env)
        wait_for_ports(dump, (8080,), START_TIMEOUT)
        assert_openai_stream(post_stream(f"{self.fake_url}/v1/chat/completions", CHAT,
                                         {"authorization": f"Bearer {FAKE_KEY}"}, proxy="http://127.0.0.1:8080"),
                             "through mitmdump -s addons/relay.py")
        self.procs.stop(dump, signal.SIGINT)
        if len(records(log)) != before + 1:
            raise StepFailed(f"{log}: {len(records(log)) - before} new records, not 1")

    def installed(self) -> None:
        venv = self.scratch / "venv"
        python = run('source scripts/_venv.sh && find_python', self.clone, self.env).stdout.strip()
        run(f"{python} -m venv {venv}", self.clone, self.env)
        env = {**self.env, "PATH": f"{venv / 'bin'}:{self.env['PATH']}", "VIRTUAL_ENV": str(venv)}
        run(f"{PIP_INSTALL} -q --disable-pip-version-check", self.clone, env, timeout=900)
        home = self.scratch / "installed-user"
        home.mkdir()
        if not run(VERSION, home, env).stdout.startswith("ttft-relay "):
            raise StepFailed("ttft-relay --version says no version")
        helped = run(RUN_HELP, home, env).stdout
        if not helped.startswith("usage: ttft-relay run [--workers") or "relay_" not in helped.split("mitmdump's own")[0]:
            raise StepFailed(f"run --help does not lead with the relay's options:\n{tail(helped, 10)}")
        wait_ports_free(INSTALLED_RUN)
        relay = self.procs.start("installed-relay", INSTALLED_RUN, home, env)
        wait_for_ports(relay, RELAY_PORTS, START_TIMEOUT)
        for port in RELAY_PORTS:  # loopback only
            with socket.socket() as s:
                s.settimeout(1)
                if host := next((a for a in local_addresses() if s.connect_ex((a, port)) == 0), None):
                    raise StepFailed(f"the installed relay answers on {host}:{port}, not only on loopback")
        assert_openai_stream(post_stream(f"{self.fake_url}/v1/chat/completions", CHAT,
                                         {"authorization": f"Bearer {FAKE_KEY}"}, proxy="http://127.0.0.1:8080"),
                             "through the installed relay's proxy listener")
        self.procs.stop(relay)
        done = run(INSTALLED_REPORT, home, env)
        if counted(done.stdout) != 1:
            raise StepFailed(f"the installed relay's report counts {counted(done.stdout)} requests, not its "
                             f"one:\n{tail(done.stdout)}")
        wait_ports_free(INSTALLED_ADDON)  # the installed addons alone, in mitmdump
        dump = self.procs.start("installed-mitmdump", INSTALLED_ADDON, home, env)
        wait_for_ports(dump, (8080,), START_TIMEOUT)
        assert_openai_stream(post_stream(f"{self.fake_url}/v1/chat/completions", CHAT,
                                         {"authorization": f"Bearer {FAKE_KEY}"}, proxy="http://127.0.0.1:8080"),
                             "through mitmdump with the installed addon")
        self.procs.stop(dump, signal.SIGINT)
        if counted(run(INSTALLED_REPORT, home, env).stdout) != 2:
            raise StepFailed("mitmdump with the installed addon did not record its request")

    def dockerfile(self) -> None:
        image = self.scratch / "image"
        venv_step, entrypoint = docker_build_by_hand(self.clone / "deploy" / "Dockerfile", self.clone, image)
        run(venv_step, image, self.env, timeout=900)
        command = [entrypoint[0].replace("/opt/ttft-relay", str(image)), *entrypoint[1:], "--version"]
        # The image's own environment, its config not mounted (`docker run ttft-relay:local --version`).
        env = {**self.env, **dockerfile_env(self.clone / "deploy" / "Dockerfile")}
        if Path(env["TTFT_RELAY_CONF"]).exists():
            raise StepFailed(f"{env['TTFT_RELAY_CONF']} exists on this machine: the check needs it absent")
        done = subprocess.run(command, cwd=image, env={**env, "HOME": str(image)}, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or "installing" in done.stderr:
            raise StepFailed(f"the image's entry point (exit {done.returncode}) did not run on the .venv its build "
                             f"made:\n{tail(done.stdout + done.stderr)}")
        if not done.stdout.startswith("ttft-relay "):
            raise StepFailed(f"the image's --version says no ttft-relay version:\n{tail(done.stdout + done.stderr)}")

    def compose(self) -> None:
        """README "In a container": steps 1-5 (relay.conf copied to /etc/ttft-relay/ and edited for the
        user's name), then compose: the relay must read that file, not the repository's copy."""
        compose = json.loads(run(".venv/bin/python -c 'import json, sys; from ruamel.yaml import YAML; "
                                 "print(json.dumps(YAML(typ=\"safe\").load(open(sys.argv[1]))))' deploy/compose.yaml",
                                 self.clone, self.env).stdout)
        readme = (self.clone / "README.md").read_text(encoding="utf8")
        copied = re.search(r"sudo cp /opt/ttft-relay/deploy/relay\.conf ([^\s`]+)", readme)
        if not copied:
            raise StepFailed("README.md no longer says where relay.conf is copied (step 5)")
        edited = copied.group(1).rstrip("/") + "/relay.conf"
        conf = dockerfile_env(self.clone / "deploy" / "Dockerfile")["TTFT_RELAY_CONF"]
        mounted = {target: source for source, target in
                   (volume.split(":")[:2] for volume in compose["services"]["relay"]["volumes"])}
        if mounted.get(conf) != edited:
            raise StepFailed(f"the container reads {conf} from {mounted.get(conf)}, not {edited} (the file the "
                             "README has the user edit)")


def unit_setting(unit: Path, name: str) -> str:
    """A setting of the systemd unit (`ExecReload`: what `systemctl reload` runs, $MAINPID the relay)."""
    for line in unit.read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1]
    raise StepFailed(f"{unit} has no {name}")


def docker_build_by_hand(dockerfile: Path, context: Path, image: Path) -> tuple[str, list[str]]:
    """What can be done of an image build without Docker: the Dockerfile's COPY steps from
    `context` into `image` (its WORKDIR), as Docker copies (a directory's contents into the
    destination, a file into a destination ending in `/`). Returns the RUN command that builds
    .venv (ensure_venv) and the ENTRYPOINT; the other RUN steps (apt-get, useradd) are not run."""
    image.mkdir(parents=True, exist_ok=True)
    venv_step, entrypoint = "", []
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            *sources, dest = words[1:]
            for source in sources:
                if (context / source).is_dir():
                    shutil.copytree(context / source, image / dest, dirs_exist_ok=True)
                else:
                    target = image / dest / Path(source).name if dest.endswith("/") else image / dest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(context / source, target)
        elif words[:1] == ["RUN"] and "ensure_venv" in line:
            venv_step = line.split(None, 1)[1]
        elif words[:1] == ["ENTRYPOINT"]:
            entrypoint = json.loads(line.split(None, 1)[1])
    if not venv_step or not entrypoint:
        raise StepFailed(f"{dockerfile} has no RUN step building .venv (ensure_venv) or no ENTRYPOINT")
    return venv_step, entrypoint


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    """The image's ENV (one `ENV A=1 B=2` line)."""
    env: dict[str, str] = {}
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ENV "):
            env.update(word.split("=", 1) for word in line.split()[1:])
    return env


def local_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return []
    return [a for a in out.split() if "." in a and not a.startswith("127.")]


@contextlib.contextmanager
def ports_lock():
    with open(PORTS_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[quickstart] waiting for {PORTS_LOCK} (another check uses the README's ports)", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave the scratch directory for a look")
    args = ap.parse_args()
    started = time.monotonic()
    # A stop from outside (CI's timeout, Ctrl-C) unwinds through the walk's cleanup, which stops
    # every process the check started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    scratch = Path(tempfile.mkdtemp(prefix=f"ttft-quickstart-{os.getpid()}-"))
    print(f"[quickstart] the README's commands, in {scratch}", flush=True)
    with ports_lock():
        ok = QuickStart(scratch).walk()
    if args.keep or not ok:
        print(f"[quickstart] kept {scratch} (each process's output in {scratch / 'output'})")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"[quickstart] {'passed' if ok else 'FAILED'} in {time.monotonic() - started:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
