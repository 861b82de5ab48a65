"""Upstream faults end to end, through a real mitmdump: what the client gets, what the record says.

Before the response head went out the client gets an HTTP error whose JSON body is
in the API's own format; after it, a last SSE error event in the API's format and a
clean end of the body (for chunked HTTP/1.1, the last chunk). Every case writes
exactly one record, with `error` and the phase it failed in. The official SDKs raise
their own error classes, not a decoding error.

Timeouts are set to 1 s (the options take whole seconds); nothing else waits on a
clock: the fake's stalls and gates hold the upstream until the relay gives up.

The cases differ by request (`x-fake-*` knobs) far more than by relay: one relay per
option set serves the module (`shared_relay`), and each test finds its record by its
`x-request-id`; once the relays stopped, each id must have exactly the records its test
counted (conftest's `Relays.close`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import anthropic
import certifi
import openai
import orjson
import pytest

from ttft_relay import apis
from ttft_relay.faults import addons as faults
from ttft_relay.faults import apierrors
from ttft_relay.timing import phases
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.hostile import HOLD, HostileUpstream
from ttft_relay.testing.harness import metrics_url, scrape, total

pytestmark = pytest.mark.shared_fake

WAIT = 20  # seconds: turns a hang into a failure

REQUESTS = {
    apis.OPENAI_CHAT: ("/v1/chat/completions", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
    apis.ANTHROPIC_MESSAGES: ("/v1/messages", {"model": "claude-sonnet-4", "max_tokens": 64,
                                                "messages": [{"role": "user", "content": "hi"}]}),
}
APIS = list(REQUESTS)
TIMEOUTS_1S = {"relay_upstream_head_timeout": 1, "relay_first_token_timeout": 1, "relay_idle_timeout": 1}


def body_for(api: str, stream: bool) -> tuple[str, dict]:
    path, body = REQUESTS[api]
    return path, {**body, "stream": stream}


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    """A loopback port bound by no listener for the module's life: connecting is refused."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield bound.getsockname()[1]


@pytest.fixture(scope="module")
def hanging_port() -> Iterator[int]:
    """A listener whose accept queue is full drops further SYNs: a connect to it hangs."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        for s in fillers:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        yield port
        for s in fillers:
            s.close()


def refused(shared_relay, closed_port: int, strategy: str = "eager"):
    return shared_relay(f"reverse:http://127.0.0.1:{closed_port}@0", connection_strategy=strategy)


def one_record(relay, rid: str) -> dict:
    (rec,) = relay.log.of(rid)
    return rec


def assert_api_error_body(api: str, response: client.RawResponse, status: int) -> str:
    """The body is the API's error JSON; returns its message."""
    assert response.status == status, response.read()[:300]
    assert response.header("content-type") == "application/json"
    assert response.header(faults.ERROR_HEADER) == apierrors.error_code(status)
    body = orjson.loads(response.read())
    if api == apis.ANTHROPIC_MESSAGES:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


def read_stream(response: client.RawResponse) -> bytes:
    """The whole streamed body; fails unless it ended cleanly (last chunk received)."""
    body = b"".join(chunk.data for chunk in response.chunks())
    assert response.complete
    return body


def last_event(api: str, body: bytes) -> dict:
    """The final SSE event of `body`, which must be the API's error event."""
    event = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    lines = event.split(b"\n")
    data = orjson.loads(lines[-1].removeprefix(b"data: "))
    if api == apis.ANTHROPIC_MESSAGES:
        assert lines[0] == b"event: error"
        assert data["type"] == "error" and data["error"]["type"] in ("api_error", "timeout_error")
    elif api == apis.OPENAI_RESPONSES:  # as the API ends a failed response: what Codex acts on
        assert lines[0] == b"event: response.failed"
        assert data["type"] == "response.failed" and data["response"]["status"] == "failed"
        assert set(data["response"]["error"]) == {"code", "message"}
        return data["response"]["error"]
    else:
        assert len(lines) == 1 and set(data["error"]) == {"message", "type", "param", "code"}
    return data["error"]


def post(relay, api: str, stream: bool, headers: dict | None = None, *, rid: str | None = None):
    path, body = body_for(api, stream)
    headers = {**(headers or {}), **({"x-request-id": rid} if rid else {})}
    return client.request("POST", relay.url() + path, body, headers, timeout=WAIT)


# --- before the response head: an HTTP error in the API's format ------------------------


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
@pytest.mark.parametrize("api", APIS)
def test_connection_refused(api, strategy, shared_relay, closed_port, rid):
    relay = refused(shared_relay, closed_port, strategy)
    conn, response = post(relay, api, stream=True, rid=rid)
    with conn:
        assert "Connect call failed" in assert_api_error_body(api, response, 502)
    rec = one_record(relay, rid)
    assert rec["error_phase"] == "upstream_connect" and "Connect call failed" in rec["error"]
    assert rec["status"] is None and rec["verdict"] == "error in upstream connect"


def connect_through(relay, port: int) -> bytes:
    """The status line a CONNECT to 127.0.0.1:`port` through `relay` gets."""
    with socket.create_connection(("127.0.0.1", relay.port), timeout=WAIT) as s:
        s.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (port, port))
        return s.makefile("rb").readline()


def test_a_failed_connect_in_https_proxy_mode_is_recorded_and_counted(start_relay, closed_port):
    # Regular mode connects upstream on CONNECT (eager): no request ever comes.
    relay = start_relay("regular@0", relay_metrics_listen="127.0.0.1:0")
    port = closed_port
    assert connect_through(relay, port).startswith(b"HTTP/1.1 502")
    # The hook that records and counts runs before mitmproxy answers the CONNECT.
    samples = scrape(metrics_url(relay))
    assert total(samples, "gen_ai_client_operation_duration_seconds_count", error_type="upstream_connect") == 1
    relay.stop()
    (rec,) = relay.log.records()
    assert rec["error_phase"] == "upstream_connect" and "Connect call failed" in rec["error"]
    assert rec["status"] is None and rec["verdict"] == "error in upstream connect"
    assert rec["upstream"] == f"127.0.0.1:{port}"


def test_a_connect_refused_for_proxy_auth_is_not_a_failure_to_record(start_relay, closed_port):
    relay = start_relay("regular@0", proxyauth="user:secret")
    assert connect_through(relay, closed_port).startswith(b"HTTP/1.1 407")
    relay.stop()
    assert relay.log.records() == []


@pytest.mark.parametrize("api", APIS)
def test_dns_failure(api, shared_relay, rid):
    relay = shared_relay("reverse:http://nonexistent.invalid:80@0")
    conn, response = post(relay, api, stream=False, rid=rid)
    with conn:
        assert_api_error_body(api, response, 502)
    rec = one_record(relay, rid)
    assert rec["error_phase"] == "upstream_connect" and rec["error"]


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
@pytest.mark.parametrize("api", APIS)
def test_tls_failure(api, strategy, fake_tls, shared_relay, rid):
    # Public CAs only: the fake's test certificate is not trusted.
    relay = shared_relay(reverse_to(fake_tls), ssl_verify_upstream_trusted_ca=certifi.where(),
                         connection_strategy=strategy)
    conn, response = post(relay, api, stream=True, rid=rid)
    with conn:
        assert "certificate verify failed" in assert_api_error_body(api, response, 502).lower()
    rec = one_record(relay, rid)
    assert rec["error_phase"] == "upstream_tls" and "verify failed" in rec["error"].lower()
    assert fake_tls.received == []


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("api", APIS)
def test_reset_before_headers(api, stream, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    conn, response = post(relay, api, stream, {"x-fake-reset-before-headers": "1"}, rid=rid)
    with conn:
        assert_api_error_body(api, response, 502)
    rec = one_record(relay, rid)
    assert rec["error_phase"] == "upstream_wait" and rec["error"]
    assert fake.wait_finished(1, WAIT) and fake.sent[-1].outcome == "reset"


@pytest.mark.parametrize("api", APIS)
def test_slow_headers_hit_the_head_timeout(api, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), **TIMEOUTS_1S)
    conn, response = post(relay, api, stream=False, headers={"x-fake-slow-headers-ms": "30000"}, rid=rid)
    with conn:
        assert "no response head after 1 s" in assert_api_error_body(api, response, 504)
    assert fake.wait_finished(1, WAIT)
    assert fake.sent[-1].outcome == "client_closed"  # the relay let go of the upstream
    rec = one_record(relay, rid)
    assert rec["error"] == "no response head after 1 s" and rec["error_phase"] == "upstream_wait"


@pytest.mark.parametrize("api", APIS)
def test_connect_timeout(api, shared_relay, hanging_port, rid):
    relay = shared_relay(f"reverse:http://127.0.0.1:{hanging_port}@0", relay_connect_timeout=1,
                         connection_strategy="lazy")
    conn, response = post(relay, api, stream=True, rid=rid)
    with conn:
        assert "upstream connect timeout after 1 s" in assert_api_error_body(api, response, 504)
    rec = one_record(relay, rid)
    assert rec["error"] == "upstream connect timeout after 1 s" and rec["error_phase"] == "upstream_connect"


@pytest.mark.parametrize("status", [429, 500, 503])
@pytest.mark.parametrize("api", APIS)
def test_upstream_error_status_passes_through_unchanged(api, status, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    conn, response = post(relay, api, stream=True, headers={"x-fake-status": str(status)}, rid=rid)
    with conn:
        assert response.status == status
        assert response.header(faults.ERROR_HEADER) is None
        body = response.read()
    assert fake.wait_finished(1, WAIT)
    assert body == fake.sent[-1].body
    rec = one_record(relay, rid)
    assert rec["status"] == status and rec["error"] == f"HTTP {status}" and rec["error_phase"] == "upstream_wait"


# --- after the head: a last SSE error event and a clean end -----------------------------


@pytest.mark.parametrize("api", APIS)
def test_reset_mid_stream(api, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    conn, response = post(relay, api, stream=True, headers={"x-fake-reset-after-chunks": "4"}, rid=rid)
    with conn:
        assert response.status == 200
        body = read_stream(response)
    assert fake.wait_finished(1, WAIT)
    sent = fake.sent[-1]
    assert sent.outcome == "reset" and body.startswith(sent.body)
    error = last_event(api, body[len(sent.body):])
    assert "ttft-relay" in error["message"]
    rec = one_record(relay, rid)
    assert rec["status"] == 200 and rec["error"] and rec["error_phase"] == "stream"
    assert not rec["client_aborted"]


@pytest.mark.parametrize("api", APIS)
def test_stall_before_first_token_hits_the_first_token_timeout(api, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), **TIMEOUTS_1S)
    conn, response = post(relay, api, stream=True, headers={"x-fake-stall-after-chunks": "0"}, rid=rid)
    with conn:
        assert response.status == 200
        body = read_stream(response)
    assert "first token timeout after 1 s" in last_event(api, body)["message"]
    assert fake.wait_finished(1, WAIT) and fake.sent[-1].outcome == "client_closed"
    rec = one_record(relay, rid)
    assert rec["error"] == "first token timeout after 1 s" and rec["error_phase"] == "head_to_first_token"
    assert rec["verdict"].startswith("error in")
    # The second the request waited is in its phases: the unfinished one runs on to the end.
    p = rec["phases"]
    assert sum(p.get(name, 0.0) for name in phases.CRITICAL_PHASES) == pytest.approx(p["total"], abs=0.01), p
    assert p["head_to_first_token"] >= 900, p


@pytest.mark.parametrize("api", APIS)
def test_stall_mid_stream_hits_the_idle_timeout(api, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), **TIMEOUTS_1S)
    conn, response = post(relay, api, stream=True, headers={"x-fake-stall-after-chunks": "4"}, rid=rid)
    with conn:
        body = read_stream(response)
    assert fake.wait_finished(1, WAIT)
    sent = fake.sent[-1]
    assert body.startswith(sent.body)
    assert "stream idle for 1 s" in last_event(api, body[len(sent.body):])["message"]
    assert sent.outcome == "client_closed"
    rec = one_record(relay, rid)
    assert rec["error"] == "stream idle for 1 s" and rec["error_phase"] == "stream"
    assert rec["ttft_ms"] is not None


def test_a_buffered_stream_is_not_cut_by_bounds_it_cannot_watch(fake, shared_relay, rid):
    # relay_stream off: the relay sees no tokens, so a healthy slow stream must go through whole.
    relay = shared_relay(reverse_to(fake), relay_stream=False, **TIMEOUTS_1S)
    conn, response = post(relay, apis.OPENAI_CHAT, stream=True, headers={"x-fake-prefill-ms": "2500"}, rid=rid)
    with conn:
        assert response.status == 200
        body = read_stream(response)
    assert body == fake.sent[-1].body and body.endswith(b"data: [DONE]\n\n")
    rec = one_record(relay, rid)
    assert rec["error"] is None and rec["status"] == 200


@pytest.fixture(scope="module")
def hostile_upstream() -> Iterator[HostileUpstream]:
    """An upstream that answers as each request's `x-attack` says (ttft_relay/testing/fakes/hostile.py)."""
    held = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    with HostileUpstream({"head-then-nothing": lambda s: [held, HOLD],
                          "head-then-some": lambda s: [held + b'{"id": "chatcmpl-1", ', HOLD],
                          "head-then-slowly": lambda s: _dribbled(held, b'{"pad": "' + b"x" * 989 + b'"}', 6, 0.4)}
                         ) as upstream:
        yield upstream


def _dribbled(head: bytes, body: bytes, pieces: int, gap_s: float) -> Iterator[bytes]:
    yield head
    step = -(-len(body) // pieces)
    for i in range(0, len(body), step):
        time.sleep(gap_s)  # the fake upstream's pace, not a sync
        yield body[i:i + step]


@pytest.mark.parametrize("attack", ["head-then-nothing", "head-then-some"])
@pytest.mark.parametrize("api", APIS)
def test_a_held_body_that_stalls_after_its_head_gets_504_at_the_idle_deadline(api, attack, hostile_upstream,
                                                                                shared_relay, rid):
    # stream: false, a Content-Length of 1000 and then silence: the relay holds the body for its
    # length, sees no tokens, and bounds its silence by when its bytes last arrived.
    relay = shared_relay(f"reverse:{hostile_upstream.base_url}@0", **TIMEOUTS_1S)
    conn, response = post(relay, api, stream=False, headers={"x-attack": attack}, rid=rid)
    with conn:
        message = assert_api_error_body(api, response, 504)
    assert message == "ttft-relay: response body idle for 1 s"
    rec = one_record(relay, rid)
    assert (rec["status"], rec["error"], rec["error_phase"]) == (504, "response body idle for 1 s", "response_body")


def test_a_held_body_arriving_slowly_is_not_cut(hostile_upstream, shared_relay, rid):
    # 2.4 s for the body, never 1 s without a byte: healthy, however long it takes in all.
    relay = shared_relay(f"reverse:{hostile_upstream.base_url}@0", **TIMEOUTS_1S)
    conn, response = post(relay, apis.OPENAI_CHAT, stream=False, headers={"x-attack": "head-then-slowly"}, rid=rid)
    with conn:
        assert response.status == 200 and len(response.read()) == 1000
    assert one_record(relay, rid)["error"] is None


def test_a_failure_leaves_the_client_connection_usable(fake, shared_relay, rid):
    """The error reply closes the connection (so a new one retries the upstream);
    the relay serves the next connection normally."""
    relay = shared_relay(reverse_to(fake))
    conn, response = post(relay, apis.OPENAI_CHAT, True, {"x-fake-reset-before-headers": "1"}, rid=rid)
    with conn:
        assert response.status == 502 and response.header("connection") == "close"
    conn, response = post(relay, apis.OPENAI_CHAT, True, rid=rid)
    with conn:
        assert response.status == 200 and read_stream(response).endswith(b"data: [DONE]\n\n")
    assert [r["error"] is not None for r in relay.log.of(rid, 2)] == [True, False]


# --- the SDKs see their own errors -------------------------------------------------------


def openai_client(relay) -> openai.OpenAI:
    """Closed with `with`: a kept-alive connection would keep the shared fake's open."""
    return openai.OpenAI(base_url=relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0, timeout=WAIT)


def anthropic_client(relay) -> anthropic.Anthropic:
    """Closed with `with`, as `openai_client`."""
    return anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)


def chat(sdk: openai.OpenAI, stream: bool):
    result = sdk.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=stream)
    return list(result) if stream else result


def message(sdk: anthropic.Anthropic, stream: bool):
    result = sdk.messages.create(model="claude-sonnet-4", max_tokens=64,
                                 messages=[{"role": "user", "content": "hi"}], stream=stream)
    return list(result) if stream else result


@pytest.mark.parametrize("stream", [True, False])
def test_openai_sdk_raises_its_status_error_before_the_head(stream, shared_relay, closed_port):
    relay = refused(shared_relay, closed_port)
    with openai_client(relay) as sdk, pytest.raises(openai.InternalServerError) as caught:
        chat(sdk, stream)
    assert caught.value.status_code == 502 and "ttft-relay" in caught.value.message


@pytest.mark.parametrize("stream", [True, False])
def test_anthropic_sdk_raises_its_status_error_before_the_head(stream, shared_relay, closed_port):
    relay = refused(shared_relay, closed_port)
    with anthropic_client(relay) as sdk, pytest.raises(anthropic.InternalServerError) as caught:
        message(sdk, stream)
    assert caught.value.status_code == 502 and caught.value.body["error"]["type"] == "api_error"


def test_openai_sdk_raises_api_error_from_the_stream(fake, shared_relay):
    relay = shared_relay(reverse_to(fake))
    fake.behaviour.reset_after_chunks = 3
    with openai_client(relay) as sdk, pytest.raises(openai.APIError) as caught:
        chat(sdk, stream=True)
    assert "ttft-relay" in caught.value.message and not isinstance(caught.value, openai.APIConnectionError)


def test_anthropic_sdk_raises_api_error_from_the_stream(fake, shared_relay):
    relay = shared_relay(reverse_to(fake), **TIMEOUTS_1S)
    fake.behaviour.stall_after_chunks = 4
    with anthropic_client(relay) as sdk, pytest.raises(anthropic.APIStatusError) as caught:
        message(sdk, stream=True)
    assert "stream idle for 1 s" in str(caught.value)


def test_sdks_raise_rate_limit_errors_unchanged(fake, shared_relay):
    relay = shared_relay(reverse_to(fake))
    fake.behaviour.status = 429
    with openai_client(relay) as sdk, pytest.raises(openai.RateLimitError):
        chat(sdk, stream=True)
    with anthropic_client(relay) as sdk, pytest.raises(anthropic.RateLimitError):
        message(sdk, stream=False)


# --- the client goes away ----------------------------------------------------------------


@pytest.mark.parametrize("stall", [False, True])
def test_client_gone_mid_stream_closes_the_upstream(stall, fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    headers = {"x-fake-stall-after-chunks": "3"} if stall else {}
    gate = None if stall else fake.hold_before_chunk(3)
    conn, response = post(relay, apis.OPENAI_CHAT, True, headers, rid=rid)
    assert response.status == 200
    assert fake.wait_chunk_sent(2, WAIT)
    conn.close()
    assert fake.wait_finished(1, WAIT)
    assert fake.sent[-1].outcome == "client_closed"
    assert fake.wait_closed(fake.received[-1].conn_id, WAIT)  # nothing of the upstream connection is left
    if gate is not None:
        gate.set()
    rec = one_record(relay, rid)
    assert rec["client_aborted"] is True and rec["verdict"].startswith("client aborted")
