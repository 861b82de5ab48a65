"""trimming: the policy per API shape, on bodies shaped like coding agents' requests
(ttft_relay/testing/shaped.py) and on random sessions."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttft_relay import apis
from ttft_relay.trim import policy, tokens, turns
from ttft_relay.trim.policy import Budget
from ttft_relay.testing import shaped

CHAT, RESPONSES, ANTHROPIC = apis.OPENAI_CHAT, apis.OPENAI_RESPONSES, apis.ANTHROPIC_MESSAGES
APIS = [CHAT, RESPONSES, ANTHROPIC]
ORDERS = policy.SHRINK_ORDERS


class FakeCounter:
    """Tokens = serialized size / 4, deterministic and fast."""

    label = "fake"
    request_overhead = 3

    def message(self, item: Any) -> int:
        return 3 + len(orjson.dumps(item)) // 4

    def value(self, obj: Any) -> int:
        return len(orjson.dumps(obj)) // 4


@pytest.fixture(scope="module")
def claude_counter() -> tokens.Counter:
    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    loader.load()
    return tokens.counter_for("claude-sonnet-4-5", loader, tokens.CountCache())


def full_tokens(body: dict, api: str, counter) -> int:
    shape = apis.get(api).trim_shape
    fixed = sum(counter.value(body[k]) for k in shape.fixed_keys if body.get(k) is not None)
    return counter.request_overhead + fixed + sum(counter.message(m) for m in body[shape.items_key])


def without_notice(item: dict) -> dict:
    """`item` without the notice a drop put in front of it (Anthropic's, always)."""
    content = item.get("content")
    if isinstance(content, list) and content and "[ttft-relay: " in str(content[0].get("text", "")):
        return {**item, "content": content[1:]}
    return item


def check(api: str, body: dict, budget: Budget, counter, plans=None, order: str = policy.OLDEST) -> policy.TrimResult:
    """Trim `body` (shrinking in `order`) and check every promise the policy makes."""
    before = orjson.dumps(body)
    result = policy.trim(body, apis.get(api), budget, counter, plans=plans, order=order)
    assert orjson.dumps(body) == before, "the input must not be modified"
    stats = result.stats
    if result.body is None:
        assert stats["reason"] in ("fits", "over_budget") or stats["reason"].startswith("no budget"), stats
        if stats["reason"] == "fits":
            assert full_tokens(body, api, counter) == stats["tokens_after"] <= budget.tokens
        return result
    sent = result.body
    assert shaped.problems(api, body, sent) == []
    assert full_tokens(sent, api, counter) == stats["tokens_after"]
    items, kept = shaped.items_of(api, body), shaped.items_of(api, sent)
    lay = policy.layout(items, apis.get(api).trim_shape)
    assert kept[: lay.head_end] == items[: lay.head_end], "the pinned head is sent byte for byte"
    pinned = [i for i in items if apis.get(api).trim_shape.pinned(i)]
    assert [i for i in kept if apis.get(api).trim_shape.pinned(i)] == pinned, "system/developer/context items all kept"
    if stats["over_budget"]:
        check_into_newest_turn(items, kept, lay, stats, budget, order)
        return result
    assert stats["tokens_after"] <= budget.tokens and not stats["dropped_rounds"] and not stats["cut_results"]
    assert kept[-1] == items[-1] or without_notice(kept[-1]) == items[-1], "the newest message is sent whole"
    # The newest round (its calls and results) is never shrunk; the newest turn never dropped.
    whole = items[max(lay.protect_from, lay.newest) :]
    assert [without_notice(i) for i in kept[len(kept) - len(whole) :]] == whole, "the newest round and turn are whole"
    return result


def check_into_newest_turn(items: list, kept: list, lay: policy.Layout, stats: dict, budget: Budget,
                           order: str = policy.OLDEST) -> None:
    """The promises of a trim that had to go into the newest turn: every older turn gone
    (newest first: its rounds go before them, from the newest back), its prompt kept, its
    rounds dropped, the newest round's calls kept (their results cut only if nothing else
    could go)."""
    assert stats["trimmed"] and (stats["dropped_units"] == len(lay.cuts) or order == policy.NEWEST)
    if lay.cuts:
        prompts, prompt = [without_notice(k) for k in kept], items[lay.newest]
        # Before the newest round, its images are shrunk as any item there (alike in every request
        # of the plan, for the prompt cache), the prompt itself kept.
        shrinkable = lay.protect_from > lay.newest
        assert prompt in prompts or (shrinkable and any(shaped._same_skeleton(prompt, k) for k in prompts)), \
            "the newest prompt is kept"
    newest_round = items[max(lay.protect_from, lay.newest) :]
    tail = kept[len(kept) - len(newest_round) :]
    assert all(shaped._same_skeleton(a, b) for a, b in zip(newest_round, tail)), "the newest round is kept"
    assert sum(a != without_notice(b) for a, b in zip(newest_round, tail)) <= stats["cut_results"]
    if stats["cut_results"] or stats["tokens_after"] > budget.tokens:
        everything = len(lay.rounds)
        if order == policy.NEWEST:  # a round of pinned items only is not dropped; the turn's first round stays
            everything = sum(not lay.always[r - 1] for r in lay.rounds) - (lay.turn_body == lay.head_end)
        assert stats["dropped_rounds"] >= everything, "results are cut only once every older round went"


# --- coding agents' sessions -------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("order", ORDERS)
def test_long_agent_session_is_trimmed_not_refused(api, claude_counter, order):
    body = shaped.Session(api, turns=20).last()
    result = check(api, body, Budget(30_000, "user"), claude_counter, order=order)
    assert result.stats["trimmed"] and result.stats["reason"] is None
    assert result.stats["shrunk_messages"] > 0


@pytest.mark.parametrize("order", ORDERS)
def test_claude_code_session_keeps_its_opening_context_and_system_messages(claude_counter, order):
    body = shaped.Session(ANTHROPIC, turns=20).last()
    result = check(ANTHROPIC, body, Budget(30_000, "user"), claude_counter, order=order)
    sent = result.body["messages"]
    assert sent[0]["content"][0]["text"].startswith("<system-reminder>") and "claudeMd" in sent[0]["content"][0]["text"]
    assert sent[1]["role"] == "system"
    assert result.body["system"] == body["system"] and result.body["tools"] == body["tools"]
    assert sum(m["role"] == "system" for m in sent) == sum(m["role"] == "system" for m in body["messages"]) > 2
    # thinking, redacted thinking, server tool blocks: carried or dropped whole, never altered
    kept_blocks = [b for m in sent if isinstance(m["content"], list) for b in m["content"]]
    originals = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    for kind in ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result"):
        assert all(b in originals for b in kept_blocks if b["type"] == kind), kind
    assert any(b["type"] == "thinking" for b in kept_blocks)


@pytest.mark.parametrize("order", ORDERS)
def test_codex_session_keeps_developer_and_environment_context(claude_counter, order):
    body = shaped.Session(RESPONSES, turns=20).last()
    result = check(RESPONSES, body, Budget(30_000, "user"), claude_counter, order=order)
    sent = result.body["input"]
    assert [i["role"] for i in sent[:4]] == ["developer", "user", "user", "user"]
    contexts = [i for i in body["input"] if i.get("role") == "user" and "<environment_context>" in str(i["content"])]
    assert len(contexts) > 1 and all(c in sent for c in contexts)
    reasoning = [i for i in sent if i["type"] == "reasoning"]
    assert reasoning and all(r in body["input"] for r in reasoning)  # encrypted content intact


def test_agent_loop_of_8_rounds_fits_40k_by_shrinking_old_tool_results(claude_counter):
    # One prompt, then 8 tool rounds: all of it is the newest turn, so no turn can go.
    body = shaped.Session(ANTHROPIC, turns=1, rounds=8, result_words=8000).last()
    assert full_tokens(body, ANTHROPIC, claude_counter) > 120_000
    result = check(ANTHROPIC, body, Budget(40_000, "user"), claude_counter)
    assert result.stats["tokens_after"] <= 40_000 and result.stats["dropped_messages"] == 0
    sent = result.body["messages"]
    results = [b for m in sent if m["role"] == "user" for b in m["content"] if isinstance(b, dict) and b["type"] == "tool_result"]
    assert "[ttft-relay: tool result removed to fit the context budget (" in str(results[0]["content"])
    assert results[-1] == body["messages"][-1]["content"][0]  # the newest result whole


@pytest.mark.parametrize("api", APIS)
def test_consecutive_requests_keep_the_cut_and_share_their_prefix(api):
    plans = policy.PlanCache()
    counter = FakeCounter()
    requests = list(shaped.Session(api, turns=30).requests())
    sent = []
    for body in requests:
        result = check(api, body, Budget(40_000, "user"), counter, plans)
        sent.append(result)
    trimmed = [r for r in sent if r.stats["trimmed"]]
    assert len(trimmed) > 30
    assert sum(r.stats["plan"] == "kept" for r in trimmed) > 0.8 * len(trimmed)
    for prev, cur in zip(sent, sent[1:]):
        if cur.stats["plan"] == "kept" and prev.body is not None:
            a = [policy.without_cache_control(i) for i in shaped.items_of(api, prev.body)]
            b = [policy.without_cache_control(i) for i in shaped.items_of(api, cur.body)]
            assert b[: len(a) - 1] == a[:-1]  # the previous request's items, then the new ones
    assert len(plans) == 1


def recent_growth(api: str, requests: list[dict], counter) -> float:
    """Tokens per request over the session's last GROWTH_WINDOW requests, from their sizes."""
    window = policy.GROWTH_WINDOW
    return (full_tokens(requests[-1], api, counter) - full_tokens(requests[-1 - window], api, counter)) / window


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("result_words", "budget"), [(600, 50_000), (150, 30_000)], ids=["fast", "slow"])
def test_a_new_cut_leaves_room_for_the_next_requests_at_the_conversations_growth(api, result_words, budget):
    # Two sessions growing at different paces: each new cut goes as far below the budget as
    # REQUESTS_BETWEEN_CUTS requests of its own recent growth take.
    counter = FakeCounter()
    requests = list(shaped.Session(api, turns=30, result_words=result_words).requests())
    growth = recent_growth(api, requests, counter)
    result = check(api, requests[-1], Budget(budget, "user"), counter, policy.PlanCache())
    room = policy.REQUESTS_BETWEEN_CUTS * growth
    assert policy.LEAST_HEADROOM * budget < room < policy.MOST_HEADROOM * budget  # neither limit applies
    # (Claude Code moves its cache_control marker to the newest message: a few tokens apart.)
    assert result.stats["plan"] == "new" and result.stats["target"] == pytest.approx(budget - room, abs=20)
    assert result.stats["target"] - 2 * growth <= result.stats["tokens_after"] <= result.stats["target"]


@pytest.mark.parametrize(("turns", "result_words", "budget", "limit"),
                         [(40, 3000, 40_000, "most"), (80, 20, 25_000, "least")])
def test_a_new_cut_is_within_its_limits(turns, result_words, budget, limit):
    # However fast a conversation grows, one cut throws away at most MOST_HEADROOM of the
    # budget; however slowly, it leaves at least LEAST_HEADROOM free.
    body = shaped.Session(CHAT, turns=turns, result_words=result_words, args_words=5).last()
    result = check(CHAT, body, Budget(budget, "user"), FakeCounter(), policy.PlanCache())
    share = policy.MOST_HEADROOM if limit == "most" else policy.LEAST_HEADROOM
    assert result.stats["plan"] == "new" and result.stats["target"] == math.floor(budget * (1 - share))


def test_the_growth_per_request_counts_each_answer_once():
    # Codex answers with several items (reasoning, then a call or a message): one request each.
    shape = apis.get(RESPONSES).trim_shape
    answer = [{"type": "reasoning", "id": "rs_1", "summary": []},
              {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}]
    assert [shape.from_model(i) for i in answer] == [True, True]
    assert not shape.from_model({"type": "function_call_output", "call_id": "c1", "output": "x"})
    assert not shape.from_model({"type": "message", "role": "user", "content": "x"})
    assert shape.from_model({"type": "message", "role": "assistant", "content": []})
    assert shape.from_model({"type": "web_search_call", "id": "ws_1"})
    counter = FakeCounter()
    requests = list(shaped.Session(RESPONSES, turns=30).requests())
    result = check(RESPONSES, requests[-1], Budget(40_000, "user"), counter, policy.PlanCache())
    growth = recent_growth(RESPONSES, requests, counter)
    assert result.stats["target"] == pytest.approx(40_000 - policy.REQUESTS_BETWEEN_CUTS * growth, abs=1)


def test_plan_is_not_reused_for_another_history():
    plans = policy.PlanCache()
    a = shaped.Session(CHAT, turns=20).last()
    first = policy.trim(a, apis.get(CHAT), Budget(15_000, "user"), FakeCounter(), plans=plans)
    assert first.stats["dropped_units"] > 0
    (cut,) = {plan.cut for plan in plans._plans.values()}
    b = {**a, "messages": [*a["messages"][:cut], {"role": "user", "content": "another question"}, *a["messages"][cut + 1 :]]}
    assert check(CHAT, b, Budget(15_000, "user"), FakeCounter(), plans).stats["plan"] == "new"
    assert check(CHAT, a, Budget(15_000, "user"), FakeCounter(), plans).stats["plan"] == "new"
    assert check(CHAT, a, Budget(15_000, "user"), FakeCounter(), plans).stats["plan"] == "kept"


def test_counting_stops_at_the_count_limit():
    counter = FakeCounter()
    body = shaped.Session(CHAT, turns=60).last()
    result = check(CHAT, body, Budget(10_000, "user"), counter)
    assert result.stats["tokens_before_lower_bound"]
    assert result.stats["tokens_before"] < full_tokens(body, CHAT, counter)


def test_newest_turn_alone_over_budget_is_untouched():
    body = {"model": "gpt-4o", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "huge " * 4000}]}
    result = policy.trim(body, apis.get(CHAT), Budget(1000, "user"), FakeCounter())
    assert result.body is None and result.stats["over_budget"] and result.stats["reason"] == "over_budget"


@pytest.mark.parametrize("order", ORDERS)
def test_an_agent_loop_over_budget_drops_its_oldest_rounds_not_the_budget(claude_counter, order):
    # One prompt, then 40 tool rounds: with every old result shrunk it is still over 20k, so
    # the turn's oldest rounds go (it used to go out whole: 186k tokens).
    body = shaped.Session(ANTHROPIC, turns=1, rounds=40, result_words=3000).last()
    result = check(ANTHROPIC, body, Budget(20_000, "user"), claude_counter, order=order)
    stats = result.stats
    assert stats["over_budget"] and stats["dropped_rounds"] > 20 and stats["tokens_after"] <= 20_000
    assert stats["tokens_before"] > 150_000 and stats["cut_results"] == 0
    sent = result.body["messages"]
    assert sent[-2]["role"] == "assistant" and sent[-2]["content"][0]["type"] in ("thinking", "redacted_thinking")
    assert sent[-1] == body["messages"][-1]  # the newest round's results whole
    assert "; over_budget; rounds=" in policy.summary(stats)


@pytest.mark.parametrize("order", ORDERS)
def test_a_later_turn_over_budget_says_which_rounds_went(claude_counter, order):
    body = shaped.Session(ANTHROPIC, turns=3, rounds=40, result_words=3000).last()
    result = check(ANTHROPIC, body, Budget(20_000, "user"), claude_counter, order=order)
    stats = result.stats
    assert stats["over_budget"] and stats["dropped_units"] == 2 and stats["dropped_rounds"] > 20
    prompt = next(m for m in result.body["messages"][2:] if m["role"] == "user")
    if order == policy.OLDEST:
        notice = policy.ROUNDS_NOTICE.format(n=2, rounds=stats["dropped_rounds"])
    else:  # the older turns counting did not reach went before; the rounds from the newest back
        notice = policy.NOTICE.format(n=2)
    assert prompt["content"][0]["text"] == notice


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("order", ORDERS)
def test_a_newest_round_over_budget_has_its_results_cut_with_a_notice(api, order):
    body = shaped.Session(api, turns=2, rounds=2, result_words=40_000).last()
    budget = Budget(full_tokens(body, api, FakeCounter()) // 10, "user")
    result = check(api, body, budget, FakeCounter(), order=order)
    stats = result.stats
    assert stats["over_budget"] and stats["cut_results"] >= 1 and stats["tokens_after"] <= budget.tokens
    assert "tool result removed to fit the context budget" in str(shaped.items_of(api, result.body)[-1])


def test_a_resend_cuts_at_the_limit_not_below_it():
    # A request the upstream refused is sent again at the limit it named: no room is left
    # for the next requests, which will make a cut of their own anyway.
    body = shaped.Session(CHAT, turns=30).last()
    with_room = policy.trim(body, apis.get(CHAT), Budget(20_000, "user"), FakeCounter())
    at_limit = policy.trim(body, apis.get(CHAT), Budget(20_000, "user"), FakeCounter(), headroom=False)
    assert with_room.stats["target"] < at_limit.stats["target"] == 20_000
    assert with_room.stats["tokens_after"] < 0.9 * at_limit.stats["tokens_after"] <= 20_000


@pytest.mark.parametrize("order", ORDERS)
def test_unknown_items_and_blocks_are_carried(order):
    body = shaped.Session(RESPONSES, turns=20).last()
    body["input"].insert(6, {"type": "future_item", "payload": {"x": 1}})
    body["input"].insert(9, {"type": "local_shell_call", "call_id": "ls_1", "action": {"type": "exec", "command": ["ls"]}})
    body["input"].insert(10, {"type": "function_call_output", "call_id": "ls_1", "output": "a\nb"})
    result = check(RESPONSES, body, Budget(30_000, "user"), FakeCounter(), order=order)
    assert result.stats["trimmed"]


def test_notice_in_front_of_the_first_kept_turn():
    body = shaped.Session(CHAT, turns=30).last()
    result = policy.trim(body, apis.get(CHAT), Budget(20_000, "user"), FakeCounter(), notice=True)
    n = result.stats["dropped_units"]
    assert n > 0
    assert sum(f"[ttft-relay: {n} earlier turns" in str(m["content"]) for m in result.body["messages"]) == 1


def test_responses_string_input_is_one_message():
    result = policy.trim({"model": "gpt-5", "input": "hi", "instructions": "be brief"}, apis.get(RESPONSES), Budget(100, "user"), FakeCounter())
    assert result.body is None and result.stats["reason"] == "fits" and result.stats["tokens_after"] > 0


@pytest.mark.parametrize(
    "api, body, reason",
    [
        (CHAT, [], "malformed: body is not an object"),
        (CHAT, {"messages": {"role": "user"}}, "malformed: messages is not a list"),
        (CHAT, {}, "malformed: messages is not a list"),
        (CHAT, {"messages": ["hi"]}, "malformed: item is not an object"),
        (CHAT, {"messages": [{"role": 3}]}, "malformed: role is not a string"),
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}, "malformed: id is not a string"),
        (CHAT, {"messages": [{"role": "tool", "tool_call_id": 7}]}, "malformed: tool_call_id is not a string"),
        (RESPONSES, {"input": 3}, "malformed: input is not a list"),
        (RESPONSES, {"input": [{"type": 1}]}, "malformed: input item type is not a string"),
        (RESPONSES, {"input": [{"type": "function_call", "call_id": None}]}, "malformed: call_id is not a string"),
        (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 1}]}]}, "malformed: tool_use_id is not a string"),
        (apis.GEMINI, {"contents": []}, "api gemini is not trimmed"),
    ],
)  # fmt: skip
def test_malformed_is_untouched_with_a_reason(api, body, reason):
    result = policy.trim(body, apis.get(api), Budget(1, "user"), FakeCounter())
    assert result.body is None and result.stats["reason"] == reason


@pytest.mark.parametrize("item", [
    {"role": "system", "content": "mid-conversation"}, {"role": "user", "content": None},
    {"role": "user", "content": 42}, {"role": "assistant", "content": [{"type": "future_block", "x": [1]}]},
])  # fmt: skip
def test_what_real_clients_send_is_never_refused(item):
    body = {"model": "claude-opus-4-6", "messages": [{"role": "user", "content": "hi"}, item]}
    result = policy.trim(body, apis.get(ANTHROPIC), Budget(1000, "user"), FakeCounter())
    assert result.stats["reason"] == "fits"


def test_no_budget_still_counts():
    result = policy.trim({"messages": [{"role": "user", "content": "hello"}]}, apis.get(CHAT), None, FakeCounter())
    assert result.body is None and result.stats["reason"].startswith("no budget") and result.stats["tokens_after"] > 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["role", "content", "type", "tool_calls", "id", "call_id", "tool_use_id",
                                       "messages", "input", "text", "output", "arguments"]), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(body=json_values, api=st.sampled_from(APIS), budget=st.integers(0, 50), order=st.sampled_from(ORDERS))
def test_anything_goes_in_nothing_raises(body, api, budget, order):
    result = policy.trim(body, apis.get(api), Budget(budget, "user"), FakeCounter(), plans=policy.PlanCache(),
                         order=order)
    assert result.body is None or isinstance(result.body, dict)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    api=st.sampled_from(APIS), turns=st.integers(1, 12), rounds=st.integers(0, 4), result_words=st.integers(1, 900),
    args_words=st.integers(1, 200), seed=st.integers(0, 50), fraction=st.floats(0.05, 1.2), upto=st.floats(0, 1),
    order=st.sampled_from(ORDERS),
)  # fmt: skip
def test_policy_holds_for_random_sessions(api, turns, rounds, result_words, args_words, seed, fraction, upto, order):
    requests = list(shaped.Session(api, turns, rounds, result_words, args_words, seed).requests())
    body = requests[int(upto * (len(requests) - 1))]
    budget = Budget(int(full_tokens(body, api, FakeCounter()) * fraction), "user")
    check(api, body, budget, FakeCounter(), policy.PlanCache(), order)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    api=st.sampled_from(APIS), turns=st.integers(1, 8), rounds=st.integers(0, 6), result_words=st.integers(1, 900),
    seed=st.integers(0, 50), budget=st.integers(8_000, 40_000), order=st.sampled_from(ORDERS),
)  # fmt: skip
def test_a_sessions_next_cut_keeps_what_the_last_one_shrank(api, turns, rounds, result_words, seed, budget, order):
    # Every request of a session, one plan cache: each holds the policy's promises; newest
    # first, a new cut that drops nothing never sends whole what the request before sent shrunk.
    plans, previous = policy.PlanCache(), None
    for body in shaped.Session(api, turns, rounds, result_words, 20, seed).requests():
        result = check(api, body, Budget(budget, "user"), FakeCounter(), plans, order)
        if result.body is None or result.stats["over_budget"] or result.stats["dropped_messages"]:
            previous = None
            continue
        sent = [policy.without_cache_control(i) for i in shaped.items_of(api, result.body)]
        items = [policy.without_cache_control(i) for i in shaped.items_of(api, body)]
        if previous is not None and order == policy.NEWEST:
            for i, item in enumerate(previous[:-1]):
                if item != items[i]:  # sent shrunk before
                    assert sent[i] == item, i
        previous = sent


# --- budgets ---------------------------------------------------------------------------------


def test_the_answers_cap_is_read_from_each_apis_own_field():
    assert policy.max_output(apis.get(CHAT), {"max_completion_tokens": 2000, "max_tokens": 1}) == 2000
    assert policy.max_output(apis.get(CHAT), {"max_tokens": 1000}) == 1000  # the older name
    assert policy.max_output(apis.get(RESPONSES), {"max_output_tokens": 1}) == 1
    assert policy.max_output(apis.get(RESPONSES), {"max_tokens": 1000}) is None  # not this API's field
    assert policy.max_output(apis.get(ANTHROPIC), {"max_tokens": 64_000}) == 64_000
    assert policy.max_output(apis.get(CHAT), {"max_tokens": True}) is None and policy.max_output(apis.get(CHAT), {"max_tokens": 0}) is None
    assert policy.max_output(apis.get(CHAT), ["not", "a", "body"]) is None
    assert policy.max_output(apis.get(apis.GEMINI), {"generationConfig": {"maxOutputTokens": 5}}) is None  # not trimmed


def test_summary():
    stats = dict(
        trimmed=True, dropped_units=3, shrunk_messages=5, messages_before=120, messages_after=40,
        tokens_before=130512, tokens_before_lower_bound=True, tokens_after=31870, budget=32000,
    )  # fmt: skip
    stats.update(budget_source="user", window=None)
    assert policy.summary(stats) == "dropped=3; shrunk=5; messages=120->40; tokens=130512+->31870; budget=32000; by=user"
    learned = {**stats, "budget_source": "learned", "window": 200_000}
    assert policy.summary(learned).endswith("budget=32000; by=learned:200000")
    refused = {**learned, "refused": {"provider_tokens": 219898, "max_input": 200_000, "resent": True}}
    assert policy.summary(refused).endswith("by=learned:200000; refused=219898>200000; resent")
    assert policy.summary({**stats, "trimmed": False, "over_budget": False}) is None


@pytest.mark.parametrize("order", ORDERS)
def test_an_anthropic_drop_tells_the_model_what_is_missing_between_two_user_turns(claude_counter, order):
    # The head ends with the first prompt; after a drop the first kept prompt follows it, and
    # the API merges the two into one turn: the model must not read them as one question.
    body = shaped.Session(ANTHROPIC, turns=20).last()
    result = check(ANTHROPIC, body, Budget(30_000, "user"), claude_counter, order=order)
    assert result.stats["dropped_units"] > 0
    sent = [m for m in result.body["messages"] if m["role"] != "system"]
    original = [m for m in body["messages"] if m["role"] != "system"]
    for before, after in zip(sent, sent[1:]):
        if before["role"] == after["role"] == "user" and not any(
                b.get("type") == "tool_result" for b in after["content"] if isinstance(b, dict)):
            at = next(i for i, m in enumerate(original) if m is before or m == before)
            assert original[at + 1]["role"] == "assistant"  # the original had an answer between them
            first = after["content"][0]
            assert first["type"] == "text" and first["text"].startswith("[ttft-relay: ") and "left out" in first["text"]
            break
    else:
        raise AssertionError("no drop between two user turns in this session")


GENERATED_SHARE_GOAL = 0.90
"""Issue 25: the mean prefix share of a generated session's trimmed requests."""
GENERATED_BUDGET = 80_000
GENERATED_TRIMMED = 60
"""Each generated session runs until this many of its requests were trimmed, however many
turns that takes (many short turns: about 500 requests), so that every shape is measured
over as many cuts; the first trimmed request (after untrimmed ones) counts too."""
SEEDS_PER_PROFILE = 3


@pytest.mark.parametrize("api", APIS)
def test_trimmed_requests_of_generated_sessions_share_their_prefix(api):
    # Sessions of shapes the suite did not grow up with (ttft_relay/testing/shaped.py `generated`: tool-heavy,
    # long messages, many short turns, images, mixed; lengths drawn long-tailed, turn by
    # turn), every model call a request. A request that makes a new cut shares only the
    # pinned head with the one before; the mean holds when new cuts are rare.
    means: dict[str, list[float]] = {}
    for seed in range(SEEDS_PER_PROFILE * len(shaped.PROFILES)):
        trim = functools.partial(check, api, budget=Budget(GENERATED_BUDGET, "user"), counter=FakeCounter(),
                                 plans=policy.PlanCache())
        shares, stats = shaped.trimmed_shares(api, shaped.generated(api, seed, turns=10_000), trim, GENERATED_TRIMMED)
        assert len(shares) == GENERATED_TRIMMED
        new_cuts = sum(s["plan"] == "new" for s in stats)
        means.setdefault(shaped.PROFILES[seed % len(shaped.PROFILES)], []).append(sum(shares) / len(shares))
        assert new_cuts * 10 <= GENERATED_TRIMMED, (seed, new_cuts)  # at most one trimmed request in ten
    worst = {profile: round(min(m), 3) for profile, m in means.items()}
    assert len(worst) == len(shaped.PROFILES) and min(worst.values()) >= GENERATED_SHARE_GOAL, worst


# --- WebSocket turns ---------------------------------------------------------------------------


def test_a_socket_puts_each_turns_whole_conversation_together():
    api = apis.get(RESPONSES)
    conversation = turns.SocketConversation(api.websocket_turns, api.trim_shape)
    prompt = {"type": "message", "role": "user", "content": "hi"}
    call = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    prewarm = {"type": "response.create", "model": "m", "generate": False, "input": [prompt]}
    request, items = conversation.whole(prewarm)
    assert request == {"model": "m", "generate": False, "input": [prompt]} and items == [prompt]
    conversation.started(turns.Turn(request, items, "m", {}))
    conversation.completed("resp_1", [])
    # The turn continuing the prewarm adds nothing; the next one the call's output.
    request, items = conversation.whole({"type": "response.create", "model": "m", "previous_response_id": "resp_1",
                                         "input": []})
    assert request == {"model": "m", "input": [prompt]}
    conversation.started(turns.Turn(request, items, "m", {}))
    conversation.completed("resp_2", [call])
    request, _ = conversation.whole({"model": "m", "previous_response_id": "resp_2", "input": [output]})
    assert request["input"] == [prompt, call, output]
    # A response this socket did not carry: not known, and nothing after it either.
    assert conversation.whole({"model": "m", "previous_response_id": "resp_elsewhere", "input": []}) is None
    conversation.started(None)
    conversation.completed("resp_3", [call])
    assert conversation.whole({"model": "m", "previous_response_id": "resp_3", "input": []}) is None


def test_a_turns_refusal_and_completion_are_read_from_its_events():
    protocol = apis.get(RESPONSES).websocket_turns
    error = {"type": "invalid_request_error", "code": "context_length_exceeded", "message": "too long"}
    assert protocol.refusal(orjson.dumps({"type": "error", "status": 400, "error": error})) == (
        400, orjson.dumps({"error": error}))
    failed = {"type": "response.failed", "response": {"id": "r", "status": "failed", "error": error}}
    assert protocol.refusal(orjson.dumps(failed)) == (400, orjson.dumps({"error": error}))
    assert protocol.refusal(b'{"type": "response.output_text.delta", "delta": "x"}') is None
    assert protocol.refusal(b'{"type": "error", "error": "not an object"}') is None
    done = {"type": "response.completed", "response": {"id": "resp_1", "output": [{"type": "message"}]}}
    assert protocol.completed(orjson.dumps(done)) == ("resp_1", [{"type": "message"}])
    assert protocol.completed(b'{"type": "response.completed", "response": {"output": []}}') is None
    assert protocol.completed(b"not json") is None


# --- shrinking newest first (relay_trim_shrink_order=newest) ---------------------------------


LOOPS = {
    "claude loop 80": (ANTHROPIC, lambda: shaped.agent_loop(ANTHROPIC, 80)),
    "codex loop 80": (RESPONSES, lambda: shaped.agent_loop(RESPONSES, 80)),
    "claude loop 160": (ANTHROPIC, lambda: shaped.agent_loop(ANTHROPIC, 160)),
    "codex loop 160": (RESPONSES, lambda: shaped.agent_loop(RESPONSES, 160)),
    # Claude Code's shape: each round keeps a thinking block of 80 words with its signature.
    "claude thinking 160": (ANTHROPIC, lambda: shaped.Session(ANTHROPIC, turns=1, rounds=160).requests()),
    "codex reasoning 80": (RESPONSES, lambda: shaped.Session(RESPONSES, turns=1, rounds=80).requests()),
}


@pytest.mark.parametrize("loop", LOOPS)
def test_shrinking_newest_first_keeps_the_cached_prompt_at_each_new_cut(loop):
    # The real CLIs' agent loop over a budget (the e2e test's, in process), and long ones. Oldest
    # first, a new cut changes the oldest result still whole and every byte after it; newest
    # first it changes only the few newest results it shrinks, and what follows them, and when
    # shrinking is not enough it drops rounds from the newest old one back: the front of the
    # conversation, cached, stays as it was.
    api, requests = LOOPS[loop]
    shares = {}
    for order in ORDERS:
        plans, previous, whole, trimmed = policy.PlanCache(), None, [], 0
        for body in requests():
            result = check(api, body, Budget(36_000, "user"), FakeCounter(), plans, order)
            sent = result.body if result.body is not None else body
            trimmed += result.stats["trimmed"]
            if previous is not None:
                whole.append(shaped.whole_prompt_share(api, previous, sent))
            previous = sent
        assert trimmed > 25
        shares[order] = (statistics.median(whole), min(whole))
        results = [i for i in shaped.items_of(api, previous) if any(apis.get(api).trim_shape.results(i))]
        first_whole = "[ttft-relay: tool result removed" not in str(results[0])
        assert first_whole == (order == policy.NEWEST)  # what the model loses: what it read first, or last
    assert shares[policy.NEWEST][0] >= 0.9 and shares[policy.NEWEST][1] >= 0.8, shares
    assert shares[policy.OLDEST][0] >= 0.9 and shares[policy.OLDEST][1] < 0.5, shares


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("turns", "rounds"), [(1, 60), (30, 3)])
def test_a_middle_drop_keeps_the_request_valid_and_its_front_as_it_was(api, turns, rounds):
    # Newest first, when shrinking is not enough, whole rounds (an answer with its calls and
    # thinking or reasoning, and their results) and turns go from the middle. What `check`
    # holds (calls paired with results, roles alternating, reasoning before what it led to)
    # holds; the newest answer keeps its thinking, as Anthropic requires; the items before
    # the gap are the ones the previous request sent; the gap has its notice (Anthropic's
    # always, others' with relay_trim_notice).
    plans, budget, previous, drops = policy.PlanCache(), Budget(20_000, "user"), None, 0
    shape = apis.get(api).trim_shape
    for body in shaped.Session(api, turns=turns, rounds=rounds).requests():
        result = check(api, body, budget, FakeCounter(), plans, policy.NEWEST)
        sent = shaped.items_of(api, result.body if result.body is not None else body)
        items = shaped.items_of(api, body)
        if answers := [i for i in items if shape.from_model(i)]:
            assert [i for i in sent if shape.from_model(i)][-1] == answers[-1]
        plan = next(iter(plans._plans.values()), None)
        if plan is not None and plan.dropped and result.stats["plan"] == "new" and previous is not None:
            drops += 1
            lay = policy.layout(items, shape)  # what is sent before the gaps (and the first one's notice)
            front = sum(plan.keeps(lay, i) for i in range(plan.dropped[0][0] - 1))
            assert policy.without_cache_control(sent[:front]) == policy.without_cache_control(previous[:front])
        if api == ANTHROPIC and plan is not None and plan.dropped and result.stats["plan"] is not None:
            # (not where a pinned item sits right before the gap: it is never changed)
            assert 1 <= orjson.dumps(sent).count(policy.MIDDLE_NOTICE.encode()) <= len(plan.dropped)
        previous = sent
    assert drops >= 2
    notices = policy.trim(body, apis.get(api), budget, FakeCounter(), plans=plans, order=policy.NEWEST, notice=True)
    assert policy.MIDDLE_NOTICE in str(shaped.items_of(api, notices.body))


def test_newest_first_keeps_its_shrunk_ranges_few():
    # A plan of MOST_SHRUNK_SPANS ranges (a new cut that does not reach back to the last one's
    # adds one): the next cut joins the two newest rather than keep one more range; the older
    # ranges, and what lies between them, stay as the cached prompt has them.
    requests = shaped.agent_loop(ANTHROPIC, 120)
    plans, budget = policy.PlanCache(), Budget(36_000, "user")
    at = next(n for n, body in enumerate(requests)
              if check(ANTHROPIC, body, budget, FakeCounter(), plans, policy.NEWEST).stats["trimmed"])
    ((key, plan),) = plans._plans.items()
    many = tuple((i, i + 1) for i in range(2, 2 * policy.MOST_SHRUNK_SPANS, 2)) + plan.shrunk
    assert len(many) == policy.MOST_SHRUNK_SPANS and many[-2][1] < plan.shrunk[0][0]
    plans.put(key, dataclasses.replace(plan, shrunk=many))
    for body in requests[at + 1 :]:
        if check(ANTHROPIC, body, budget, FakeCounter(), plans, policy.NEWEST).stats["plan"] == "new":
            break
    new = plans.get(key)
    assert new is not None and len(new.shrunk) == policy.MOST_SHRUNK_SPANS
    assert new.shrunk[:-1] == many[:-1] and new.shrunk[-1][0] == many[-1][0] < many[-1][1] + 1 < new.shrunk[-1][1]


def test_newest_first_keeps_its_dropped_ranges_few(monkeypatch):
    # A plan of MOST_SHRUNK_SPANS gaps (a drop that does not reach back to the last one's adds
    # one): the next drop joins the two newest rather than keep one more; the older gaps, and
    # what lies between them, stay as the cached prompt has them. (A 30-turn session makes
    # up to 5 gaps at this budget; the bound is lowered to 2.)
    def gaps(most: int) -> list[policy.Spans]:
        monkeypatch.setattr(policy, "MOST_SHRUNK_SPANS", most)
        plans, made = policy.PlanCache(), []
        for body in shaped.Session(ANTHROPIC, turns=30).requests():
            if check(ANTHROPIC, body, Budget(36_000, "user"), FakeCounter(), plans, policy.NEWEST).stats["plan"] == "new":
                made.append(next(iter(plans._plans.values())).dropped)
        return made

    assert max(map(len, gaps(32))) > 2
    joined = gaps(2)
    assert max(map(len, joined)) == 2
    # Never joined across the newest prompt (the plan would be lost: a new cut from scratch).
    first = next(n for n, dropped in enumerate(joined) if dropped)
    assert all(joined[first:]), joined
    assert all(after[0][0] >= before[0][0] - 2 for before, after in zip(joined[first:], joined[first + 1 :])), joined


@pytest.mark.parametrize("order", policy.SHRINK_ORDERS)
def test_the_image_of_the_newest_prompt_is_kept_while_older_results_can_shrink(order):
    # A user attaches an image to their question in a long agent session: both orders shrink
    # the old tool results first (newest first walks back from the newest round, past the prompt).
    big = "x" * 4000
    msgs: list[dict] = [{"role": "user", "content": "start"}]
    n = 0
    for turn in range(3):
        if turn:
            msgs.append({"role": "user", "content": f"prompt {turn}"})
        for _ in range(4):
            n += 1
            msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{n}", "name": "R", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": big}]}]
        msgs.append({"role": "assistant", "content": "done"})
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 8000}}
    question = {"role": "user", "content": [{"type": "text", "text": "look at this"}, image]}
    msgs.append(question)
    for _ in range(3):
        n += 1
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{n}", "name": "R", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{n}", "content": "small"}]}]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": msgs}
    counter = FakeCounter()
    budget = sum(counter.message(m) for m in msgs) - 1500
    result = check(ANTHROPIC, body, Budget(budget, "user"), counter, policy.PlanCache(), order=order)
    assert result.body is not None and question in result.body["messages"]
