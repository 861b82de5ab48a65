"""Client-side TLS with the user's certificate: a real mitmdump, the official SDKs, a throwaway CA.

The relay presents the certificate named by mitmproxy's `certs` option (here for
`localhost`, signed by a test CA the clients trust, standing in for Let's Encrypt),
refuses plain HTTP on its TLS listeners, and on SIGHUP serves a renewed certificate
while a stream that started under the old one carries on to its end.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import threading

import anthropic
import openai
import orjson
import pytest

from ttft_relay.guard import tls
from ttft_relay.workers import free_port
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.replies import answer_text
from ttft_relay.testing.harness import read_records

RELAY_KEY = "relay-key-0123456789-tls-test"
UPSTREAM_KEY = "sk-upstream-FAKEKEY-tls-0123456789"
CHUNKS = 6


@pytest.fixture
def tls_relay(fake, start_relay, certs, tmp_path, monkeypatch):
    """A relay whose two reverse listeners (OpenAI-, Anthropic-shaped, both to the fake)
    accept only TLS, with relay access keys, presenting `certs`' localhost certificate
    from a file that the test may replace (a renewal)."""
    monkeypatch.setenv("RELAY_TEST_KEYS", RELAY_KEY)
    monkeypatch.setenv("UPSTREAM_TEST_KEY", UPSTREAM_KEY)
    cert_file = tmp_path / "relay.pem"
    shutil.copy(certs.cert_and_key_pem, cert_file)
    relay = start_relay(reverse_to(fake), f"reverse:{fake.base_url}@{free_port()}", relay_client_tls="all", certs=f"localhost={cert_file}",
                        relay_access_keys="env:RELAY_TEST_KEYS", relay_upstream_keys="127.0.0.1=env:UPSTREAM_TEST_KEY")
    relay.cert_file = cert_file
    relay.wait_for_output("tokenizer ready")  # the relay's addons are configured
    return relay


def _verify(ca) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def _openai(port: int, ca, scheme: str = "https") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scheme}://localhost:{port}/v1", api_key=RELAY_KEY, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=_verify(ca)))


def _chat_text(sdk: openai.OpenAI) -> str:
    stream = sdk.chat.completions.create(model="gpt-4o-mini", stream=True,
                                         messages=[{"role": "user", "content": "Say hello"}])
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _records(tmp_path) -> list[dict]:
    return read_records(tmp_path / "timing.jsonl")


def test_sdks_verify_the_relays_certificate_and_stream(tls_relay, fake, certs):
    fake.behaviour.chunks = CHUNKS
    assert _chat_text(_openai(tls_relay.ports[0], certs.ca_pem)) == answer_text(CHUNKS)
    assert fake.received[-1].header("authorization") == f"Bearer {UPSTREAM_KEY}"  # the relay key was swapped

    sdk = anthropic.Anthropic(base_url=f"https://localhost:{tls_relay.ports[1]}", api_key=RELAY_KEY, max_retries=0,
                              http_client=anthropic.DefaultHttpxClient(verify=_verify(certs.ca_pem)))
    with sdk.messages.stream(model="claude-opus-4-6", max_tokens=64,
                             messages=[{"role": "user", "content": "Say hello"}]) as stream:
        assert "".join(stream.text_stream) == answer_text(CHUNKS)

    # The SDKs do verify: a client that trusts only other CAs (here the relay's own
    # mitmproxy CA, which it does not use for this name) refuses the connection.
    with pytest.raises(openai.APIConnectionError):
        _chat_text(_openai(tls_relay.ports[0], tls_relay.ca_pem))
    assert len(fake.received) == 2


def test_plain_http_to_a_tls_listener_is_refused_clearly(tls_relay, fake, certs, tmp_path):
    with pytest.raises(openai.BadRequestError) as e:
        _chat_text(_openai(tls_relay.ports[0], certs.ca_pem, scheme="http"))
    assert e.value.status_code == 400 and tls.PLAIN_HTTP_REFUSED in str(e.value)
    assert e.value.response.headers["connection"] == "close"

    body = b'{"model":"claude-x","max_tokens":5,"messages":[]}'
    conn, resp = client.request("POST", tls_relay.url(1) + "/v1/messages", body,
                                headers={"x-api-key": RELAY_KEY, "anthropic-version": "2023-06-01"})
    with conn:
        error = orjson.loads(resp.read())
    assert resp.status == 400 and error["type"] == "error"  # Anthropic's error shape
    assert tls.PLAIN_HTTP_REFUSED in error["error"]["message"]
    assert fake.received == []  # nothing went upstream

    tls_relay.stop()
    refused = [r for r in _records(tmp_path) if r["error"] == tls.PLAIN_HTTP_REFUSED]
    assert len(refused) == 2 and {r["error_phase"] for r in refused} == {"relay"}


def _peer_ca_trusted(port: int, ca) -> bool:
    """Whether a TLS handshake with the relay verifies against `ca` (a new connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            _verify(ca).wrap_socket(sock, server_hostname="localhost").close()
        except ssl.SSLCertVerificationError:
            return False
    return True


def test_a_renewed_certificate_is_served_after_sighup_and_a_running_stream_finishes(
        tls_relay, fake, certs, tmp_path):
    fake.behaviour.chunks = CHUNKS
    gate = fake.hold_before_chunk(3)
    texts: list[str] = []
    streaming = threading.Thread(target=lambda: texts.append(_chat_text(_openai(tls_relay.ports[0], certs.ca_pem))))
    streaming.start()
    assert fake.wait_chunk_sent(2)

    renewed = TestCerts.create(tmp_path / "renewed")  # another CA: which one verifies tells the certificates apart
    tls_relay.cert_file.write_bytes(renewed.cert_and_key_pem.read_bytes())
    tls_relay.proc.send_signal(1)  # SIGHUP
    tls_relay.wait_for_output("reloaded on SIGHUP")
    assert _peer_ca_trusted(tls_relay.ports[0], renewed.ca_pem)
    assert not _peer_ca_trusted(tls_relay.ports[0], certs.ca_pem)

    gate.set()
    streaming.join(10)
    assert texts == [answer_text(CHUNKS)]  # the stream begun under the old certificate, whole

    # A broken file on the next reload: refused, and the renewed certificate stays.
    tls_relay.cert_file.write_bytes(renewed.cert_pem.read_bytes())  # the key is missing
    tls_relay.proc.send_signal(1)
    tls_relay.wait_for_output("reload: kept the current certs: .*holds no unencrypted private key")
    assert _peer_ca_trusted(tls_relay.ports[0], renewed.ca_pem)
