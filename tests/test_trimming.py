"""trimming: the policy per API shape, on hand-built conversations and random ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from addons import scope, trimming
from addons.trimming import Budget

CHAT, RESPONSES, ANTHROPIC = scope.OPENAI_CHAT, scope.OPENAI_RESPONSES, scope.ANTHROPIC_MESSAGES


class FakeCounter:
    """Tokens = serialized size / 4, deterministic and fast; remembers what it counted."""

    label = "fake"
    request_overhead = 3

    def __init__(self) -> None:
        self.counted: list[int] = []

    def message(self, item: Any) -> int:
        self.counted.append(id(item))
        return 3 + len(orjson.dumps(item)) // 4

    def value(self, obj: Any) -> int:
        return len(orjson.dumps(obj)) // 4


def words(n: int, seed: int = 0) -> str:
    return " ".join(f"w{(seed * 7919 + i) % 1000}" for i in range(n))


def total_tokens(body: dict, api: str, counter: FakeCounter) -> int:
    shape = trimming.SHAPES[api]
    fixed = sum(counter.value(body[k]) for k in shape.fixed_keys if body.get(k) is not None)
    return counter.request_overhead + fixed + sum(counter.message(m) for m in body[shape.items_key])


# --- conversations, rendered per API from one plan -------------------------------------


@dataclass
class Turn:
    prompt: int  # words
    tool_steps: list[list[tuple[int, int]]]  # per step, per call: (argument words, result words)
    final: int | None  # words of the closing assistant text, None: the turn is still open
    image: bool = False


@dataclass
class Conversation:
    body: dict
    api: str
    turns: list[list[Any]] = field(default_factory=list)
    """The droppable items of each turn, oldest first."""
    pinned: list[Any] = field(default_factory=list)

    @property
    def items(self) -> list[Any]:
        return self.body[trimming.SHAPES[self.api].items_key]


def render(api: str, turns: list[Turn], *, system: bool = True, developer_at: int | None = None) -> Conversation:
    conv = Conversation({"model": "gpt-4o"}, api)
    items: list[Any] = []
    if api == ANTHROPIC:
        if system:
            conv.body["system"] = "You are terse."
    elif system:
        conv.pinned.append({"role": "system", "content": "You are terse."})
        items.append(conv.pinned[-1])
    call = 0
    for t, turn in enumerate(turns):
        if developer_at == t and api != ANTHROPIC:
            conv.pinned.append({"role": "developer", "content": "Answer in French."})
            items.append(conv.pinned[-1])
        unit = [_prompt(api, turn, t)]
        for step in turn.tool_steps:
            ids = [f"call_{(call := call + 1)}" for _ in step]
            unit += _tool_step(api, ids, step)
        if turn.final is not None:
            unit.append(_assistant_text(api, words(turn.final, t + 1)))
        conv.turns.append(unit)
        items += unit
    conv.body["messages" if api != RESPONSES else "input"] = items
    return conv


def _prompt(api: str, turn: Turn, seed: int) -> Any:
    text = words(turn.prompt, seed)
    if not turn.image:
        return {"role": "user", "content": text}
    image = {
        CHAT: {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        RESPONSES: {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
        ANTHROPIC: {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
    }[api]
    text_type = "input_text" if api == RESPONSES else "text"
    return {"role": "user", "content": [{"type": text_type, "text": text}, image]}


def _assistant_text(api: str, text: str) -> Any:
    if api == CHAT:
        return {"role": "assistant", "content": text}
    if api == RESPONSES:
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _tool_step(api: str, ids: list[str], step: list[tuple[int, int]]) -> list[Any]:
    if api == CHAT:
        calls = [
            {"id": i, "type": "function", "function": {"name": "search", "arguments": orjson.dumps({"q": words(a)}).decode()}}
            for i, (a, _) in zip(ids, step)
        ]  # fmt: skip
        return [{"role": "assistant", "content": None, "tool_calls": calls}] + [
            {"role": "tool", "tool_call_id": i, "content": words(r, 3)} for i, (_, r) in zip(ids, step)
        ]
    if api == RESPONSES:
        return (
            [{"type": "reasoning", "id": f"rs_{ids[0]}", "summary": [{"type": "summary_text", "text": "thinking"}]}]
            + [{"type": "function_call", "call_id": i, "name": "search", "arguments": words(a)} for i, (a, _) in zip(ids, step)]
            + [{"type": "function_call_output", "call_id": i, "output": words(r, 3)} for i, (_, r) in zip(ids, step)]
        )  # fmt: skip
    uses = [{"type": "tool_use", "id": i, "name": "search", "input": {"q": words(a)}} for i, (a, _) in zip(ids, step)]
    results = [{"type": "tool_result", "tool_use_id": i, "content": words(r, 3)} for i, (_, r) in zip(ids, step)]
    return [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"}, *uses]},
        {"role": "user", "content": results},
    ]


# --- what a valid request looks like, checked independently of trimming.py ---------------


def assert_valid(api: str, items: list[Any]) -> None:
    if api == CHAT:
        open_calls: set[str] = set()
        for m in items:
            if m["role"] == "tool":
                assert m["tool_call_id"] in open_calls, "tool result without its call"
                open_calls.remove(m["tool_call_id"])
            else:
                assert not open_calls, "tool call without its result"
            open_calls.update(c["id"] for c in m.get("tool_calls") or ())
        assert not open_calls
    elif api == RESPONSES:
        seen_calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
        outputs = {i["call_id"] for i in items if i.get("type") == "function_call_output"}
        assert seen_calls == outputs
        for n, i in enumerate(items):
            if i.get("type") == "function_call_output":
                assert any(j.get("call_id") == i["call_id"] for j in items[:n] if j.get("type") == "function_call")
            if i.get("type") == "reasoning":  # reasoning goes with the item it led to
                assert n + 1 < len(items) and items[n + 1].get("type") in ("function_call", "message")
    else:
        assert items and items[0]["role"] == "user", "Anthropic: first message must be the user's"
        for a, b in zip(items, items[1:]):
            assert a["role"] != b["role"], "Anthropic: roles must alternate"
        for n, m in enumerate(items):
            blocks = m["content"] if isinstance(m["content"], list) else []
            results = {b["tool_use_id"] for b in blocks if b["type"] == "tool_result"}
            prev = items[n - 1]["content"] if n and isinstance(items[n - 1]["content"], list) else []
            assert results <= {b["id"] for b in prev if b["type"] == "tool_use"}, "orphan tool_result"
            uses = {b["id"] for b in blocks if b["type"] == "tool_use"}
            if uses:
                nxt = items[n + 1]["content"] if n + 1 < len(items) else []
                assert uses == {b["tool_use_id"] for b in nxt if b["type"] == "tool_result"}, "tool_use without result"


def check_policy(conv: Conversation, budget: Budget, notice: bool = False) -> trimming.TrimResult:
    """Every promise of the policy, for any conversation and budget."""
    counter = FakeCounter()
    result = trimming.trim(conv.body, conv.api, budget, counter, notice=notice)
    stats = result.stats
    full = total_tokens(conv.body, conv.api, FakeCounter())
    newest = conv.turns[-1]
    minimum = full - sum(FakeCounter().message(i) for turn in conv.turns[:-1] for i in turn)

    if result.body is None:
        assert stats["trimmed"] is False
        if stats["reason"] == "fits":
            assert full <= budget.tokens and stats["tokens_before"] == full and not stats["tokens_before_lower_bound"]
        else:
            assert stats["reason"] == "over_budget" and stats["over_budget"]
            assert minimum > budget.tokens
        return result

    assert minimum <= budget.tokens and full > budget.tokens
    assert set(result.body) == set(conv.body) and all(
        result.body[k] is conv.body[k] for k in conv.body if k not in ("messages", "input")
    )  # fmt: skip
    new = conv.__class__(result.body, conv.api)
    kept = [i for i in new.items]
    changed = [i for i in kept if not any(i is o for o in conv.items)]
    notice_cost = FakeCounter().message({"role": "user", "content": trimming.NOTICE.format(n=len(conv.turns) - 1)})
    if notice and changed:
        # one user message carries the notice; everything else is the original object
        assert len(changed) == 1 and changed[0]["role"] == "user"
        assert "earlier turns" in orjson.dumps(changed[0]).decode()
        kept = [conv.items[_index_like(conv.items, i)] if i is changed[0] else i for i in kept]
    else:
        assert not changed
        assert not notice or minimum + notice_cost > budget.tokens, "notice left out though it fits"
    positions = [next(n for n, o in enumerate(conv.items) if o is i) for i in kept]
    assert positions == sorted(positions), "not an in-order subsequence"
    kept_ids = {id(i) for i in kept}
    assert all(id(p) in kept_ids for p in conv.pinned), "system/developer message dropped"
    assert all(id(i) in kept_ids for i in newest), "newest turn cut"
    # whole turns, oldest first
    kept_turns = [all(id(i) in kept_ids for i in turn) for turn in conv.turns]
    assert all(kept_turns[n] or not any(id(i) in kept_ids for i in turn) for n, turn in enumerate(conv.turns))
    dropped = kept_turns.index(True)
    assert not any(kept_turns[:dropped]) and all(kept_turns[dropped:])
    assert stats["dropped_units"] == dropped > 0
    assert stats["messages_after"] == len(new.items) < stats["messages_before"] == len(conv.items)
    assert_valid(conv.api, new.items)
    # within budget, and no more dropped than needed
    recount = total_tokens(result.body, conv.api, FakeCounter())
    assert recount <= stats["tokens_after"] <= budget.tokens
    if not notice:
        assert recount == stats["tokens_after"]
        assert stats["tokens_after"] + sum(FakeCounter().message(i) for i in conv.turns[dropped - 1]) > budget.tokens
    # counting went from the newest turn back and stopped at the first that did not fit
    counted = set(counter.counted)
    looked_at = [any(id(i) in counted for i in turn) for turn in conv.turns]
    oldest_looked_at = looked_at.index(True)
    assert all(looked_at[oldest_looked_at:])
    assert oldest_looked_at == dropped - 1 or (notice and oldest_looked_at < dropped)
    assert stats["tokens_before"] <= full
    return result


def _index_like(items: list[Any], changed: dict) -> int:
    return next(n for n, o in enumerate(items) if o.get("role") == "user" and o is not changed and _same_but_notice(o, changed))


def _same_but_notice(original: dict, changed: dict) -> bool:
    a, b = original["content"], changed["content"]
    if isinstance(a, str):
        return isinstance(b, str) and b.endswith("\n\n" + a)
    return isinstance(b, list) and b[1:] == a


# --- hand-built conversations ------------------------------------------------------------

SMALL = [Turn(40, [], 40), Turn(40, [[(10, 60)]], 40), Turn(40, [[(10, 60), (5, 30)]], 40), Turn(40, [], None)]


@pytest.mark.parametrize("api", [CHAT, RESPONSES, ANTHROPIC])
def test_fits_is_untouched(api):
    conv = render(api, SMALL)
    result = trimming.trim(conv.body, api, Budget(100_000, "window"), FakeCounter())
    assert result.body is None
    assert result.stats["reason"] == "fits" and result.stats["tokens_before"] == result.stats["tokens_after"]
    assert result.stats["messages_before"] == result.stats["messages_after"] == len(conv.items)


@pytest.mark.parametrize("api", [CHAT, RESPONSES, ANTHROPIC])
def test_drops_oldest_turns_whole(api):
    conv = render(api, SMALL)
    full = total_tokens(conv.body, api, FakeCounter())
    first_turn = sum(FakeCounter().message(i) for i in conv.turns[0])
    second_turn = sum(FakeCounter().message(i) for i in conv.turns[1])
    result = check_policy(conv, Budget(full - first_turn - 1, "user"))  # one token too many for turn 2
    assert result.stats["dropped_units"] == 2
    assert result.stats["dropped_messages"] == len(conv.turns[0]) + len(conv.turns[1])
    assert result.stats["tokens_after"] == full - first_turn - second_turn
    assert result.stats["budget_source"] == "user" and result.stats["encoding"] == "fake"


@pytest.mark.parametrize("api", [CHAT, RESPONSES, ANTHROPIC])
def test_over_budget_is_untouched(api):
    conv = render(api, [Turn(40, [], 40), Turn(2000, [], None)])
    result = check_policy(conv, Budget(500, "window"))
    assert result.body is None and result.stats["over_budget"] and result.stats["tokens_before_lower_bound"]
    assert trimming.summary(result.stats).startswith("over_budget; tokens=")


@pytest.mark.parametrize("api", [CHAT, RESPONSES, ANTHROPIC])
def test_agentic_newest_turn_keeps_all_its_tool_calls(api):
    # The newest turn is one question followed by many tool round trips: all of it is kept.
    conv = render(api, [Turn(300, [], 300), Turn(10, [[(5, 50)]] * 6, None)])
    result = check_policy(conv, Budget(total_tokens(conv.body, api, FakeCounter()) - 1, "user"))
    assert result.stats["dropped_units"] == 1


@pytest.mark.parametrize("api", [CHAT, RESPONSES, ANTHROPIC])
def test_notice(api):
    conv = render(api, SMALL[:3] + [Turn(40, [], 40), Turn(10, [], None)])
    conv.turns[1][0]["content"] = [{"type": "input_text" if api == RESPONSES else "text", "text": "parts"}]
    full = total_tokens(conv.body, api, FakeCounter())
    result = check_policy(conv, Budget(full - 1, "user"), notice=True)
    first = next(i for i in result.body[trimming.SHAPES[api].items_key] if i.get("role") == "user")
    assert first["content"][0]["text"] == trimming.NOTICE.format(n=result.stats["dropped_units"])
    # string content gets the notice as a first paragraph
    result = check_policy(conv, Budget(full // 3, "user"), notice=True)
    first = next(i for i in result.body[trimming.SHAPES[api].items_key] if i.get("role") == "user")
    assert first["content"].startswith("[ttft-relay: 3 earlier turns")


def test_chat_keeps_system_messages_anywhere():
    conv = render(CHAT, SMALL, developer_at=1)
    result = check_policy(conv, Budget(total_tokens(conv.body, CHAT, FakeCounter()) - 1, "user"))
    roles = [m["role"] for m in result.body["messages"]]
    assert roles[:3] == ["system", "developer", "user"]


def test_responses_string_input_and_instructions():
    counter = FakeCounter()
    result = trimming.trim({"model": "gpt-4o", "input": "hi"}, RESPONSES, Budget(10, "user"), counter)
    assert result.body is None and result.stats["reason"] == "single message"
    conv = render(RESPONSES, SMALL)
    conv.body["instructions"] = words(200)
    budget = Budget(total_tokens(conv.body, RESPONSES, FakeCounter()) - 1, "user")
    result = check_policy(conv, budget)
    assert result.body["instructions"] is conv.body["instructions"]
    conv.body["instructions"] = words(5000)  # instructions alone exceed the budget
    assert check_policy(conv, budget).stats["over_budget"]


def test_anthropic_system_and_tools_count_toward_the_minimum():
    conv = render(ANTHROPIC, SMALL)
    budget = Budget(total_tokens(conv.body, ANTHROPIC, FakeCounter()) - 1, "window")
    assert check_policy(conv, budget).body is not None
    conv.body["tools"] = [{"name": "search", "description": words(3000), "input_schema": {"type": "object"}}]
    assert check_policy(conv, budget).stats["over_budget"]


def test_no_user_message_is_one_turn():
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": words(500)}]}
    result = trimming.trim(body, CHAT, Budget(10_000, "user"), FakeCounter())
    assert result.stats["reason"] == "fits"
    result = trimming.trim(body, CHAT, Budget(100, "user"), FakeCounter())
    assert result.stats["reason"] == "over_budget"


def test_result_shares_untouched_parts_with_the_input():
    conv = render(CHAT, SMALL)
    before = orjson.dumps(conv.body)
    trimming.trim(conv.body, CHAT, Budget(200, "user"), FakeCounter(), notice=True)
    assert orjson.dumps(conv.body) == before, "the input must not be modified"


@pytest.mark.parametrize(
    "api, body, reason",
    [
        (CHAT, [], "malformed: body is not an object"),
        (CHAT, {"messages": {"role": "user"}}, "malformed: messages is not a list"),
        (CHAT, {}, "malformed: messages is not a list"),
        (CHAT, {"messages": ["hi"]}, "malformed: message without a role"),
        (CHAT, {"messages": [{"role": "user", "content": 42}]}, "malformed: content is int"),
        (CHAT, {"messages": [{"role": "user", "content": ["a"]}]}, "malformed: content is list"),
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "malformed: tool_calls without ids"),
        (CHAT, {"messages": [{"role": "tool", "tool_call_id": 7}]}, "malformed: tool_call_id is not a string"),
        (RESPONSES, {"input": 3}, "malformed: input is not a list"),
        (RESPONSES, {"input": [{"type": 1}]}, "malformed: input item type is not a string"),
        (RESPONSES, {"input": [{"type": "function_call", "call_id": None}]}, "malformed: call_id is not a string"),
        (ANTHROPIC, {"messages": [{"role": "system", "content": "x"}]}, "malformed: message role is not user or assistant"),
        (ANTHROPIC, {"messages": [{"role": "user", "content": None}]}, "malformed: content is NoneType"),
        (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 1}]}]}, "malformed: tool_use_id is not a string"),
        (scope.GEMINI, {"contents": []}, "api gemini is not trimmed"),
    ],
)  # fmt: skip
def test_malformed_is_untouched_with_a_reason(api, body, reason):
    result = trimming.trim(body, api, Budget(1, "user"), FakeCounter())
    assert result.body is None and result.stats["reason"] == reason


def test_no_budget():
    result = trimming.trim({"messages": []}, CHAT, None, FakeCounter())
    assert result.body is None and result.stats["reason"].startswith("no budget")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["role", "content", "type", "tool_calls", "id", "call_id", "tool_use_id", "messages", "input", "text"]), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(body=json_values, api=st.sampled_from([CHAT, RESPONSES, ANTHROPIC]), budget=st.integers(0, 50))
def test_anything_goes_in_nothing_raises(body, api, budget):
    result = trimming.trim(body, api, Budget(budget, "user"), FakeCounter())
    assert result.body is None or isinstance(result.body, dict)


# --- random valid conversations ------------------------------------------------------------


@st.composite
def conversations(draw) -> Conversation:
    api = draw(st.sampled_from([CHAT, RESPONSES, ANTHROPIC]))
    n = draw(st.integers(1, 8))
    sizes = st.integers(1, 120)
    turns = []
    for t in range(n):
        steps = draw(st.lists(st.lists(st.tuples(sizes, sizes), min_size=1, max_size=3), max_size=3))
        last = t == n - 1
        # only the newest turn may be unfinished; Anthropic needs each older one to end with the assistant
        final = draw(st.none() | sizes) if last else draw(sizes)
        turns.append(Turn(draw(sizes), steps, final, image=draw(st.booleans())))
    developer_at = draw(st.none() | st.integers(0, n - 1))
    return render(api, turns, system=draw(st.booleans()), developer_at=developer_at)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv=conversations(), fraction=st.floats(0.0, 1.2), notice=st.booleans())
def test_policy_holds_for_random_conversations(conv, fraction, notice):
    full = total_tokens(conv.body, conv.api, FakeCounter())
    check_policy(conv, Budget(int(full * fraction), "user"), notice=notice)


# --- budgets ---------------------------------------------------------------------------------


def test_budget_window_minus_reserved_output():
    windows = trimming.ContextWindows()
    assert trimming.budget_for("gpt-4o-2024-08-06", {"max_tokens": 1000}, windows=windows) == Budget(127_000, "window")
    assert trimming.budget_for("gpt-4o", {"max_completion_tokens": 2000}, windows=windows) == Budget(126_000, "window")
    assert trimming.budget_for("gpt-4.1-mini", {"max_output_tokens": 1}, windows=windows).tokens == 1_047_575
    assert trimming.budget_for("gpt-4o", {}, windows=windows, default_reserve=8000) == Budget(120_000, "window")
    assert trimming.budget_for("gpt-4o", {"max_tokens": True}, windows=windows).tokens == 128_000 - 4096
    assert trimming.budget_for("gpt-4", {"max_tokens": 10_000}, windows=windows) == Budget(0, "window")
    assert trimming.budget_for("o1-mini", {}, windows=windows, default_reserve=0).tokens == 128_000
    assert trimming.budget_for("claude-3-5-haiku", {"max_tokens": 0}, windows=windows).tokens == 200_000 - 4096


def test_budget_user_and_unknown_models():
    windows = trimming.ContextWindows()
    assert trimming.budget_for("gpt-4o", {}, windows=windows, user_max=32_000) == Budget(32_000, "user")
    assert trimming.budget_for("gpt-4", {}, windows=windows, user_max=32_000).source == "window"
    assert trimming.budget_for("llama-3", {}, windows=windows, user_max=5) == Budget(5, "user")
    assert trimming.budget_for("llama-3", {}, windows=windows) is None
    assert trimming.budget_for(None, None, windows=windows, user_max=7) == Budget(7, "user")


def test_context_window_overrides():
    windows = trimming.ContextWindows(trimming.parse_context_windows(["llama-3=8192", " GPT-4o-mini = 64000", "claude-=0"]))
    assert windows.lookup("llama-3.1-70b") == 8192
    assert windows.lookup("gpt-4o-mini") == 64000
    assert windows.lookup("gpt-4o") == 128_000
    assert windows.lookup("claude-opus-4") is None
    for bad in ["llama", "=5", "x=", "x=-1", "x=1k"]:
        with pytest.raises(ValueError):
            trimming.parse_context_windows([bad])


def test_summary():
    stats = dict(
        trimmed=True, dropped_units=3, messages_before=120, messages_after=40,
        tokens_before=130512, tokens_before_lower_bound=True, tokens_after=31870, budget=32000,
    )  # fmt: skip
    assert trimming.summary(stats) == "dropped=3; messages=120->40; tokens=130512+->31870; budget=32000"
    assert trimming.summary({**stats, "trimmed": False, "over_budget": False}) is None
