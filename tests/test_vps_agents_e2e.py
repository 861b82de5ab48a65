"""The laptop's coding agents through a relay set up as on a VPS: TLS only, relay keys.

Codex CLI (Responses over a WebSocket) and Claude Code (Anthropic Messages) reach a real
relay whose reverse listeners accept only TLS, present a certificate from mitmproxy's
`certs` option (a throwaway CA the CLIs are told to trust, as they would trust Let's
Encrypt) and admit only a relay key, which each CLI sends as its API key; the fake
upstream must see the upstream key instead. Uses the CLI harness of
tests/test_agents_e2e.py (installed from npm on first use, skipped without npm).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ttft_relay.workers import free_port
from tests.agent_clis import AgentSandbox, claude_print, claude_result, codex_answer, codex_exec
from ttft_relay.testing.fakes import Behaviour, FakeUpstream, RefusingProxy
from ttft_relay.testing.fakes.replies import answer_text
from ttft_relay.testing.harness import MitmdumpProcess

RELAY_KEY = "relay-key-0123456789-laptop"
UPSTREAM_KEY = "sk-upstream-FAKEKEY-vps-0123456789"
PROMPT = "Say hello."


@pytest.fixture
def agent_fake() -> Iterator[FakeUpstream]:
    with FakeUpstream(behaviour=Behaviour(prefill_ms=50, gap_ms=10)) as upstream:
        yield upstream


def start_vps_relay(agent_fake, start_relay, certs, monkeypatch, relay_conf: Path | None = None,
                    **options) -> tuple[MitmdumpProcess, str]:
    """The relay as on a VPS; with `relay_conf`, started by its command (`ttft-relay run`,
    that file as its mitm.conf). Returns it and its base URL."""
    monkeypatch.setenv("RELAY_TEST_KEYS", RELAY_KEY)
    monkeypatch.setenv("UPSTREAM_TEST_KEY", UPSTREAM_KEY)
    port = free_port()
    relay = start_relay(f"reverse:{agent_fake.base_url}@{port}", relay_client_tls="all",
                        certs=f"localhost={certs.cert_and_key_pem}", relay_access_keys="env:RELAY_TEST_KEYS",
                        relay_upstream_keys="127.0.0.1=env:UPSTREAM_TEST_KEY", relay_conf=relay_conf, **options)
    relay.wait_for_output("tokenizer ready")
    return relay, f"https://localhost:{port}"


@pytest.fixture
def vps_relay(agent_fake, start_relay, certs, monkeypatch):
    return start_vps_relay(agent_fake, start_relay, certs, monkeypatch)[1]


def _upstream_credentials(fake: FakeUpstream) -> set[str]:
    """Every credential the fake was sent, on HTTP requests and WebSocket upgrades."""
    return {value for r in [*fake.received, *fake.sockets] for name in ("authorization", "x-api-key")
            if (value := r.header(name)) is not None}


def ask_codex(clis, url: str, certs, tmp_path, *, websockets: bool) -> None:
    """One Codex CLI turn through the relay at `url` with a relay key: it must get the fake's answer."""
    with RefusingProxy() as refusing:
        sandbox = AgentSandbox(tmp_path, refusing.url)
        sandbox.write_codex_config(url + "/v1", websockets=websockets)
        run = codex_exec(clis, sandbox, PROMPT, sandbox.env(RELAYTEST_OPENAI_KEY=RELAY_KEY,
                                                            CODEX_CA_CERTIFICATE=str(certs.ca_pem)))
    answer = codex_answer(run)
    assert run.returncode == 0 and answer is not None and answer[1] == answer_text(5), run.describe()


def test_codex_over_tls_with_a_relay_key(clis, agent_fake, vps_relay, certs, tmp_path):
    ask_codex(clis, vps_relay, certs, tmp_path, websockets=True)
    assert agent_fake.sockets and agent_fake.sockets[0].status == 101, "codex did not use its WebSocket"
    assert _upstream_credentials(agent_fake) == {f"Bearer {UPSTREAM_KEY}"}  # never the relay key


@pytest.mark.parametrize("http2", [None, True], ids=["relay-defaults", "http2-on"])
def test_codex_http_over_tls_takes_http1_and_the_direct_reads(http2, clis, agent_fake, start_relay, certs,
                                                              monkeypatch, tmp_path):
    """Codex's HTTP fallback offers h2 first. The relay as its command starts it answers it
    HTTP/1.1 and its stream goes socket to socket (the splice's direct reads); with
    mitmproxy's default (`http2: true`) it takes h2 and every event goes through the h2 layers."""
    conf = tmp_path / "mitm.conf"
    conf.write_text("# nothing: the relay's own defaults\n" if http2 is None else "http2: true\n")
    relay, url = start_vps_relay(agent_fake, start_relay, certs, monkeypatch, relay_conf=conf,
                                 termlog_verbosity="debug", relay_metrics_listen="127.0.0.1:0")
    ask_codex(clis, url, certs, tmp_path, websockets=False)
    asked = [r for r in agent_fake.received if r.path.split("?")[0].endswith("/responses")]
    assert not agent_fake.sockets and asked, "codex did not use HTTP"
    # mitmproxy's line of each flow names a version other than HTTP/1.1
    assert relay.wait_for_lines(r"POST \S+/responses" + (r" HTTP/2\.0$" if http2 else "$"), len(asked))
    # The requests' console lines come after any take-over by the direct reads (where each
    # body's direct reads end differs: Codex may close before the body's last chunk).
    models = "|".join(sorted({re.escape(str(orjson.loads(r.body).get("model"))) for r in asked}))
    relay.wait_for_lines(rf"· ttft .* · (?:{models}) \d+ → ", len(asked))
    direct = relay.wait_for_lines(r"direct reads of .*\)$", 0)
    assert bool(direct) == (not http2), relay.text()


def test_claude_code_over_tls_with_a_relay_key(clis, agent_fake, start_relay, certs, monkeypatch, tmp_path):
    relay, url = start_vps_relay(agent_fake, start_relay, certs, monkeypatch, termlog_verbosity="debug")
    with RefusingProxy() as refusing:
        sandbox = AgentSandbox(tmp_path, refusing.url)
        run = claude_print(clis, sandbox, PROMPT, sandbox.env(
            ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY=RELAY_KEY, NODE_EXTRA_CA_CERTS=str(certs.ca_pem)))
    result = claude_result(run)
    assert run.returncode == 0 and result is not None and result["result"] == answer_text(5), run.describe()
    credentials = _upstream_credentials(agent_fake)
    assert credentials and credentials <= {UPSTREAM_KEY, f"Bearer {UPSTREAM_KEY}"}  # never the relay key
    # Its streamed answer went socket to socket over TLS (the splice's direct reads).
    relay.wait_for_lines(r"direct reads of .*\)$", 1)
