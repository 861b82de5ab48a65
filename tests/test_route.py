"""Upstream groups' pure parts: the option's entries (`route.members`), the choice of a member
(`route.choice`), the verdicts of a failover and a hedge, and the requests unsafe to repeat."""

from __future__ import annotations

import pytest
from mitmproxy import exceptions

from ttft_relay.observe import prefill
from ttft_relay.route import choice, groups, late_heads, members
from ttft_relay.route.choice import Estimate
from ttft_relay.route.late_heads import LateHeads
from ttft_relay.timing import phases, record

OWN = members.listener_member("https", "api.openai.com", 443)


def test_a_group_is_the_listeners_own_upstream_then_its_entries_in_order():
    groups = members.parse_groups(["api.openai.com second=https://b.example.com env:B_KEY",
                                   "API.openai.com third=http://10.0.0.7:8080"], [OWN])
    own, second, third = groups["api.openai.com"]
    assert own == OWN and own.name == "api.openai.com" and own.authority == "api.openai.com"
    assert (second.name, second.scheme, second.host, second.port, second.key_source) == (
        "second", "https", "b.example.com", 443, "env:B_KEY")
    assert third.authority == "10.0.0.7:8080" and third.key_source is None


def test_the_listeners_of_the_mode_are_its_reverse_http_ones():
    found = members.listener_members(["regular@8080", "reverse:https://api.openai.com@8001",
                                      "reverse:http://127.0.0.1:9000@8002", "reverse:tcp://example.com:22@2222"])
    assert [(m.host, m.scheme, m.port) for m in found] == [("api.openai.com", "https", 443), ("127.0.0.1", "http", 9000)]


@pytest.mark.parametrize("entry, says", [
    ("api.openai.com", "entries are"),
    ("api.openai.com second", "entries are"),
    ("api.anthropic.com second=https://b.example.com", "no reverse listener's upstream is api.anthropic.com"),
    ("api.openai.com se/cond=https://b.example.com", "a member's name"),
    ("api.openai.com second=ftp://b.example.com", "http(s)://HOST[:PORT]"),
    ("api.openai.com second=https://b.example.com/v1", "no path"),
    ("api.openai.com second=https://b.example.com B_KEY", "env:VAR or file:PATH"),
    ("api.openai.com api.openai.com=https://b.example.com", "already has a member api.openai.com"),
])
def test_a_bad_entry_says_what_is_wrong(entry, says):
    with pytest.raises(exceptions.OptionsError, match="relay_upstream_groups") as e:
        members.parse_groups([entry], [OWN])
    assert says in str(e.value)


def order(estimates, draw=0.99, share=choice.EXPLORE_SHARE) -> tuple[tuple[str, ...], str]:
    picked = choice.choose(estimates, explore_draw=draw, explore_share=share)
    return picked.order, picked.why


def test_the_lowest_expected_first_token_wins_and_the_rest_is_the_failover_order():
    got, why = order([Estimate("a", 900.0), Estimate("b", 400.0), Estimate("c", 600.0)])
    assert got == ("b", "c", "a") and why == "lowest expected first token"


def test_nothing_learned_keeps_the_groups_order_or_the_cache():
    assert order([Estimate("a", None, cold=True), Estimate("b", None, cold=True)], draw=0.0)[0] == ("a", "b")
    got, why = order([Estimate("a", None, cold=True), Estimate("b", None, cold=True, holds_cache=True)])
    assert got == ("b", "a") and "cache" in why


def test_a_conversation_stays_where_its_cache_is_unless_the_gain_beats_the_margin():
    # b holds the cache and is a little slower than a: it stays.
    got, why = order([Estimate("a", 500.0), Estimate("b", 560.0, holds_cache=True)])
    assert got == ("b", "a") and why.startswith("sticky")
    # a is quicker by more than the larger of 100 ms and a fifth of b's: it goes.
    got, why = order([Estimate("a", 500.0), Estimate("b", 1200.0, holds_cache=True)])
    assert got == ("a", "b") and "faster than b with this conversation's cache" in why


def test_a_cold_member_explores_a_share_of_the_requests_with_no_cache_at_stake():
    estimates = [Estimate("a", 500.0), Estimate("b", None, cold=True)]
    assert order(estimates, draw=0.01)[0] == ("b", "a")
    assert order(estimates, draw=0.5)[0] == ("a", "b")
    assert order(estimates, draw=0.5, share=1.0)[0] == ("b", "a")
    # Never a conversation whose cache is somewhere.
    assert order([Estimate("a", 500.0, holds_cache=True), Estimate("b", None, cold=True)], draw=0.0)[0] == ("a", "b")


def test_a_member_that_failed_moments_ago_is_tried_last():
    got, _ = order([Estimate("a", 100.0, down=True), Estimate("b", 400.0), Estimate("c", None)])
    assert got == ("b", "c", "a")
    got, why = order([Estimate("a", 100.0, down=True), Estimate("b", 400.0, down=True)])
    assert got == ("a", "b") and "every member failed" in why


def test_each_choice_says_its_reason_in_a_word_of_the_records():
    cases = [
        ([Estimate("a", None, cold=True), Estimate("b", None, cold=True)], 0.99, "order"),
        ([Estimate("a", None, cold=True), Estimate("b", None, cold=True, holds_cache=True)], 0.99, "sticky"),
        ([Estimate("a", 500.0), Estimate("b", None, cold=True)], 0.0, "exploring"),
        ([Estimate("a", 900.0), Estimate("b", 400.0)], 0.99, "lowest"),
        ([Estimate("a", 500.0), Estimate("b", 560.0, holds_cache=True)], 0.99, "sticky"),
        ([Estimate("a", 500.0), Estimate("b", 1200.0, holds_cache=True)], 0.99, "left_cache"),
        ([Estimate("a", 100.0, down=True), Estimate("b", 400.0, down=True)], 0.99, "all_down"),
    ]
    reasons = [choice.choose(estimates, explore_draw=draw).reason for estimates, draw, _ in cases]
    assert reasons == [reason for *_, reason in cases]
    assert set(reasons) == set(record.ROUTE_REASONS)  # the metrics' and the report's words, every one


def test_a_late_request_is_hedged_only_to_a_member_expected_sooner_than_waiting():
    late = Estimate("a", 100.0)
    # 300 ms without a head, its estimate long passed: a queue taken to last as long again.
    assert choice.remaining_ms(late, 300.0) == 300.0
    assert choice.remaining_ms(Estimate("a", 2000.0), 300.0) == 1700.0  # not late yet: what its estimate leaves
    hedge = choice.sooner_elsewhere(late, 300.0, [Estimate("b", 180.0), Estimate("c", 250.0)])
    assert (hedge.to, hedge.why) == ("b", "b expected 0.2 s, a 0.3 s more")
    # Far, or this conversation's prefix not cached there: its first token comes later than waiting's.
    hedge = choice.sooner_elsewhere(late, 300.0, [Estimate("b", 2900.0), Estimate("c", None, cold=True)])
    assert (hedge.to, hedge.why) == (None, "b expected 2.9 s, a 0.3 s more")
    # The longer the wait, the more a hedge is worth.
    assert choice.sooner_elsewhere(late, 3000.0, [Estimate("b", 2900.0)]).to == "b"
    # Nothing known, or only a member that failed moments ago: no hedge.
    assert choice.sooner_elsewhere(late, 300.0, [Estimate("b", None, cold=True)]).to is None
    assert choice.sooner_elsewhere(late, 300.0, [Estimate("b", 100.0, down=True)]).to is None


def test_a_late_members_remaining_wait_is_learned_from_its_own_late_heads():
    heads = LateHeads()
    heads.add(0.0, 2500.0, 2600.0)
    heads.add(1.0, 2400.0, 2500.0)
    # Two late heads say nothing yet: the rule's own guess (the wait so far) stands.
    assert heads.remaining_ms(300.0, now=2.0) is None
    late, far = Estimate("a", 100.0), [Estimate("b", 1600.0)]
    assert choice.sooner_elsewhere(late, 300.0, far, heads.remaining_ms(300.0, now=2.0)) == \
        choice.Elsewhere(None, "b expected 1.6 s, a 0.3 s more")
    heads.add(2.0, 2600.0, 2700.0)
    # Three that came later than 300 ms: the median of what they took from there.
    assert heads.remaining_ms(300.0, now=3.0) == 2300.0
    assert choice.sooner_elsewhere(late, 300.0, far, heads.remaining_ms(300.0, now=3.0)) == \
        choice.Elsewhere("b", "b expected 1.6 s, a 2.3 s more (its late heads)")
    # Only those later than the wait so far count: at 2.45 s one spike is known to be over.
    assert heads.remaining_ms(2450.0, now=3.0) is None
    # One request's wait cannot make it: a median.
    heads.add(3.0, 60_000.0, 60_100.0)
    assert heads.remaining_ms(300.0, now=4.0) == 2350.0
    # They age out: ten minutes on, only the last one is left.
    assert heads.remaining_ms(300.0, now=3.0 + late_heads.MAX_AGE_S) is None
    assert [s.head_ms for s in heads.samples] == [60_000.0]


def test_a_members_late_heads_are_its_last_few():
    heads = LateHeads(window=4)
    for n in range(10):
        heads.add(float(n), 1000.0 + n, 1000.0 + n)
    assert [s.head_ms for s in heads.samples] == [1006.0, 1007.0, 1008.0, 1009.0]
    assert heads.remaining_ms(500.0, now=10.0) == 507.5


def test_a_failover_is_the_verdict_and_teaches_no_first_token_line():
    failed = [{"upstream": "a", "error": "503", "after_ms": 1200.0}]
    rec = record.judged(record.measure(record.RecordInput(
        id="1", ts=0.0, api="openai.chat", model="m", stream=True, status=200, upstream="b.example.com",
        marks={"client_arrived": 0.0, "request_body": 0.5, "forwarded": 1.0, "head_arrived": 1290.0,
               "response_head": 1300.0, "first_token": 1500.0, "last_token": 1600.0},
        tokens_expected=True, tls_expected=True, reused_connection=True, rtt_ms=None, prompt_tokens=100,
        usage={"input_tokens": 100}, route={"upstream": "b", "why": "…", "expected_ms": {}, "failed_over": failed})))
    assert rec.verdict == phases.UPSTREAM_FAILED_OVER
    assert rec.verdict_detail == "a: 503 after 1.2 s; b gave the first token 0.3 s later (first token 1.5 s)"
    assert prefill.sample_of(rec.as_dict()) is None
    assert prefill.sample_of({**rec.as_dict(), "route": None}) is not None


def judged_with(route: dict) -> record.Record:
    return record.judged(record.measure(record.RecordInput(
        id="1", ts=0.0, api="openai.chat", model="m", stream=True, status=200, upstream="b.example.com",
        marks={"client_arrived": 0.0, "request_body": 0.5, "forwarded": 1.0, "head_arrived": 490.0,
               "response_head": 500.0, "first_token": 600.0, "last_token": 700.0},
        tokens_expected=True, tls_expected=True, reused_connection=True, rtt_ms=None, prompt_tokens=100,
        usage={"input_tokens": 100}, route={"upstream": "b", "why": "…", "expected_ms": {}, **route})))


def test_a_hedge_is_the_verdict_and_the_hedges_answer_teaches_no_first_token_line():
    second_won = judged_with({"hedged": {"from": "a", "upstream": "b", "after_ms": 300.0, "won": "b",
                                         "head_ms": 190.0}})
    assert second_won.verdict == phases.UPSTREAM_HEDGED
    assert second_won.verdict_detail == "hedged: a had no head after 0.3 s, b answered in 0.2 s"
    assert prefill.sample_of(second_won.as_dict()) is None  # its wait holds a's
    first_won = judged_with({"upstream": "a", "hedged": {"from": "a", "upstream": "b", "after_ms": 300.0,
                                                         "won": "a", "head_ms": 1200.0}})
    assert first_won.verdict_detail == "hedged: a had no head after 0.3 s, sent to b as well; a answered first, 1.2 s later"
    assert prefill.sample_of(first_won.as_dict()) is not None  # a's own wait
    failed_first = judged_with({"hedged": {"from": "a", "upstream": "b", "after_ms": 300.0, "won": "b", "head_ms": 90.0},
                                "failed_over": [{"upstream": "a", "error": "server closed connection",
                                                 "cause": "connection", "after_ms": 350.0}]})
    assert failed_first.verdict_detail == ("hedged: a had no head after 0.3 s, then failed (server closed connection), "
                                           "b answered in 0.1 s")


def test_the_requests_unsafe_to_repeat_are_a_method_and_a_path_prefix():
    rules = groups.parse_no_repeat(["POST /v1/files", "/v1/batches"])
    assert rules == [("POST", "/v1/files"), (None, "/v1/batches")]
    assert groups.unsafe_to_repeat(rules, "post", "/v1/files/abc?purpose=x")
    assert not groups.unsafe_to_repeat(rules, "GET", "/v1/files")
    assert groups.unsafe_to_repeat(rules, "GET", "/v1/batches/1") and not groups.unsafe_to_repeat(rules, "POST", "/v1/chat")
    # A doubled '/' is read as one, the rule's and the request's alike (a server reads them so); a query is not compared.
    assert groups.unsafe_to_repeat(rules, "POST", "//v1//files") and groups.unsafe_to_repeat(rules, "GET", "/v1///batches?x=/")
    assert groups.parse_no_repeat(["POST //v1//files/"]) == [("POST", "/v1/files/")]
    assert not groups.unsafe_to_repeat(rules, "POST", "/v1/chat?then=/v1/files")
    for bad in ("v1/files", "POST v1/files", "POST /a /b", "P0ST /v1", "POST /v1/files?purpose=batch"):
        with pytest.raises(exceptions.OptionsError, match="relay_upstream_no_repeat"):
            groups.parse_no_repeat([bad])
