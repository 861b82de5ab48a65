"""End to end through a real mitmdump, with the official SDKs: a model whose window the relay
does not know is never trimmed on a guess; when the upstream refuses a request as too long
and names its limit, the relay learns that window, trims to it and sends once more — the
client gets only the second answer, streamed as any answer is — and trims the
conversation's next request to it at once, in every relay process on the same log.

The fake upstream has a window (`Behaviour.window`, in its own tokens: body bytes / 4) and
refuses longer requests in each API's own words (`sse_samples.too_long_body`)."""

from __future__ import annotations

import anthropic
import openai
import orjson
import pytest

from ttft_relay.testing import shaped
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import Behaviour, FakeUpstream
from ttft_relay.testing.fakes.replies import answer_text

WAIT = 60
NEW_CLAUDE = "claude-opus-5-5"
"""Claude Code's newest model, in no table of the relay's."""
NEW_GPT = "gpt-5.5"
"""A GPT-5 model the relay's table does not name: `gpt-5`'s window is not its own."""


def fake_with_window(tokens: int) -> FakeUpstream:
    return FakeUpstream(behaviour=Behaviour(window=tokens))


def fake_tokens(body: bytes) -> int:
    return len(body) // 4


def records(relay) -> list[dict]:
    relay.stop()  # flushes the timing log
    return relay.log.records()


def claude_code_body(turns: int) -> dict:
    """Claude Code's request of a long session, with its newest model, thinking and max_tokens."""
    body = shaped.Session(shaped.ANTHROPIC, turns=turns).last()
    return {**body, "model": NEW_CLAUDE, "max_tokens": 128_000}


def test_an_unknown_model_without_a_budget_is_not_trimmed(fake, start_relay):
    relay = start_relay(reverse_to(fake))
    body = claude_code_body(20)
    sdk = anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
    params = {k: v for k, v in body.items() if k != "stream"}
    with sdk.messages.stream(**params) as stream:
        assert stream.get_final_text() == answer_text(5)
    assert orjson.loads(fake.received[-1].body)["messages"] == body["messages"]  # every byte of it
    (rec,) = records(relay)
    assert rec["trim"]["trimmed"] is False and rec["trim"]["budget"] is None
    assert rec["trim"]["reason"].startswith("no budget: the model's window is not known")
    assert rec["trim"]["count_source"] == "estimate"


def test_a_known_model_is_trimmed_by_its_window_and_says_so(fake, start_relay):
    relay = start_relay(reverse_to(fake))
    body = {**claude_code_body(40), "model": "claude-sonnet-4-5-20250929", "max_tokens": 64_000}
    sdk = anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
    params = {k: v for k, v in body.items() if k != "stream"}
    raw = sdk.messages.with_raw_response.create(**params, stream=True)
    header = raw.headers.get("x-relay-trim")
    assert [event.type for event in raw.parse()][-1] == "message_stop"
    (rec,) = records(relay)
    assert rec["trim"]["trimmed"] and rec["trim"]["budget_source"] == "window" and rec["trim"]["window"] == 200_000
    assert rec["trim"]["budget"] == 200_000 - 64_000
    assert header.endswith("by=window:200000")


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "not-streamed"])
def test_claude_code_refused_as_too_long_is_trimmed_to_the_providers_word_and_answered(start_relay, streamed):
    window = 60_000
    with fake_with_window(window) as fake:
        relay = start_relay(reverse_to(fake))
        body = claude_code_body(30)
        assert fake_tokens(orjson.dumps(body)) > window
        sdk = anthropic.Anthropic(base_url=relay.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
        params = {k: v for k, v in body.items() if k != "stream"}
        if streamed:
            raw = sdk.messages.with_raw_response.create(**params, stream=True)
            header = raw.headers.get("x-relay-trim")
            events = [event.type for event in raw.parse()]
            assert events[0] == "message_start" and events[-1] == "message_stop"
        else:
            raw = sdk.messages.with_raw_response.create(**params)
            header = raw.headers.get("x-relay-trim")
            assert raw.parse().content[-1].text == answer_text(5)
        first, second = fake.received  # sent once more, and only once
        assert fake.sent[0].status == 400 and fake.sent[1].status == 200
        assert orjson.loads(first.body)["messages"] == body["messages"]  # the client's, untrimmed
        assert fake_tokens(second.body) <= window
        resent = orjson.loads(second.body)
        assert shaped.problems(shaped.ANTHROPIC, orjson.loads(first.body), resent) == []
        assert resent["messages"][-1] == body["messages"][-1]
        assert "resent" in header and "by=learned:60000" in header

        # The conversation's next request is trimmed to the learned window at once.
        body2 = claude_code_body(31)
        with sdk.messages.stream(**{k: v for k, v in body2.items() if k != "stream"}) as stream:
            assert stream.get_final_text() == answer_text(5)
        assert len(fake.received) == 3 and fake.sent[2].status == 200
        recs = records(relay)
    assert [r["status"] for r in recs] == [200, 200]
    refused = recs[0]["trim"]["refused"]
    assert refused["resent"] is True and refused["status"] == 400 and refused["max_input"] == window
    assert refused["provider_tokens"] == fake_tokens(first.body)
    assert recs[0]["trim"]["budget_source"] == "learned" and recs[0]["stream"] is streamed
    assert recs[0]["trim"]["target"] == recs[0]["trim"]["budget"]  # resent at the limit, no deeper
    assert recs[1]["trim"]["budget_source"] == "learned" and "refused" not in recs[1]["trim"]
    if streamed:
        assert recs[0]["ttft_ms"] is not None and recs[0]["chunks"] > 5  # the second answer was streamed
    learned = [orjson.loads(line) for line in (relay.log.path.parent / "learned-windows.jsonl").read_bytes().splitlines()]
    assert [(w["model"], w["max_input"]) for w in learned] == [(NEW_CLAUDE, window)]


def test_a_learned_window_is_used_by_the_next_relay_on_the_same_log(start_relay):
    window = 60_000
    with fake_with_window(window) as fake:
        first = start_relay(reverse_to(fake))
        sdk = anthropic.Anthropic(base_url=first.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
        body = claude_code_body(30)
        sdk.messages.create(**{k: v for k, v in body.items() if k != "stream"})
        first.stop()
        second = start_relay(reverse_to(fake))  # a restarted relay, or another worker on the log
        sdk = anthropic.Anthropic(base_url=second.url(), api_key=FAKE_ANTHROPIC_KEY, max_retries=0, timeout=WAIT)
        sdk.messages.create(**{k: v for k, v in body.items() if k != "stream"})
        assert [s.status for s in fake.sent] == [400, 200, 200]  # the second relay sent it once, trimmed
        rec = records(second)[-1]
    assert rec["trim"]["budget_source"] == "learned" and rec["trim"]["trimmed"]


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "not-streamed"])
def test_openai_chat_refused_as_too_long_is_trimmed_and_answered(start_relay, streamed):
    window = 40_000
    with fake_with_window(window) as fake:
        relay = start_relay(reverse_to(fake))
        body = shaped.Session(shaped.CHAT, turns=30).last()
        body = {**body, "model": NEW_GPT, "stream": streamed}
        assert fake_tokens(orjson.dumps(body)) > window
        sdk = openai.OpenAI(base_url=relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0, timeout=WAIT)
        if streamed:
            chunks = list(sdk.chat.completions.create(**body))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = sdk.chat.completions.create(**body).choices[0].message.content
        assert text == answer_text(5)
        assert [s.status for s in fake.sent] == [400, 200]
        assert fake_tokens(fake.received[1].body) <= window
        assert shaped.problems(shaped.CHAT, body, orjson.loads(fake.received[1].body)) == []
        (rec,) = records(relay)
    assert rec["status"] == 200 and rec["trim"]["refused"]["window"] == window and rec["trim"]["refused"]["resent"]
    assert rec["trim"]["count_source"] == "exact" and rec["trim"]["encoding"] == "o200k_base"


def test_a_refusal_that_names_no_limit_reaches_the_client_as_it_came(start_relay):
    # The Responses API does not say how long a prompt may be: nothing to trim to, so Codex
    # gets the refusal and compacts its history itself, as it would direct.
    with fake_with_window(20_000) as fake:
        relay = start_relay(reverse_to(fake))
        body = {**shaped.Session(shaped.RESPONSES, turns=20).last(), "model": NEW_GPT}
        sdk = openai.OpenAI(base_url=relay.url() + "/v1", api_key=FAKE_OPENAI_KEY, max_retries=0, timeout=WAIT)
        with pytest.raises(openai.BadRequestError) as refused:
            list(sdk.responses.create(**body))
        assert refused.value.code == "context_length_exceeded"
        assert len(fake.received) == 1
        (rec,) = records(relay)
    assert rec["status"] == 400 and rec["trim"]["refused"]["resent"] is False
    assert rec["trim"]["refused"]["max_input"] is None and rec["trim"]["refused"]["window"] is None
    assert not (relay.log.path.parent / "learned-windows.jsonl").exists()
