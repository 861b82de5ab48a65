"""End to end, real mitmdump: the relay's speed patches (ttft_relay/patches/speed/) change how
fast, never what. With them off (`relay_speed_patches=false`, as on any mitmproxy but the one
they were written against) a client gets the same bytes and the timing log the same records
as with them on: long streams over HTTP/1, plain and TLS on both hops, two on one kept-alive
connection, and a Responses WebSocket's turns. On a mitmproxy that says it is another minor
version the relay starts with them off and says so; where a fix's pinned code changed it does
not start, and says which fix and which mitmproxy to install.

The relays share the module's fake upstreams (`shared_relay`) and find their records by `rid`.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
from pathlib import Path

import pytest

from ttft_relay import config
from ttft_relay.timing import phases
from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes.ws_client import WebSocketClient
from ttft_relay.testing.harness import MITMDUMP, REPO

pytestmark = pytest.mark.shared_fake
WAIT = 30
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}
SAME = ("api", "model", "stream", "status", "transport", "turn", "prewarm", "bytes", "usage", "error",
        "error_phase", "client_aborted", "prompt_tokens", "upstream")
"""What a record says that does not depend on how fast the relay was."""
BY_LOAD = {*phases.ARRIVAL_MARKS, "relay_queue"}
"""Marks (and the phase they make) that exist only where the kernel held bytes the relay had not
read yet: a matter of load at that instant, either way."""


def what_was_recorded(records: list[dict]) -> list[dict]:
    """Each record without its clock readings: what it says happened, the marks it has (in the
    timeline's order: marks of parallel work, the upstream connect and the upload, come in
    either order), the phases they make."""
    return [{**{k: r[k] for k in SAME}, "marks": [m for m in phases.MARKS if m in r["marks"] and m not in BY_LOAD],
             "phases": sorted(set(r["phases"]) - BY_LOAD)}
            for r in sorted(records, key=lambda r: (r["turn"] or 0, r["ts"]))]


WITHOUT_THE_POOL = {"relay_upstream_pool": False}
"""In both relays: the pool (a speed patch too) is meant to change which requests connect, and so
their records' connect phases; what it changes is tests/test_upstream_pool_e2e.py's."""


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls-both-hops"])
def test_speed_off_the_client_gets_the_same_bytes_and_the_log_the_same_records(tls, request, certs, shared_relay,
                                                                                 rid):
    fake = request.getfixturevalue("fake_tls" if tls else "fake")
    options: dict[str, object] = {"termlog_verbosity": "debug", **WITHOUT_THE_POOL}
    if tls:
        options.update(relay_client_tls="all", certs=f"localhost={certs.cert_and_key_pem}")
    fast = shared_relay(reverse_to(fake), **options)
    plain = shared_relay(reverse_to(fake), relay_speed_patches=False, **options)
    knobs = {"content-type": "application/json", "x-fake-chunks": "300", "x-fake-gap-ms": "1", "x-request-id": rid,
             "authorization": f"Bearer {FAKE_OPENAI_KEY}"}
    verify = ssl.create_default_context(cafile=str(certs.ca_pem))

    def fetch(port: int) -> list[bytes]:
        """Two long streams on one kept-alive connection."""
        conn = (http.client.HTTPSConnection("localhost", port, timeout=WAIT, context=verify) if tls
                else http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT))
        try:
            bodies = []
            for _ in range(2):
                conn.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(), knobs)
                resp = conn.getresponse()
                assert resp.status == 200 and resp.getheader("transfer-encoding") == "chunked"
                bodies.append(resp.read())
            return bodies
        finally:
            conn.close()

    expected = fetch(fake.port)
    assert expected[0].count(b"data:") > 300
    assert fetch(fast.port) == expected
    assert fetch(plain.port) == expected
    # the speed patches ran in one (the splice's direct reads took the bodies over) and not in the other
    fast.wait_for_lines(r"direct reads of .*\)$", 2)
    assert not [line for line in plain.output if "direct reads of" in line]
    assert what_was_recorded(fast.log.of(rid, 2)) == what_was_recorded(plain.log.of(rid, 2))


def test_speed_off_a_websockets_turns_pass_the_same_and_are_recorded_the_same(fake, shared_relay, rid):
    headers = {"authorization": f"Bearer {FAKE_OPENAI_KEY}", "openai-beta": "responses_websockets=2026-02-06",
               "x-request-id": rid}

    def session(relay) -> list[list[tuple[str, str]]]:
        """Two turns on one socket: each turn's events as the client got them (type, text)."""
        url = relay.url().replace("http://", "ws://") + "/v1/responses"
        turns = []
        with WebSocketClient(url, headers=headers) as client:
            for text in ("Say hello", "And again"):
                client.send_text(json.dumps({"type": "response.create", "model": "gpt-5.1-codex",
                                             "input": [{"type": "message", "role": "user", "content": text}]}))
                events = []
                while (msg := client.receive(WAIT)) is not None:
                    event = json.loads(msg.text)
                    events.append((event["type"], event.get("delta", "")))
                    if event["type"] in ("response.completed", "response.failed", "error"):
                        break
                turns.append(events)
        return turns

    fast = shared_relay(reverse_to(fake), **WITHOUT_THE_POOL)
    plain = shared_relay(reverse_to(fake), relay_speed_patches=False, **WITHOUT_THE_POOL)
    got = session(fast)
    assert got[0][-1][0] == "response.completed" and len(got) == 2
    assert session(plain) == got
    assert what_was_recorded(fast.log.of(rid, 3)) == what_was_recorded(plain.log.of(rid, 3))


def on_another_mitmproxy(tmp_path: Path, *, version: str | None = None, changed: str | None = None) -> Path:
    """A mitmdump script: the relay's addons, on a mitmproxy that says it is `version`, or in
    which the code under the pin `changed` ("module:Owner.name") is said to have changed."""
    script = tmp_path / "relay_elsewhere.py"
    lines = ["import sys", f"sys.path.insert(0, {str(REPO)!r})", "from mitmproxy import version"]
    if version:
        lines.append(f"version.VERSION = {version!r}")
    if changed:
        module, pin = changed.split(":")
        lines += ["from ttft_relay import patches",
                  f"module = next(m for m in patches.MODULES if m.__name__.endswith('.{module}'))",
                  f"module.PINS[{pin!r}] = (module.PINS[{pin!r}][0], '0' * 16)"]
    lines.append("from ttft_relay.relay import addons  # noqa: E402,F401")
    script.write_text("\n".join(lines) + "\n")
    return script


def test_on_another_minor_version_of_mitmproxy_the_relay_starts_with_its_speed_patches_off_and_says_so(
        fake, start_relay, tmp_path, rid):
    relay = start_relay(reverse_to(fake), script=on_another_mitmproxy(tmp_path, version="12.4.0"),
                        relay_timing_log=tmp_path / "timing.jsonl", relay_metrics_listen="",
                        **config.MITMPROXY_DEFAULTS)
    said = relay.wait_for_lines("speed patches stay off", 1)
    assert len(said) == 1 and "mitmproxy 12.4.0 is installed, they were written against 12.3.1" in said[0]
    conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=WAIT)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                     {"content-type": "application/json", "x-request-id": rid, "x-fake-chunks": "20"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == fake.sent[-1].body  # streamed, through mitmproxy's own code
    finally:
        conn.close()
    [record] = relay.log.of(rid, 1)
    assert record["status"] == 200 and record["ttft_ms"] is not None
    assert not [line for line in relay.output if "cannot start the relay" in line]


@pytest.mark.parametrize("changed, named", [
    ("head_limit:Http1Server.read_headers", "its fix head_limit"),
    ("connections:ConnectionHandler.close_connection", "its read connections"),
])
def test_where_a_fixs_pinned_code_changed_the_relay_does_not_start(changed, named, fake, tmp_path, confdir):
    script = on_another_mitmproxy(tmp_path, version="12.4.0", changed=changed)
    proc = subprocess.run(
        [str(MITMDUMP), "--set", f"confdir={confdir}", "--listen-host", "127.0.0.1", "--mode", reverse_to(fake),
         "-s", str(script), "--set", "relay_metrics_listen=", "--set", f"relay_timing_log={tmp_path / 't.jsonl'}"],
        env=os.environ, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=REPO,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert f"cannot start the relay: {named}" in output and "changed" in output
    assert "pip install 'mitmproxy==12.3.1'" in output and "Error logged during startup" in output
