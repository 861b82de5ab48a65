"""Upstream groups through a real mitmdump and two fake upstreams: each request goes to the
member chosen by expected first token and its record says which and why, a conversation
stays where its cache is, and a member that refuses connections or answers 503 fails over
to the next before the client sees a byte."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from tests.test_guard import RELAY_KEY, UPSTREAM_KEY
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.upstream import Behaviour, FakeUpstream
from ttft_relay.testing.harness import metrics_url, scrape, total

PATH = "/v1/chat/completions"
SYSTEM = "You are a careful assistant. " * 200
"""About 1,200 tokens: every request of a size, so the members' lines predict each other's."""


def body(first: str, *turns: str) -> dict:
    """A conversation `first` names (its system prompt's start: what a conversation is known by), `turns` into it."""
    messages = [{"role": "system", "content": f"{first}. {SYSTEM}"}, {"role": "user", "content": first}]
    for turn in turns:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": turn}]
    return {"model": "gpt-4o-mini", "stream": True, "messages": messages}


def send(relay, rid: str, payload: dict, key: str = FAKE_OPENAI_KEY) -> dict:
    """One streamed request through the relay, read whole (200 expected); its record."""
    conn, response = client.request("POST", relay.url() + PATH, payload,
                                    {"Authorization": f"Bearer {key}", "x-request-id": rid})
    with conn:
        assert response.status == 200, response.read()[:300]
        assert b"[DONE]" in response.read()
    (rec,) = relay.log.of(rid)
    return rec


@pytest.fixture
def two_fakes() -> Iterator[tuple[FakeUpstream, FakeUpstream]]:
    with FakeUpstream(behaviour=Behaviour(prefill_ms=20)) as a, FakeUpstream(behaviour=Behaviour(prefill_ms=90)) as b:
        yield a, b


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connects to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_request_goes_to_its_chosen_member_and_a_conversation_stays_with_its_cache(two_fakes, start_relay, rid):
    a, b = two_fakes
    relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                        relay_upstream_explore=100)
    route = [send(relay, f"{rid}-s{n}", body(f"single {n}"))["route"] for n in range(3)]
    # Nothing learned: the group's order, the listener's own upstream first.
    assert [r["upstream"] for r in route] == ["127.0.0.1"] * 3
    assert route[0]["why"] == "nothing learned yet: the group's order"
    assert route[0]["expected_ms"] == {"127.0.0.1": None, "b": None}

    # a predicts now, b is still learned: a request with no cache at stake explores b.
    t1 = send(relay, f"{rid}-t1", body("conversation"))
    assert t1["route"]["upstream"] == "b" and t1["route"]["why"].startswith("exploring: b")
    assert t1["upstream"] == f"127.0.0.1:{b.port}" and t1["route"]["expected_ms"]["127.0.0.1"] > 0
    for n in (4, 5):
        assert send(relay, f"{rid}-s{n}", body(f"single {n}"))["route"]["upstream"] == "b"

    # Both predict: a fresh request goes to the quicker a ...
    s6 = send(relay, f"{rid}-s6", body("single 6"))
    assert s6["route"]["upstream"] == "127.0.0.1" and s6["route"]["why"] == "lowest expected first token"
    expected = s6["route"]["expected_ms"]
    assert expected["127.0.0.1"] < expected["b"]
    # ... but the conversation stays on b, where its prefix is cached: a is not quicker by enough.
    turns = ["more", "and more"]
    for n in (1, 2):
        rec = send(relay, f"{rid}-t{n + 1}", body("conversation", *turns[:n]))
        assert rec["route"]["upstream"] == "b", rec["route"]
        assert rec["route"]["why"].startswith("sticky: this conversation's cache is there"), rec["route"]
    assert len(b.received) == 5 and len(a.received) == 4


def test_a_member_refusing_connections_fails_over_unseen_with_the_members_own_key(start_relay, rid, monkeypatch,
                                                                                  tmp_path):
    keys = tmp_path / "relay-keys"
    keys.write_text(RELAY_KEY)
    monkeypatch.setenv("RELAY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    monkeypatch.setenv("RELAY_TEST_B_KEY", "sk-member-b-FAKEKEY-0123456789")
    with FakeUpstream() as b:
        relay = start_relay(f"reverse:http://127.0.0.1:{refused_port()}@0",
                            relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port} env:RELAY_TEST_B_KEY",
                            relay_access_keys=f"file:{keys}", relay_upstream_keys="127.0.0.1=env:RELAY_TEST_UPSTREAM_KEY")
        rec = send(relay, f"{rid}-1", body("hello"), key=RELAY_KEY)
        assert rec["error"] is None and rec["status"] == 200 and rec["upstream"] == f"127.0.0.1:{b.port}"
        assert rec["route"]["upstream"] == "b"
        (failed,) = rec["route"]["failed_over"]
        assert failed["upstream"] == "127.0.0.1" and "onnect" in failed["error"] and failed["after_ms"] >= 0
        assert rec["verdict"] == "upstream failed over" and rec["verdict_detail"].startswith("127.0.0.1: "), rec
        assert b.received[-1].header("authorization") == "Bearer sk-member-b-FAKEKEY-0123456789"
        # The member that failed is tried last for a while: the next request goes to b at once.
        rec = send(relay, f"{rid}-2", body("hello again"), key=RELAY_KEY)
        assert rec["route"]["upstream"] == "b" and "failed_over" not in rec["route"]
        assert len(b.received) == 2


def test_a_503_fails_over_before_the_client_sees_it_and_the_metrics_count_it(start_relay, rid):
    with FakeUpstream(behaviour=Behaviour(status=503)) as a, FakeUpstream() as b:
        relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                            relay_metrics_listen="127.0.0.1:0")
        rec = send(relay, rid, body("hello"))
        assert rec["status"] == 200 and rec["error"] is None and rec["upstream"] == f"127.0.0.1:{b.port}"
        assert [(f["upstream"], f["error"], f["cause"]) for f in rec["route"]["failed_over"]] == [
            ("127.0.0.1", "503", "5xx")]
        assert rec["route"]["group"] == "127.0.0.1" and rec["route"]["reason"] == "order"
        assert rec["verdict"] == "upstream failed over"
        assert "127.0.0.1: 503 after" in rec["verdict_detail"] and "b gave the first token" in rec["verdict_detail"]
        assert len(a.received) == 1 and len(b.received) == 1

        samples = scrape(metrics_url(relay))
        group = {"group": "127.0.0.1"}
        assert total(samples, "ttft_relay_upstream_choices_total", **group, member="127.0.0.1", reason="order") == 1
        assert total(samples, "ttft_relay_upstream_choices_total", **group, member="b") == 0
        left = group | {"from_member": "127.0.0.1", "cause": "5xx"}
        assert total(samples, "ttft_relay_upstream_failovers_total", **left) == 1
        assert total(samples, "ttft_relay_upstream_duplicated_prompt_tokens_total", **left) == rec["prompt_tokens"] > 0
        # b answered after a's 503: its first token holds a's wait, not b's own.
        assert total(samples, "ttft_relay_upstream_member_time_to_first_token_seconds_count") == 0


@pytest.mark.parametrize("pool", [False, True], ids=["own connections", "pooled"])
def test_a_head_later_than_its_bound_goes_to_the_next_member(two_fakes, start_relay, rid, pool):
    # Pooled, the closed connection's error is the group's, not the pool's to send on the same member.
    a, b = two_fakes
    # a clearly the quicker while they learn (a 30 ms lead was lost to a loaded machine's noise
    # once: the slow request went to b first), so that the slow request goes to a first.
    b.behaviour = Behaviour(prefill_ms=150)
    relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                        relay_upstream_explore=100, relay_upstream_slow_head=100, relay_upstream_pool=pool)
    for n in range(6):  # three to a (nothing learned), three exploring b: both predict
        send(relay, f"{rid}-{n}", body(f"single {n}"))
    a.behaviour = Behaviour(prefill_ms=20, head_delay_ms=10_000)  # a's queue, from now on
    rec = send(relay, f"{rid}-slow", body("single 6"))
    assert rec["route"]["upstream"] == "b" and rec["status"] == 200 and rec["error"] is None
    (gave_up,) = rec["route"]["failed_over"]
    assert gave_up["upstream"] == "127.0.0.1" and gave_up["error"].startswith("no head after"), gave_up
    assert rec["ttft_ms"] < 10_000 and rec["verdict"] == "upstream failed over"
    assert len(a.received) == 4 and len(b.received) == 4
    # Not down, only slow: a's queue, at least the wait beyond its expectation, makes b the quicker now.
    route = send(relay, f"{rid}-next", body("single 7"))["route"]
    assert route["upstream"] == "b" and route["why"] == "lowest expected first token", route
    assert route["expected_ms"]["127.0.0.1"] > route["expected_ms"]["b"], route


def test_a_late_head_is_not_given_up_on_for_a_member_expected_later_than_waiting(two_fakes, start_relay, rid):
    """b's first token is expected after a's late head would give its own (b's prefill is long):
    giving a up would pay b's whole prefill for a later first token."""
    a, b = two_fakes
    b.behaviour = Behaviour(prefill_ms=1200)
    relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                        relay_upstream_explore=100, relay_upstream_slow_head=100, relay_metrics_listen="127.0.0.1:0")
    for n in range(6):  # three to a (nothing learned), three exploring b: both predict
        send(relay, f"{rid}-{n}", body(f"single {n}"))
    a.behaviour = Behaviour(prefill_ms=20, head_delay_ms=1000)
    rec = send(relay, f"{rid}-late", body("single 6"))
    route = rec["route"]
    assert route["upstream"] == "127.0.0.1" and "failed_over" not in route and rec["ttft_ms"] >= 1000, route
    assert route["not_given_up"].startswith("b expected 1.") and " s, 127.0.0.1 0." in route["not_given_up"], route
    assert len(a.received) == 4 and len(b.received) == 3
    samples = scrape(metrics_url(relay))
    assert total(samples, "ttft_relay_upstream_failovers_total") == 0
    assert total(samples, "ttft_relay_upstream_late_heads_waited_total", member="127.0.0.1", instead_of="slow_head") == 1
