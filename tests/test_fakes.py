"""The fakes do what they claim: wire formats the real SDKs accept, knobs, gates, TLS, forwarder, client.

Timing checks here are lower bounds only (a sleep never ends early); nothing asserts
that something was fast, since this machine is noisy.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import zlib
from http.client import IncompleteRead
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest

from ttft_relay.testing import sse_samples
from ttft_relay.testing.fakes import Behaviour, DelayingForwarder, FakeUpstream, TestCerts, answer_pieces, answer_text
from ttft_relay.testing.fakes.client import HttpConnection, request, slow_upload, stream_post
from ttft_relay.testing.fakes.h2_wire import H2Client
from ttft_relay.testing.fakes.replies import prompt_tokens, usage_kw
from ttft_relay.testing.fakes.upstream import PromptCache
from ttft_relay.testing.fakes.upstream import main as upstream_main

REPO = Path(__file__).resolve().parent.parent
WAIT = 10.0  # generous upper bound for event waits: only a hang reaches it
DELAY_SLACK = 0.9  # lower-bound checks allow for timer granularity

STREAM_APIS = {
    "openai.chat": ("/v1/chat/completions", {"model": "gpt-test", "stream": True}, sse_samples.openai_chat_stream),
    "openai.responses": ("/v1/responses", {"model": "gpt-test", "stream": True}, sse_samples.responses_stream),
    "anthropic.messages": ("/v1/messages", {"model": "claude-test", "stream": True}, sse_samples.anthropic_stream),
    "gemini": ("/v1beta/models/gemini-test:streamGenerateContent?alt=sse", {"contents": []}, sse_samples.gemini_stream),
}
JSON_APIS = {
    "openai.chat": ("/v1/chat/completions", {"model": "gpt-test"}, sse_samples.openai_chat_completion),
    "openai.responses": ("/v1/responses", {"model": "gpt-test"}, sse_samples.responses_response),
    "anthropic.messages": ("/v1/messages", {"model": "claude-test"}, sse_samples.anthropic_message),
    "gemini": ("/v1beta/models/gemini-test:generateContent", {"contents": []}, sse_samples.gemini_response),
}
CHAT = "/v1/chat/completions"
CHAT_STREAM = {"model": "gpt-test", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def model_of(api: str, body: dict) -> str:
    return "gemini-test" if api == "gemini" else body["model"]


def usage(api: str, body: dict) -> dict[str, int]:
    """The sample bodies' usage arguments for this request: its size in tokens, as the fake reports it."""
    return usage_kw(api, *prompt_tokens(json.dumps(body).encode()))


# --- wire formats -------------------------------------------------------------


@pytest.mark.parametrize("api", STREAM_APIS)
def test_streams_the_sample_events_one_per_chunk(fake: FakeUpstream, api: str) -> None:
    path, body, build = STREAM_APIS[api]
    connection, response = request("POST", fake.base_url + path, body)
    with connection:
        chunks = [c.data for c in response.chunks()]
    assert response.status == 200
    assert response.header("content-type").startswith("text/event-stream")
    assert response.header("transfer-encoding") == "chunked"
    assert chunks == build(answer_pieces(5), model=model_of(api, body), **usage(api, body))
    assert fake.wait_finished(1, WAIT)
    assert fake.sent_bodies == [b"".join(chunks)]
    assert fake.sent[0].outcome == "complete"


@pytest.mark.parametrize("api", JSON_APIS)
def test_non_streamed_replies_are_the_sample_json(fake: FakeUpstream, api: str) -> None:
    path, body, build = JSON_APIS[api]
    connection, response = request("POST", fake.base_url + path, body)
    with connection:
        assert response.header("content-type") == "application/json"
        assert response.json() == build(answer_pieces(5), model=model_of(api, body), **usage(api, body))


def test_records_requests_in_order_with_headers_and_body(fake: FakeUpstream) -> None:
    for n in range(2):
        connection, response = request("POST", fake.base_url + CHAT, {"n": n}, {"Authorization": "Bearer sk-x"})
        with connection:
            response.read()
    first, second = fake.received
    assert (first.method, first.path, json.loads(first.body)) == ("POST", CHAT, {"n": 0})
    assert first.header("authorization") == "Bearer sk-x"
    assert json.loads(second.body) == {"n": 1}


def test_models_list_and_unknown_route(fake: FakeUpstream) -> None:
    connection, response = request("GET", fake.base_url + "/v1/models")
    with connection:
        assert [m["id"] for m in response.json()["data"]][0] == sse_samples.OPENAI_MODEL
    connection, response = request("POST", fake.base_url + "/v2/nothing", {})
    with connection:
        assert response.status == 404
        assert "error" in response.json()


def test_gemini_stream_needs_alt_sse(fake: FakeUpstream) -> None:
    connection, response = request("POST", fake.base_url + "/v1beta/models/g:streamGenerateContent", {})
    with connection:
        assert response.status == 400


def test_invalid_json_gets_an_api_shaped_400(fake: FakeUpstream) -> None:
    connection, response = request("POST", fake.base_url + "/v1/messages", b"{not json")
    with connection:
        assert response.status == 400
        assert response.json()["type"] == "error"


# --- the official SDKs ----------------------------------------------------------


def openai_client(fake: FakeUpstream, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake.base_url + "/v1", api_key="sk-test-fake", max_retries=0, **kwargs)


def anthropic_client(fake: FakeUpstream, **kwargs: object) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.base_url, api_key="sk-ant-test-fake", max_retries=0, **kwargs)


def test_openai_sdk_streams_chat(fake: FakeUpstream) -> None:
    fake.behaviour.chunks = 7
    stream = openai_client(fake).chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer_text(7)
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[0].model == "gpt-test"


def test_openai_sdk_chat_without_stream(fake: FakeUpstream) -> None:
    completion = openai_client(fake).chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content == answer_text(5)


def test_openai_sdk_streams_responses(fake: FakeUpstream) -> None:
    with openai_client(fake).responses.stream(model="gpt-test", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == answer_text(5) == final.output_text


def test_anthropic_sdk_streams_messages(fake: FakeUpstream) -> None:
    with anthropic_client(fake).messages.stream(
        model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == answer_text(5)
    assert final.model == "claude-test" and final.usage.output_tokens == 5


def test_anthropic_sdk_without_stream(fake: FakeUpstream) -> None:
    message = anthropic_client(fake).messages.create(
        model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].text == answer_text(5)


def test_sdks_see_api_shaped_errors(fake: FakeUpstream) -> None:
    fake.behaviour.status = 429
    with pytest.raises(openai.RateLimitError) as openai_error:
        openai_client(fake).chat.completions.create(model="m", messages=[], stream=True)
    assert openai_error.value.body["type"] == "rate_limit_exceeded"
    with pytest.raises(anthropic.RateLimitError) as anthropic_error:
        anthropic_client(fake).messages.create(model="m", max_tokens=1, messages=[])
    assert anthropic_error.value.body["error"]["type"] == "rate_limit_error"


def test_sdk_over_tls_trusting_the_test_ca(certs: TestCerts) -> None:
    with FakeUpstream(tls=True, certs=certs) as fake:
        assert fake.base_url.startswith("https://localhost:")
        client = openai_client(fake, http_client=httpx2.Client(verify=certs.client_context()))
        stream = client.chat.completions.create(model="m", messages=[], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer_text(5)


def test_over_http2_the_fake_answers_as_over_http1(certs: TestCerts) -> None:
    """With `h2` it offers HTTP/2 as the APIs do: the same events, one DATA frame each; a
    knob only HTTP/1 has is refused, not ignored; a stream the client resets is recorded so."""
    body = json.dumps(CHAT_STREAM).encode()
    head = [("content-type", "application/json")]
    with FakeUpstream(tls=True, certs=certs, h2=True) as fake:
        connection, response = request("POST", fake.base_url + CHAT, body, {"x-fake-chunks": "3"}, ca=certs.ca_pem)
        with connection:
            over_http1 = response.read()
        connection, response = request("POST", fake.base_url + CHAT, body, {"x-fake-hold-until-reset": "1"},
                                       ca=certs.ca_pem)
        with connection:
            assert response.status == 400 and b"HTTP/2 only: hold_until_reset" in response.read()
        with H2Client(fake.port, certs.ca_pem) as client:
            answered = client.request("POST", CHAT, [*head, ("x-fake-chunks", "3")], body)
            refused = client.request("POST", CHAT, [*head, ("x-fake-gzip", "true")], body)
            held = client.request("POST", CHAT, [*head, ("x-fake-prefill-ms", "60000")], body)
            client.flush()
            streams = client.streams
            client.pump(lambda: streams[answered].over and streams[refused].over and streams[held].status == 200, WAIT)
            client.reset(held)
            client.flush()
            assert fake.wait_finished(5, WAIT)
    assert streams[answered].status == 200 and bytes(streams[answered].body) == over_http1
    assert over_http1.count(b"data:") > 3 and [s.outcome for s in fake.sent] == [
        "complete", "complete", "complete", "complete", "client_closed"]
    assert streams[refused].status == 400 and b"HTTP/1 only: gzip" in streams[refused].body
    assert [r.path for r in fake.received] == [CHAT] * 5 and fake.received[2].body == body


# --- knobs ------------------------------------------------------------------------


def test_header_knobs_override_defaults_per_request(fake: FakeUpstream) -> None:
    fake.behaviour.chunks = 2
    connection, response = request("POST", fake.base_url + "/v1/messages", {"stream": True}, {"x-fake-chunks": "4"})
    with connection:
        response.read()
    assert fake.sent[0].decoded_body() == b"".join(sse_samples.anthropic_stream(
        answer_pieces(4), **usage("anthropic.messages", {"stream": True})))


def test_unknown_knob_header_is_a_400(fake: FakeUpstream) -> None:
    connection, response = request("POST", fake.base_url + CHAT, {}, {"x-fake-prefil-ms": "3"})
    with connection:
        assert response.status == 400
        assert "x-fake-prefil-ms" in response.json()["error"]["message"]


def test_status_with_custom_error_body(fake: FakeUpstream) -> None:
    headers = {"x-fake-status": "503", "x-fake-error-body": '{"error": "custom"}'}
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM, headers)
    with connection:
        assert (response.status, response.json()) == (503, {"error": "custom"})


def test_reset_before_headers(fake: FakeUpstream) -> None:
    with pytest.raises((ConnectionError, IncompleteRead)):
        request("POST", fake.base_url + CHAT, CHAT_STREAM, {"x-fake-reset-before-headers": "1"})
    assert fake.wait_finished(1, WAIT)
    assert fake.sent[0].outcome == "reset" and fake.sent[0].status is None


def test_reset_after_chunks(fake: FakeUpstream) -> None:
    got: list[bytes] = []
    with pytest.raises((ConnectionError, IncompleteRead)):
        for chunk in stream_post(fake.base_url + CHAT, CHAT_STREAM, {"x-fake-reset-after-chunks": "2"}):
            got.append(chunk.data)
    assert got == sse_samples.openai_chat_stream(answer_pieces(5), model="gpt-test")[:2]
    assert fake.wait_finished(1, WAIT) and fake.sent[0].outcome == "reset"


def test_stall_holds_until_released(fake: FakeUpstream) -> None:
    fake.behaviour.stall_after_chunks = 1
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM)
    with connection:
        chunks = response.chunks()
        next(chunks)
        assert fake.wait_chunk_sent(0, WAIT)
        assert fake.sent[0].chunks_sent == 1 and fake.sent[0].outcome is None
        fake.release_stalls()
        rest = list(chunks)
    assert len(rest) == len(sse_samples.openai_chat_stream(answer_pieces(5))) - 1
    assert fake.wait_finished(1, WAIT) and fake.sent[0].outcome == "complete"


def test_stop_is_prompt_with_a_stalled_stream_and_leaks_nothing() -> None:
    fake = FakeUpstream(behaviour=Behaviour(stall_after_chunks=0)).start()
    port = fake.port
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM)
    with connection:
        assert fake.wait_received(1, WAIT)
        fake.stop()
        with pytest.raises((ConnectionError, IncompleteRead)):
            list(response.chunks())
    assert not [t for t in threading.enumerate() if t.name == "fake-upstream"]
    assert fake.sent[0].outcome == "stopped"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT)


def test_client_hangup_mid_stream_is_noticed(fake: FakeUpstream) -> None:
    fake.behaviour.stall_after_chunks = 1
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM)
    next(response.chunks())
    connection.close()
    assert fake.wait_finished(1, WAIT)
    assert fake.sent[0].outcome == "client_closed"
    assert fake.wait_connections(0, WAIT)


def test_head_delay_and_prefill_land_where_documented(fake: FakeUpstream) -> None:
    """Head delay before the head; prefill after Anthropic's preamble events, before the first text."""
    fake.behaviour.head_delay_ms = 150
    fake.behaviour.prefill_ms = 250
    connection, response = request("POST", fake.base_url + "/v1/messages", {"model": "c", "stream": True})
    with connection:
        chunks = list(response.chunks())
    first_text = next(i for i, c in enumerate(chunks) if b"text_delta" in c.data)
    assert first_text == 3  # message_start, content_block_start, ping
    assert response.head_at - response.request_sent_at >= DELAY_SLACK * 0.150
    assert chunks[first_text].at - chunks[first_text - 1].at >= DELAY_SLACK * 0.250


def test_gap_between_chunks(fake: FakeUpstream) -> None:
    chunks = list(stream_post(fake.base_url + CHAT, CHAT_STREAM, {"x-fake-gap-ms": "40", "x-fake-chunks": "3"}))
    gaps = len(chunks) - 2  # the first text chunk (index 1) waits the prefill (0 here) instead
    assert chunks[-1].at - chunks[0].at >= DELAY_SLACK * 0.040 * gaps


def test_prefill_grows_with_request_size(fake: FakeUpstream) -> None:
    prompt = "x" * 8000  # ~2000 tokens at 4 chars per token
    body = {**CHAT_STREAM, "messages": [{"role": "user", "content": prompt}]}
    started = time.time()
    chunks = list(stream_post(fake.base_url + CHAT, body, {"x-fake-prefill-ms-per-1k-tokens": "150"}))
    assert chunks[1].at - started >= DELAY_SLACK * 0.300


def test_usage_reports_the_prompts_size_and_its_cached_part_costs_no_prefill(fake: FakeUpstream) -> None:
    body = {**CHAT_STREAM, "messages": [{"role": "user", "content": "x" * 8000}]}  # ~2000 tokens
    tokens = round(len(json.dumps(body)) / 4)
    knobs = {"x-fake-prefill-ms-per-1k-tokens": "1000", "x-fake-cached-tokens": str(tokens - 100)}
    started = time.time()
    chunks = list(stream_post(fake.base_url + CHAT, body, knobs))
    usage = json.loads(chunks[-2].data.removeprefix(b"data: "))["usage"]
    assert usage["prompt_tokens"] == tokens and usage["prompt_tokens_details"]["cached_tokens"] == tokens - 100
    assert chunks[1].at - started >= DELAY_SLACK * 0.100  # the 100 uncached tokens' prefill
    assert fake.sent[0].first_token_at - fake.received[0].at < 1.0  # not the 2000 tokens' 2 s
    not_streamed = {"model": "c", "messages": body["messages"]}
    connection, response = request("POST", fake.base_url + "/v1/messages", not_streamed, {"x-fake-cached-tokens": "500"})
    with connection:
        usage = response.json()["usage"]
    assert usage["input_tokens"] + 500 == round(len(json.dumps(not_streamed)) / 4)  # Anthropic's: the uncached part
    assert usage["cache_read_input_tokens"] == 500


def test_slow_headers_dribble_the_head(fake: FakeUpstream) -> None:
    with socket.create_connection(("127.0.0.1", fake.port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-fake-slow-headers-ms: 200\r\n\r\n")
        started, head, reads = time.time(), b"", 0
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
            reads += 1
        assert reads > 1
        assert time.time() - started >= DELAY_SLACK * 0.200 * (1 - 1 / 16)


def test_gzip_honours_accept_encoding_and_flushes_per_chunk(fake: FakeUpstream) -> None:
    fake.behaviour.gzip = True
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM, {"Accept-Encoding": "gzip"})
    with connection:
        assert response.header("content-encoding") == "gzip"
        decoder = zlib.decompressobj(wbits=31)
        events = [decoder.decompress(c.data) for c in response.chunks()]
    expected = sse_samples.openai_chat_stream(answer_pieces(5), model="gpt-test", **usage("openai.chat", CHAT_STREAM))
    assert events[: len(expected)] == expected  # each chunk decodes on its own: nothing held back
    assert fake.sent[0].decoded_body() == b"".join(expected)
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM)
    with connection:
        assert response.header("content-encoding") is None


# --- gates ------------------------------------------------------------------------


def test_gate_holds_a_chunk_until_set(fake: FakeUpstream) -> None:
    gate = fake.hold_before_chunk(2)
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM)
    with connection:
        chunks = response.chunks()
        received = [next(chunks).data, next(chunks).data]  # chunks 0 and 1 arrive while 2 is held
        assert fake.wait_chunk_sent(1, WAIT)
        assert fake.sent[0].chunks_sent == 2 and not gate.is_set()
        gate.set()
        received += [c.data for c in chunks]
    assert fake.wait_chunk_sent(2, WAIT)
    assert b"".join(received) == fake.sent_bodies[0]


def test_gate_applies_to_the_next_stream_only(fake: FakeUpstream) -> None:
    watch = fake.next_stream()
    watch.hold_before_chunk(0).set()  # released in advance: passes straight through
    list(stream_post(fake.base_url + CHAT, CHAT_STREAM))
    assert watch.wait_done(WAIT)
    assert fake.next_stream() is not watch


def test_wait_chunk_sent_returns_false_when_the_stream_ended_early(fake: FakeUpstream) -> None:
    fake.next_stream()
    with pytest.raises((ConnectionError, IncompleteRead)):
        list(stream_post(fake.base_url + CHAT, CHAT_STREAM, {"x-fake-reset-after-chunks": "1"}))
    assert fake.wait_chunk_sent(0, WAIT)
    assert not fake.wait_chunk_sent(1, WAIT)


# --- connections, request bodies ------------------------------------------------------


def test_keep_alive_reuses_the_connection_and_close_does_not(fake: FakeUpstream) -> None:
    with HttpConnection(fake.base_url) as connection:
        for _ in range(2):
            connection.request("POST", CHAT, CHAT_STREAM).read()
        response = connection.request("POST", CHAT, CHAT_STREAM, {"Connection": "close"})
        assert response.header("connection") == "close"
        response.read()
    connection, response = request("GET", fake.base_url + "/v1/models")
    with connection:
        response.read()
    assert [r.conn_id for r in fake.received] == [1, 1, 1, 2]


def test_slow_chunked_upload_is_received_whole(fake: FakeUpstream) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "y" * 3000}]}
    started = time.time()
    connection, response = slow_upload(fake.base_url + CHAT, body, pieces=3, pause_s=0.1, chunked=True)
    with connection:
        response.read()
    assert response.request_sent_at - started >= DELAY_SLACK * 2 * 0.1  # two pauses between three pieces
    (received,) = fake.received
    assert received.chunked and json.loads(received.body) == body


def test_expect_100_continue(fake: FakeUpstream) -> None:
    connection, response = request("POST", fake.base_url + CHAT, CHAT_STREAM, {"Expect": "100-continue"})
    with connection:
        assert response.status == 200
        response.read()


def test_tls_raw_client_with_the_test_ca(certs: TestCerts) -> None:
    with FakeUpstream(tls=True, certs=certs) as fake:
        chunks = list(stream_post(fake.base_url + CHAT, CHAT_STREAM, ca=certs.ca_pem))
        assert b"".join(c.data for c in chunks) == fake.sent_bodies[0]
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            list(stream_post(fake.base_url + CHAT, CHAT_STREAM))  # system CAs only


def test_tls_without_given_certs_makes_its_own() -> None:
    with FakeUpstream(tls=True) as fake:
        assert fake.certs is not None
        chunks = list(stream_post(fake.base_url + CHAT, CHAT_STREAM, ca=fake.certs.ca_pem))
        assert chunks


# --- forwarder -----------------------------------------------------------------------


def test_forwarder_delays_each_round_trip(certs: TestCerts) -> None:
    delay_s = 0.1
    with FakeUpstream(tls=True, certs=certs) as fake, DelayingForwarder("127.0.0.1", fake.port, delay_s * 1000) as fwd:
        with socket.create_connection(("127.0.0.1", fwd.port)) as raw:
            connected = time.time()
            with certs.client_context().wrap_socket(raw, server_hostname="localhost"):
                handshaken = time.time()
        assert handshaken - connected >= DELAY_SLACK * 2 * delay_s  # TLS 1.3: one round trip

        with HttpConnection(f"https://localhost:{fwd.port}", ca=certs.ca_pem) as connection:
            response = connection.request("POST", CHAT, CHAT_STREAM)
            assert response.head_at - response.request_sent_at >= DELAY_SLACK * 2 * delay_s
            body = response.read()
        assert body == fake.sent_bodies[0] and fwd.connections == 2


def test_forwarder_passes_resets_on(fake: FakeUpstream) -> None:
    with DelayingForwarder("127.0.0.1", fake.port, 20) as fwd:
        with pytest.raises((ConnectionError, IncompleteRead)):
            list(stream_post(f"http://127.0.0.1:{fwd.port}{CHAT}", CHAT_STREAM, {"x-fake-reset-after-chunks": "1"}))


def test_forwarder_connect_delay(fake: FakeUpstream) -> None:
    with DelayingForwarder("127.0.0.1", fake.port, 0, connect_delay_ms=150) as fwd:
        connection, response = request("GET", f"http://127.0.0.1:{fwd.port}/v1/models")
        with connection:
            response.read()
        assert response.head_at - response.request_sent_at >= DELAY_SLACK * 0.150


# --- CLI -------------------------------------------------------------------------------


def test_cli_serves_with_knobs_until_terminated(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "ttft_relay.testing.fakes.upstream", "--port", "0", "--tls", "--certs-dir", str(tmp_path)]
    with subprocess.Popen(command + ["--chunks", "3", "--gzip", "false"], cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        try:
            line = proc.stdout.readline().split()
            assert line[0] == "listening" and line[1].startswith("https://localhost:")
            chunks = list(stream_post(line[1] + "/v1/messages", {"stream": True}, ca=tmp_path / "ca.pem"))
            assert b"".join(c.data for c in chunks) == b"".join(sse_samples.anthropic_stream(
                answer_pieces(3), **usage("anthropic.messages", {"stream": True})))
        finally:
            proc.terminate()
        assert proc.wait(WAIT) == 0


def test_cli_rejects_a_bad_knob_value() -> None:
    with pytest.raises(ValueError):
        upstream_main(["--chunks", "many"])


def test_a_fake_with_a_prompt_cache_reads_a_continued_conversation_from_it():
    cache = PromptCache()
    first = b'{"messages": [{"content": "' + b"x" * 8000 + b'"}'
    assert cache.read(first + b"]}") == 0  # nothing seen before
    # The next turn repeats the first whole but its end: 2,000 tokens cached, in steps of 128.
    assert cache.read(first + b', {"content": "more"}]}') == 1920
    assert cache.read(b'{"messages": [{"content": "other"}]}') == 0  # shorter than the providers' 1,024


def test_a_fake_queue_spike_holds_the_heads_of_requests_in_its_window():
    with FakeUpstream(behaviour=Behaviour(queue_spike_ms=300, queue_spike_s=3600, queue_spike_every_s=7200)) as fake:
        conn, response = request("POST", fake.base_url + "/v1/chat/completions",
                                        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        with conn:
            response.read()
        assert response.head_at - response.request_sent_at >= 0.3
