"""End to end through a real mitmdump, with the official SDKs: a model whose window the relay
does not know is never trimmed on a guess; when the upstream refuses a request as too long
and names its limit, the relay learns that window, trims to it and sends once more — the
client gets only the second answer, streamed as any answer is — and trims the
conversation's next request to it at once, in every relay process on the same log.

The fake upstream has a window (`Behaviour.window`, in its own tokens: body bytes / 4) and
refuses longer requests in each API's own words (`sse_samples.too_long_body`)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import anthropic
import openai
import orjson
import pytest

from ttft_relay import store
from ttft_relay.testing import shaped
from ttft_relay.trim import windows
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import Behaviour, FakeUpstream
from ttft_relay.testing.fakes.replies import answer_text
from ttft_relay.testing.harness import REPO, metrics_url, scrape, total

WAIT = 60
NEW_CLAUDE = "acme-coder-2"
"""A model of a family no table of the relay's names, served on the Anthropic API (as other
providers serve theirs): its window is the provider's word alone. (A new Claude model's
window is never learned below 200k, the smallest of its family's: `judge_refusal`.)"""
NEW_GPT = "gpt-4-fork"
"""A model of the gpt-4 family the relay's table does not name (the family's smallest window: 8192)."""


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
    assert [(w["model"], w["max_input"]) for w in learned_file(relay)] == [(NEW_CLAUDE, window)]


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


def test_a_window_learned_by_one_running_relay_is_used_by_another_running_on_the_same_log_at_once(start_relay):
    window = 60_000
    with fake_with_window(window) as fake:
        one, other = start_relay(reverse_to(fake)), start_relay(reverse_to(fake))  # two workers, say
        body = claude_code_body(30)
        create(sdk_for(one, FAKE_ANTHROPIC_KEY), body)
        create(sdk_for(other, FAKE_ANTHROPIC_KEY), body)
        assert [s.status for s in fake.sent] == [400, 200, 200]  # the other sent it once, trimmed
        rec = records(other)[-1]
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
    assert rec["trim"]["count_source"] == "exact" and rec["trim"]["encoding"] == "cl100k_base"


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
    assert learned_file(relay) == []


# --- what one client's refusals may not teach the relay for everyone -------------------------

HOSTILE_KEY = "sk-ant-hostile-FAKEKEY-fedcba9876543210"
OTHER_KEY = "sk-ant-other-FAKEKEY-0123456789abcdef"
ECHO = "prompt is too long: 9 tokens > 400 maximum"
"""A client's own text which a strict validator's 400 quotes back whole."""


def validator_400(message: str) -> dict[str, str]:
    """Knobs making the fake answer as a strict schema validator does: a 400 quoting the field."""
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    return {"x-fake-status": "400", "x-fake-error-body": orjson.dumps(body).decode()}


def sdk_for(relay, key: str, headers: dict[str, str] | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=relay.url(), api_key=key, max_retries=0, timeout=WAIT,
                               default_headers=headers or {})


def create(sdk: anthropic.Anthropic, body: dict) -> None:
    sdk.messages.create(**{k: v for k, v in body.items() if k != "stream"})


def trim_of(rec: dict) -> dict:
    """What a record says of its trim but for how long it took and whether its cut was planned
    anew ("plan", "target": the second request of a conversation keeps the first's)."""
    return {k: v for k, v in rec["trim"].items() if k not in ("trim_ms", "plan", "target")}


def learned_file(relay) -> list[dict]:
    """The windows in the relay's store (the file beside its log)."""
    return [dataclasses.asdict(w) for w in windows.learned_in(relay.log.path.parent / store.FILE_NAME)]


@pytest.mark.parametrize("hostile_model, message, model, operator", [
    ("claude-sonnet-4-5", ECHO, "claude-sonnet-4-5", None),
    ("Evil-Tenant/CLAUDE-SONNET-4-5", ECHO, "claude-sonnet-4-5", None),
    (NEW_CLAUDE, "prompt is too long: 60 tokens > 50 maximum", NEW_CLAUDE, None),
    (NEW_CLAUDE, "prompt is too long: 9000001 tokens > 9000000 maximum", NEW_CLAUDE, f"{NEW_CLAUDE}=30000"),
], ids=["echoed-limit", "case-and-prefix-alias", "silly-small", "huge-over-the-operators"])
def test_a_refusal_one_client_provoked_teaches_nothing_and_other_clients_trims_stay(
        fake, start_relay, hostile_model, message, model, operator):
    relay = start_relay(reverse_to(fake), **({"relay_context_windows": operator} if operator else {}))
    victim = sdk_for(relay, FAKE_ANTHROPIC_KEY)
    conversation = {**claude_code_body(20), "model": model, "max_tokens": 8_000}
    create(victim, conversation)
    hostile = sdk_for(relay, HOSTILE_KEY, validator_400(message))
    text = {"model": hostile_model, "max_tokens": 100, "messages": [{"role": "user", "content": message}]}
    with pytest.raises(anthropic.BadRequestError):  # the refusal reaches its client as it came
        create(hostile, text)
    create(victim, conversation)
    assert len(fake.received) == 3 and fake.received[2].body == fake.received[0].body
    assert learned_file(relay) == []
    before, refused, after = records(relay)
    assert trim_of(after) == trim_of(before)
    assert refused["status"] == 400 and refused["trim"]["refused"]["resent"] is False
    assert refused["trim"]["refused"]["ignored"]


def test_a_window_one_key_learned_serves_it_alone_until_another_keys_refusal_confirms_it(start_relay):
    window = 60_000
    with fake_with_window(window) as fake:
        relay = start_relay(reverse_to(fake))
        body = claude_code_body(30)
        assert fake_tokens(orjson.dumps(body)) > window
        first, second, third = (sdk_for(relay, key) for key in (FAKE_ANTHROPIC_KEY, OTHER_KEY, HOSTILE_KEY))
        create(first, body)  # refused, learned for the first key, resent
        create(second, body)  # not trimmed to the first key's window: refused, which confirms it, resent
        create(third, body)  # trimmed at once
        assert [s.status for s in fake.sent] == [400, 200, 400, 200, 200]
        (learned,) = learned_file(relay)
        shown = scrape(metrics_url(relay))
        assert total(shown, "ttft_relay_learned_context_window_tokens", gen_ai_request_model=NEW_CLAUDE,
                     limit="max_input", confirmed="yes") == window
        recs = records(relay)
    assert learned["model"] == NEW_CLAUDE and learned["max_input"] == window and learned["status"] == 400
    assert learned["error"] == "invalid_request_error"
    assert learned["key"] and learned["confirmed"] and learned["key"] != learned["confirmed"]
    assert all(key not in orjson.dumps(learned).decode() for key in (FAKE_ANTHROPIC_KEY, OTHER_KEY))
    assert [r["trim"]["budget_source"] for r in recs] == ["learned"] * 3
    text = subprocess.run([sys.executable, "-m", "ttft_relay", "report", relay.log.path], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    assert f"{NEW_CLAUDE}: at most {window} prompt tokens" in text, text
    assert f"from a 400 invalid_request_error to key {learned['key']}" in text, text
    assert f"by key {learned['confirmed']}'s refusal" in text, text


def test_one_keys_lower_window_leaves_the_confirmed_one_to_the_other_keys(start_relay):
    window = 60_000
    with fake_with_window(window) as fake:
        relay = start_relay(reverse_to(fake))
        body = claude_code_body(30)
        for key in (FAKE_ANTHROPIC_KEY, OTHER_KEY):  # refused twice: confirmed
            create(sdk_for(relay, key), body)
        create(sdk_for(relay, HOSTILE_KEY, {"x-fake-window": "20000"}), body)  # refused at 20k: its own
        assert [s.status for s in fake.sent] == [400, 200, 400, 200, 400, 200]
        assert {w["max_input"] for w in learned_file(relay)} == {window, 20_000}
        # Another conversation: trimmed to the confirmed window at once, and accepted.
        another = {**shaped.Session(shaped.ANTHROPIC, turns=30, seed=2).last(), "model": NEW_CLAUDE,
                   "max_tokens": 128_000}
        create(sdk_for(relay, FAKE_ANTHROPIC_KEY), another)
        assert [s.status for s in fake.sent][6:] == [200]
        relay.wait_for_output("more than the 20000 tokens learned from one key's refusal: forgotten")
        assert [w["max_input"] for w in learned_file(relay)] == [window]
        recs = records(relay)
    assert recs[-1]["trim"]["budget_source"] == "learned" and recs[-1]["trim"]["window"] == window


def test_a_window_one_key_learned_is_forgotten_when_the_provider_takes_more_from_another(fake, start_relay):
    # The provider refused one key's request at 20k (its own quota, a gateway in front of it):
    # another key's longer request, accepted, shows that window is not the model's.
    relay = start_relay(reverse_to(fake))
    body = claude_code_body(30)
    tight = sdk_for(relay, HOSTILE_KEY, {"x-fake-window": "20000"})
    create(tight, body)  # refused at 20k, learned for this key, resent within it
    assert [s.status for s in fake.sent] == [400, 200] and len(learned_file(relay)) == 1
    create(sdk_for(relay, FAKE_ANTHROPIC_KEY), body)  # untrimmed, accepted
    assert fake.received[2].body == fake.received[0].body
    relay.wait_for_output("more than the 20000 tokens learned from one key's refusal: forgotten")
    assert learned_file(relay) == []


def test_endless_refusals_leave_the_file_empty_and_a_huge_file_does_not_slow_a_start(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake))
    hostile = sdk_for(relay, HOSTILE_KEY)
    for n in range(60):
        message = f"prompt is too long: {n + 10} tokens > {n + 5} maximum"
        with pytest.raises(anthropic.BadRequestError):
            hostile.with_options(default_headers=validator_400(message)).messages.create(
                model=f"{NEW_CLAUDE}-{n}", max_tokens=10, messages=[{"role": "user", "content": message}])
    assert learned_file(relay) == []
    relay.stop()

    started = time.monotonic()
    start_relay(reverse_to(fake)).stop()
    baseline = time.monotonic() - started
    path = tmp_path / store.FILE_NAME
    with open(path, "wb") as f:  # one endless line (a sparse file: no disk spent)
        f.truncate(300 * 1024 * 1024)
    started = time.monotonic()
    relay = start_relay(reverse_to(fake))
    create(sdk_for(relay, FAKE_ANTHROPIC_KEY), claude_code_body(2))
    relay.stop()
    assert time.monotonic() - started < 2 * baseline + 5
