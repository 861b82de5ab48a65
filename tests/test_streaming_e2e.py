"""End to end: a real mitmdump with the relay, a fake upstream, real clients.

"No buffering" is proved by causality, not by clocks: the fake upstream holds a
later chunk back, and the client must already have everything sent before it,
first token included, while the chunk is still held.

Cases that differ only by request share a relay per option set (`shared_relay`) and find
their records by their `x-request-id` (`rid`).
"""

from __future__ import annotations

import http.client
import json
import ssl

import anthropic
import openai
import pytest

from ttft_relay import apis
from ttft_relay.stream import sse
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.replies import answer_text

pytestmark = pytest.mark.shared_fake

HELD_CHUNK = 6  # every API's stream carries its first token before its seventh event
CHUNKS = 8
WAIT = 20  # seconds: a bound that turns a hang into a failure, not a sync

REQUESTS = {
    apis.OPENAI_CHAT: ("/v1/chat/completions", {
        "model": "gpt-4o-mini", "stream": True,
        "messages": [{"role": "user", "content": "Say hello"}]}),
    apis.OPENAI_RESPONSES: ("/v1/responses", {"model": "gpt-4.1", "stream": True, "input": "Say hello"}),
    apis.ANTHROPIC_MESSAGES: ("/v1/messages", {
        "model": "claude-opus-4-6", "stream": True, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Say hello"}]}),
    apis.GEMINI: ("/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
                   {"contents": [{"role": "user", "parts": [{"text": "Say hello"}]}]}),
}


def read_exactly(chunks, expected: bytes) -> bytes:
    got = b""
    while len(got) < len(expected):
        got += next(chunks).data
    return got


@pytest.mark.parametrize("api", list(REQUESTS))
def test_chunks_reach_the_client_while_upstream_holds_the_rest(api, fake, shared_relay):
    fake.behaviour.chunks = CHUNKS
    relay = shared_relay(reverse_to(fake))
    path, body = REQUESTS[api]
    resp = assert_streamed_unbuffered(fake, relay.url() + path, body, api)
    assert resp.header("x-accel-buffering") == "no"


PROVIDER_PATHS = {
    "/backend-api/codex/responses": apis.OPENAI_RESPONSES,  # Codex CLI signed in with ChatGPT
    "/openai/deployments/my-gpt-4o/chat/completions?api-version=2024-10-21": apis.OPENAI_CHAT,  # Azure
    "/openai/v1/responses": apis.OPENAI_RESPONSES,  # Azure's v1 API
    "/api/v1/chat/completions": apis.OPENAI_CHAT,  # OpenRouter
    "/v1beta/openai/chat/completions": apis.OPENAI_CHAT,  # Gemini's OpenAI-compatible API
    "/anthropic/v1/messages": apis.ANTHROPIC_MESSAGES,  # the Anthropic-compatible base URLs providers give
}


def test_streams_under_every_provider_prefix_are_unbuffered_and_recorded(fake, shared_relay, rid):
    fake.behaviour.chunks = CHUNKS
    relay = shared_relay(reverse_to(fake))
    for path, api in PROVIDER_PATHS.items():
        assert_streamed_unbuffered(fake, relay.url() + path, REQUESTS[api][1], api, {"x-request-id": rid})
    recs = relay.log.of(rid, len(PROVIDER_PATHS))
    assert [(r["api"], r["status"], r["stream"]) for r in recs] == [(api, 200, True) for api in PROVIDER_PATHS.values()]
    assert all(r["ttft_ms"] is not None and r["transport"] == "http" for r in recs)


def assert_streamed_unbuffered(fake, url: str, body, api: str, headers: dict | None = None):
    """POST `body` to `url` (through a relay) while the fake holds chunk HELD_CHUNK back: the
    client must already have every byte sent before it, first token included; then the rest,
    byte for byte. Returns the response."""
    gate = fake.hold_before_chunk(HELD_CHUNK)
    conn, resp = client.request("POST", url, body, headers, timeout=WAIT)
    with conn:
        assert resp.status == 200, url
        assert fake.wait_chunk_sent(HELD_CHUNK - 1, WAIT)
        sent_so_far = fake.sent[-1].body
        chunks = resp.chunks()
        before_release = read_exactly(chunks, sent_so_far)
        # The client has every byte sent so far, and the upstream still holds the rest.
        assert before_release == sent_so_far
        assert not gate.is_set()
        watcher = sse.StreamWatcher(apis.get(api))
        watcher.feed(before_release, 0.0)
        assert watcher.first_token is not None, "the first token reached the client"

        gate.set()
        rest = b"".join(c.data for c in chunks)
    # Byte for byte what the upstream sent, request body untouched on the way up.
    assert before_release + rest == fake.sent[-1].body
    assert fake.received[-1].body == client._encode_body(body)
    return resp


def test_out_of_scope_streams_are_streamed_and_otherwise_untouched(fake, shared_relay, rid):
    fake.behaviour.chunks = CHUNKS
    relay = shared_relay(reverse_to(fake), relay_scope="^/v1/")
    path, body = "/other/chat/completions", REQUESTS[apis.OPENAI_CHAT][1]
    resp = assert_streamed_unbuffered(fake, relay.url() + path, body, apis.OPENAI_CHAT, {"x-request-id": rid})
    assert resp.header("x-accel-buffering") is None and resp.header("server-timing") is None
    assert fake.received[-1].header("accept-encoding") is None
    relay.log.none_of(rid)  # checked once the relay stopped


def test_bodiless_answers_pass_untouched_and_the_connection_stays_usable(fake, shared_relay):
    relay = shared_relay(reverse_to(fake))
    path, body = REQUESTS[apis.OPENAI_CHAT]
    with client.HttpConnection(relay.url(), timeout=WAIT) as conn:
        for method, status in [("POST", 204), ("POST", 304), ("HEAD", 200)]:
            resp = conn.request(method, path, body, {"x-fake-status": str(status)})
            assert resp.status == status
            assert resp.header("transfer-encoding") is None and resp.header("x-accel-buffering") is None
            assert resp.read() == b""
        # h11 and httpx read a stray "0\r\n\r\n" here as an illegal status line.
        resp = conn.request("POST", path, body)
        assert resp.status == 200 and resp.read().endswith(b"data: [DONE]\n\n")


def test_streamed_requests_ask_upstream_for_identity_encoding(fake, shared_relay):
    relay = shared_relay(reverse_to(fake))
    path, body = REQUESTS[apis.OPENAI_CHAT]
    got = b"".join(c.data for c in client.stream_post(
        relay.url() + path, body, {"accept-encoding": "gzip"}))
    assert fake.received[-1].header("accept-encoding") == "identity"
    assert got == fake.sent[-1].body and b"[DONE]" in got


def test_mitm_conf_is_below_the_command_line(fake, start_relay, tmp_path):
    conf = tmp_path / "mitm.conf"
    conf.write_text("relay_scope: '^/never/'\n")
    path, body = REQUESTS[apis.OPENAI_CHAT]

    relay = start_relay(reverse_to(fake), relay_conf=conf)
    conn, resp = client.request("POST", relay.url() + path, body)
    with conn:
        resp.read()
        assert resp.header("x-accel-buffering") is None  # mitm.conf took the path out of scope

    relay = start_relay(reverse_to(fake), relay_conf=conf, relay_scope="^/v1/")
    conn, resp = client.request("POST", relay.url() + path, body)
    with conn:
        resp.read()
        assert resp.header("x-accel-buffering") == "no"  # --set won over mitm.conf


# --- the official SDKs, reverse mode and HTTPS-proxy mode -------------------------


def _openai_client(relay, upstream, mode: str) -> openai.OpenAI:
    """Closed with `with`: a kept-alive connection would keep the shared fake's open."""
    if mode == "reverse":
        return openai.OpenAI(base_url=relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0)
    return openai.OpenAI(
        base_url=upstream.base_url + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0,
        http_client=openai.DefaultHttpxClient(
            proxy=relay.url(), verify=ssl.create_default_context(cafile=str(relay.ca_pem))),
    )


def _anthropic_client(relay, upstream, mode: str) -> anthropic.Anthropic:
    """Closed with `with`, as `_openai_client`."""
    if mode == "reverse":
        return anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0)
    return anthropic.Anthropic(
        base_url=upstream.base_url, api_key=FAKE_ANTHROPIC_KEY, max_retries=0,
        http_client=anthropic.DefaultHttpxClient(
            proxy=relay.url(), verify=ssl.create_default_context(cafile=str(relay.ca_pem))),
    )


@pytest.fixture(params=["reverse", "regular"])
def sdk_setup(request, fake, fake_tls, shared_relay):
    """(mode, relay, upstream): reverse mode over plain HTTP, or the relay as an HTTPS
    proxy in front of a TLS upstream, the client trusting the relay's CA."""
    if request.param == "reverse":
        return "reverse", shared_relay(reverse_to(fake)), fake
    return "regular", shared_relay("regular@0"), fake_tls


def _first_token_arrives_while_held(upstream, texts) -> str:
    """Consume `texts` (text deltas as the SDK yields them); at the first one, the
    upstream must still be holding chunk HELD_CHUNK."""
    gate = upstream.hold_before_chunk(HELD_CHUNK)
    collected = []
    for text in texts:
        if not collected:
            assert not gate.is_set() and upstream.sent[-1].chunks_sent <= HELD_CHUNK
            gate.set()
        collected.append(text)
    return "".join(collected)


def test_openai_sdk_chat_stream(sdk_setup):
    mode, relay, upstream = sdk_setup
    upstream.behaviour.chunks = CHUNKS

    def texts():
        stream = sdk.chat.completions.create(
            model="gpt-4o-mini", stream=True, messages=[{"role": "user", "content": "Say hello"}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content

    with _openai_client(relay, upstream, mode) as sdk:
        assert _first_token_arrives_while_held(upstream, texts()) == answer_text(CHUNKS)
    assert upstream.received[-1].header("authorization") == f"Bearer {FAKE_OPENAI_KEY}"


def test_openai_sdk_responses_stream(sdk_setup):
    mode, relay, upstream = sdk_setup
    upstream.behaviour.chunks = CHUNKS

    def texts():
        for event in sdk.responses.create(model="gpt-4.1", input="Say hello", stream=True):
            if event.type == "response.output_text.delta":
                yield event.delta

    with _openai_client(relay, upstream, mode) as sdk:
        assert _first_token_arrives_while_held(upstream, texts()) == answer_text(CHUNKS)


def test_anthropic_sdk_messages_stream(sdk_setup):
    mode, relay, upstream = sdk_setup
    upstream.behaviour.chunks = CHUNKS

    def texts():
        with sdk.messages.stream(model="claude-opus-4-6", max_tokens=64,
                                 messages=[{"role": "user", "content": "Say hello"}]) as stream:
            yield from stream.text_stream

    with _anthropic_client(relay, upstream, mode) as sdk:
        assert _first_token_arrives_while_held(upstream, texts()) == answer_text(CHUNKS)
    got = upstream.received[-1]
    # The SDK sends its key as x-api-key or, in newer versions, as a Bearer token.
    assert FAKE_ANTHROPIC_KEY in (got.header("x-api-key"), got.header("authorization").removeprefix("Bearer "))


def test_non_streamed_sdk_calls_still_work(sdk_setup):
    mode, relay, upstream = sdk_setup
    with _openai_client(relay, upstream, mode) as sdk:
        reply = sdk.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == answer_text(upstream.behaviour.chunks)


@pytest.mark.parametrize("interim", [100, 103])
def test_an_interim_answer_before_the_real_one_does_not_cost_the_real_one(interim, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    path, body = REQUESTS[apis.OPENAI_CHAT]
    with client.HttpConnection(relay.url(), timeout=WAIT) as conn:
        resp = conn.request("POST", path, body, {"x-fake-interim-status": str(interim), "x-request-id": rid})
        assert resp.status == 200  # (the raw client skips interim answers, as h11 and httpx do)
        assert resp.read() == fake.sent[-1].body
        resp = conn.request("POST", path, body, {"x-request-id": rid})  # and the connection carries on
        assert resp.status == 200 and resp.read().endswith(b"data: [DONE]\n\n")
    assert [r["status"] for r in relay.log.of(rid, 2)] == [200, 200]


@pytest.mark.parametrize("client_tls, upstream_tls", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["plain", "upstream-tls", "client-tls", "both-tls"])
def test_direct_reads_carry_long_streams_exactly(client_tls, upstream_tls, request, certs, shared_relay):
    """Long streams (reads of one event or several, cut anywhere, TLS records likewise),
    two on one kept-alive connection, plain TCP or TLS on either
    side: the client gets the upstream's bytes exactly, the upstream's reads went below
    mitmproxy (`patches/speed/splice.py`, its debug lines), and each body's end was mitmproxy's again."""
    fake = request.getfixturevalue("fake_tls" if upstream_tls else "fake")
    options: dict[str, object] = {"termlog_verbosity": "debug"}
    if client_tls:
        options.update(relay_client_tls="all", certs=f"localhost={certs.cert_and_key_pem}")
    relay = shared_relay(reverse_to(fake), **options)
    path, body = REQUESTS[apis.OPENAI_CHAT]
    payload = json.dumps(body).encode()
    # 1 ms apart: reads of one event or of several, and many chances for the direct reads
    # to take over (events written all at once may all be parsed in the body's first read).
    knobs = {"content-type": "application/json", "x-fake-chunks": "400", "x-fake-gap-ms": "1"}
    verify = ssl.create_default_context(cafile=str(certs.ca_pem))

    def fetch(port: int, times: int, tls: bool) -> list[bytes]:
        conn = (http.client.HTTPSConnection("localhost", port, timeout=WAIT, context=verify) if tls
                else http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT))
        try:
            bodies = []
            for _ in range(times):
                conn.request("POST", path, payload, knobs)
                resp = conn.getresponse()
                assert resp.status == 200 and resp.getheader("transfer-encoding") == "chunked"
                bodies.append(resp.read())
            return bodies
        finally:
            conn.close()

    [expected] = fetch(fake.port, 1, upstream_tls)
    assert expected.count(b"data:") > 400
    taken, ended = r"direct reads of .*\)$", "direct reads of .* end: bytes for h11"
    before = len(relay.wait_for_lines(taken, 0)), len(relay.wait_for_lines(ended, 0))
    assert fetch(relay.port, 2, client_tls) == [expected, expected]
    # each body taken over (at least once), its end handed back
    relay.wait_for_lines(taken, before[0] + 2)
    relay.wait_for_lines(ended, before[1] + 2)


@pytest.mark.parametrize("options, path", [
    ({"relay_stream_splice": False}, "mitmproxy"),
    ({"relay_stream_direct_reads": False}, "splice"),
    ({}, "direct"),
], ids=["mitmproxy", "splice", "direct"])
def test_each_record_names_the_path_that_carried_its_body(options, path, fake, shared_relay, rid):
    """`body_path` (docs/records.md): the same long chunked stream through mitmproxy's layers
    (the splice off), the splice (its direct reads off), and the direct reads (the default)."""
    relay = shared_relay(reverse_to(fake), **options)
    route, body = REQUESTS[apis.OPENAI_CHAT]
    knobs = {"x-fake-chunks": "100", "x-fake-gap-ms": "1", "x-request-id": rid}
    streamed = b"".join(chunk.data for chunk in client.stream_post(relay.url() + route, body, knobs))
    assert streamed.endswith(b"data: [DONE]\n\n")
    (rec,) = relay.log.of(rid)
    assert rec["body_path"] == path
