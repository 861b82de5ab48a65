"""End to end: oversized histories are trimmed on their way through a real mitmdump;
everything else reaches the upstream byte for byte."""

from __future__ import annotations

import gzip
import json

import anthropic
import orjson
import pytest

from tests.conftest import FAKE_ANTHROPIC_KEY, reverse_to
from ttft_relay.testing.fakes import client

BUDGET = 3000
FILLER = "The quick brown fox reports on latency budgets and context windows. " * 12  # ≈ 160 tokens


def chat_history(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: {FILLER}"})
        messages.append({"role": "assistant", "content": f"answer {i}: {FILLER}"})
    messages.append({"role": "user", "content": "newest question"})
    return messages


@pytest.fixture
def relay(fake, start_relay):
    proc = start_relay(reverse_to(fake), relay_trim_max_tokens=BUDGET)
    proc.wait_for_output("tokenizer ready")  # requests before this are forwarded untrimmed
    return proc


def records(relay) -> list[dict]:
    relay.stop()  # flushes the timing log
    log = next(a.split("=", 1)[1] for a in relay.args if a.startswith("relay_timing_log="))
    return [json.loads(line) for line in open(log, encoding="utf8")]


def test_openai_chat_history_is_trimmed_to_budget(fake, relay):
    body = {"model": "gpt-4o", "messages": chat_history(40)}
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", body)
    with conn:
        assert resp.status == 200
        header = resp.header("x-relay-trim")
        resp.read()
    sent = orjson.loads(fake.received[-1].body)
    kept = sent["messages"]
    assert len(kept) < len(body["messages"])
    assert kept[:2] == body["messages"][:2]  # system prompt and the opening question: the pinned head
    assert kept[-1] == body["messages"][-1]  # newest turn
    assert kept[2:] == body["messages"][len(body["messages"]) - len(kept) + 2 :]  # then the newest turns, in order
    assert kept[2]["role"] == "user"
    assert header and header.startswith("dropped=")
    assert int(fake.received[-1].header("content-length")) == len(fake.received[-1].body)

    (rec,) = records(relay)
    assert rec["trim"]["trimmed"] is True
    assert rec["trim"]["tokens_after"] <= BUDGET
    assert rec["prompt_tokens"] == rec["trim"]["tokens_after"]


def test_untouched_requests_keep_their_exact_bytes(fake, relay):
    # Odd spacing and key order that any re-serialisation would change.
    raw = b'{ "messages" : [ {"role":"user",  "content":"hi \\u00e9"} ],\n "model":"gpt-4o" }'
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", raw,
                                {"content-type": "application/json"})
    with conn:
        assert resp.status == 200 and resp.header("x-relay-trim") is None
        resp.read()
    assert fake.received[-1].body == raw


def test_compressed_request_bodies_are_trimmed_and_recompressed(fake, relay):
    body = {"model": "gpt-4o", "messages": chat_history(40)}
    raw = gzip.compress(orjson.dumps(body))
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", raw,
                                {"content-type": "application/json", "content-encoding": "gzip"})
    with conn:
        assert resp.status == 200 and resp.header("x-relay-trim")
        resp.read()
    got = fake.received[-1]
    assert got.header("content-encoding") == "gzip"
    sent = orjson.loads(gzip.decompress(got.body))
    assert len(sent["messages"]) < len(body["messages"])


def test_anthropic_tool_pairs_survive_trimming_via_sdk(fake, relay):
    messages = []
    for i in range(30):
        messages += [
            {"role": "user", "content": f"look up item {i}. {FILLER}"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking it up."},
                {"type": "tool_use", "id": f"toolu_{i}", "name": "lookup", "input": {"item": i}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": FILLER}]},
            {"role": "assistant", "content": f"Item {i} is fine."},
        ]
    messages.append({"role": "user", "content": "and now?"})
    sdk = anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0)
    with sdk.messages.stream(model="claude-opus-4-6", max_tokens=64, system="Be brief.",
                             messages=messages) as stream:
        assert stream.get_final_text()

    sent = orjson.loads(fake.received[-1].body)
    kept = sent["messages"]
    assert sent["system"] == "Be brief."
    assert 1 < len(kept) < len(messages) and kept[-1] == messages[-1]
    assert kept[0] == messages[0]  # the opening question, pinned
    assert kept[1]["role"] == "user" and isinstance(kept[1]["content"], str)  # then a real question
    assert all(a["role"] != b["role"] for a, b in zip(kept[1:], kept[2:]))  # roles alternate after the head
    uses = {b["id"] for m in kept if isinstance(m["content"], list) for b in m["content"] if b["type"] == "tool_use"}
    results = {b["tool_use_id"] for m in kept if isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_result"}
    assert uses == results and uses  # no orphan on either side


def test_newest_turn_over_budget_goes_out_unchanged(fake, relay):
    raw = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": FILLER * 30}]})
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", raw,
                                {"content-type": "application/json"})
    with conn:
        assert resp.header("x-relay-trim").startswith("over_budget")
        resp.read()
    assert fake.received[-1].body == raw


def test_a_restarted_relay_cuts_a_conversation_where_it_was_cut(fake, start_relay):
    # Each request is the one before, its answer and a new question. The cut the first relay
    # made is kept beside the timing log: the relay after a restart sends the conversation's
    # next request with the same cut (the previous request's body, then the new items: a
    # prompt-cache hit), where it used to make a cut of its own.
    def conversation(turns: int) -> dict:
        question = {"role": "user", "content": f"question {turns}: {FILLER}"}
        return {"model": "gpt-4o", "messages": [*chat_history(turns)[:-1], question]}

    def send(relay, turns: int) -> list[dict]:
        conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", conversation(turns))
        with conn:
            assert resp.status == 200
            resp.read()
        return orjson.loads(fake.received[-1].body)["messages"]

    def started():
        proc = start_relay(reverse_to(fake), relay_trim_max_tokens=BUDGET)
        proc.wait_for_output("tokenizer ready")
        return proc

    relay = started()
    before = [send(relay, turns) for turns in (40, 41)]
    relay.stop()
    relay = started()
    after = send(relay, 42)
    assert len(before[1]) < len(conversation(41)["messages"])  # trimmed
    assert after[: len(before[1])] == before[1] and len(after) == len(before[1]) + 2
    assert [r["trim"]["plan"] for r in records(relay)] == ["new", "kept", "kept"]
