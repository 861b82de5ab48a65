"""End to end through a real mitmdump: coding agents' request shapes sent with the official
SDKs are trimmed (not refused) into bodies the API accepts; counting a huge request does
not stall a concurrent stream; a decompression bomb is refused without being expanded;
the tokenizers are loaded before the relay listens."""

from __future__ import annotations

import threading

import anthropic
import brotli
import openai
import orjson
import pytest

from benchmarks.load import rss_kib
from ttft_relay.testing import shaped
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import client

BUDGET = 30_000
WAIT = 60


def records(relay) -> list[dict]:
    relay.stop()  # flushes the timing log
    return relay.log.records()


@pytest.fixture
def relay(fake, start_relay):
    return start_relay(reverse_to(fake), relay_trim_max_tokens=BUDGET)


def test_tokenizers_are_ready_before_the_relay_listens(relay):
    out = relay.output
    ready = next(i for i, line in enumerate(out) if "tokenizer ready" in line)
    listening = next(i for i, line in enumerate(out) if "listening at" in line)
    assert ready < listening, relay.text()


def test_claude_code_session_through_the_anthropic_sdk(fake, relay):
    body = shaped.Session(shaped.ANTHROPIC, turns=20).last()
    sdk = anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
    params = {k: v for k, v in body.items() if k != "stream"}
    with sdk.messages.stream(**params, extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"}) as stream:
        assert stream.get_final_text()
    sent = orjson.loads(fake.received[-1].body)
    assert len(sent["messages"]) < len(body["messages"])
    assert shaped.problems(shaped.ANTHROPIC, body, sent) == []
    assert sent["messages"][:2] == body["messages"][:2]  # CLAUDE.md context and the mid-conversation system message
    (rec,) = records(relay)
    assert rec["trim"]["trimmed"] and rec["trim"]["reason"] is None
    assert rec["prompt_tokens"] == rec["trim"]["tokens_after"] <= BUDGET


def test_codex_session_through_the_openai_sdk(fake, relay):
    body = shaped.Session(shaped.RESPONSES, turns=20).last()
    sdk = openai.OpenAI(base_url=relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0, timeout=WAIT)
    events = list(sdk.responses.create(**body))
    assert events and events[-1].type == "response.completed"
    sent = orjson.loads(fake.received[-1].body)
    assert len(sent["input"]) < len(body["input"])
    assert shaped.problems(shaped.RESPONSES, body, sent) == []
    assert sent["input"][:4] == body["input"][:4]  # developer, AGENTS.md, <environment_context>, first prompt
    (rec,) = records(relay)
    assert rec["trim"]["trimmed"] and rec["prompt_tokens"] <= BUDGET


def test_anthropic_prompts_are_counted_without_a_budget(fake, start_relay):
    relay = start_relay(reverse_to(fake))
    sdk = anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
    sdk.messages.create(model="claude-opus-4-6", max_tokens=64, messages=[
        {"role": "user", "content": "hello"}, {"role": "system", "content": "mid-conversation"}])  # fmt: skip
    (rec,) = records(relay)
    assert rec["trim"]["reason"] == "fits" and rec["prompt_tokens"] > 0


def test_a_huge_request_does_not_stall_a_concurrent_stream(fake, relay):
    # A stream paced at 50 ms per event, and meanwhile an 18 MB message to count. Counted on
    # the event loop (before), it stalled the stream 1.8 s here; moving the 18 MB through
    # the relay alone (trimming off) costs the stream a 250-330 ms gap on this machine.
    gap_ms = 50
    stream_body = {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    knobs = {"x-fake-chunks": "80", "x-fake-gap-ms": str(gap_ms), "content-type": "application/json"}
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in client.stream_post(relay.url() + "/v1/chat/completions", orjson.dumps(stream_body), knobs,
                                        timeout=WAIT):
            arrivals.append(chunk.at)
            started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(WAIT)
    huge = {"model": "gpt-4o", "messages": [{"role": "user", "content": shaped.words(3_000_000, 5)}]}
    raw = orjson.dumps(huge)
    assert len(raw) > 15_000_000
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", raw,
                                {"content-type": "application/json"}, timeout=WAIT)
    with conn:
        assert resp.status == 200 and resp.header("x-relay-trim").startswith("over_budget")
        resp.read()
    reader.join(WAIT)
    assert len(arrivals) > 40
    worst_gap_ms = max(b - a for a, b in zip(arrivals, arrivals[1:])) * 1000
    assert worst_gap_ms < 20 * gap_ms, f"the concurrent stream stalled {worst_gap_ms:.0f} ms"
    recs = {r["stream"]: r for r in records(relay)}
    assert recs[False]["trim"]["over_budget"] and recs[False]["prompt_tokens"] > 3_000_000


def brotli_bomb() -> bytes:
    """1.7 KB of brotli that expands to 1 GB of JSON (compressed in pieces: no 1 GB buffer)."""
    compressor = brotli.Compressor(quality=5)
    out = [compressor.process(b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "')]
    piece = b"a" * (16 << 20)
    out += [compressor.process(piece) for _ in range(64)]
    out += [compressor.process(b'"}]}'), compressor.finish()]
    return b"".join(out)


def test_a_brotli_bomb_is_refused_without_being_expanded(fake, relay):
    bomb = brotli_bomb()
    assert len(bomb) < 2000
    rss_before = rss_kib(relay.proc.pid)
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", bomb,
                                {"content-type": "application/json", "content-encoding": "br"}, timeout=WAIT)
    with conn:
        assert resp.status == 413
        error = resp.json()["error"]
        assert error["code"] == "request_too_large" and "64 MiB" in error["message"]
    assert rss_kib(relay.proc.pid) - rss_before < 300_000  # the 64 MiB limit and its copies, not 1 GB
    assert fake.received == []  # nothing went upstream
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions",
                                {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    with conn:
        assert resp.status == 200  # and the relay goes on serving
        resp.read()
    assert [r["status"] for r in records(relay)] == [413, 200]
