"""Which parts of an oversized conversation to drop, per API shape (pure, sans-IO).

The policy:
- System and developer messages (and `system` / `instructions`, and tool definitions) are
  always kept.
- The newest turn, from the last user message to the end, is always kept: it is what the
  user is asking now. If that minimum alone exceeds the budget the request is left alone
  (`over_budget`): never cut the user's newest message.
- Older turns are dropped oldest first, each as a whole: a turn starts at a user message and
  runs to the next one, so an assistant's tool calls go with all their results and
  reasoning/thinking stays with what it led to. What remains is therefore still a valid
  request (Anthropic: it starts with a user message and roles keep alternating).
- Tokens are counted from the newest message backwards, and counting stops where the budget
  is spent: what is dropped need not be encoded. `tokens_before` is then a lower bound.

`trim` never raises on malformed input: anything it does not understand is left untouched,
with the reason in the stats.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from . import scope
from .tokens import longest_prefix

DEFAULT_CONTEXT_WINDOWS: dict[str, int] = {
    "gpt-5": 400_000,
    "gpt-4.1": 1_047_576,
    "gpt-4.5": 128_000,
    "gpt-4o": 128_000,
    "chatgpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4-1106": 128_000,
    "gpt-4-0125": 128_000,
    "gpt-4-32k": 32_768,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "o1": 200_000,
    "o1-mini": 128_000,
    "o1-preview": 128_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "claude-": 200_000,
    "gemini-": 1_048_576,
}
"""Context window (input + output tokens) by model name prefix; the longest prefix wins."""

DEFAULT_RESERVE_TOKENS = 4096
"""Output tokens kept free when the request does not say how many it wants."""

NOTICE = "[ttft-relay: {n} earlier turns of this conversation were left out to fit the context budget]"

_MAX_OUTPUT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


class TokenCounter(Protocol):
    """What `trim` needs to count tokens (`tokens.Counter`, or a fake in tests)."""

    label: str
    """Name of the encoding, for the stats."""
    request_overhead: int
    """Tokens added once per request."""

    def message(self, item: Any) -> int: ...

    def value(self, obj: Any) -> int: ...


# --- budget ----------------------------------------------------------------------------


class ContextWindows:
    """Context window per model name prefix: the defaults, updated by `overrides`.

    An override of 0 removes a prefix, so its models count as unknown (user budget only).
    """

    def __init__(self, overrides: Mapping[str, int] | None = None) -> None:
        table = {**DEFAULT_CONTEXT_WINDOWS, **{k.lower(): v for k, v in (overrides or {}).items()}}
        self.table = {prefix: tokens for prefix, tokens in table.items() if tokens > 0}

    def lookup(self, model: str | None) -> int | None:
        return longest_prefix(self.table, model)


def parse_context_windows(entries: Iterable[str]) -> dict[str, int]:
    """`["gpt-4o=128000", "my-model=32000"]` -> `{"gpt-4o": 128000, ...}`; ValueError if malformed."""
    table = {}
    for entry in entries:
        prefix, sep, tokens = entry.partition("=")
        prefix, tokens = prefix.strip(), tokens.strip()
        if not sep or not prefix or not tokens.isdigit():
            raise ValueError(f"expected 'model-prefix=tokens', got {entry!r}")
        table[prefix] = int(tokens)
    return table


@dataclass(frozen=True, slots=True)
class Budget:
    tokens: int
    """Most prompt tokens the request may carry."""
    source: str
    """"window" (the model's context window minus reserved output) or "user" (relay_trim_max_tokens)."""


def budget_for(
    model: str | None,
    body: Any,
    *,
    windows: ContextWindows,
    user_max: int = 0,
    default_reserve: int = DEFAULT_RESERVE_TOKENS,
) -> Budget | None:
    """The smaller of (context window - reserved output) and `user_max` (0 = none).

    None when neither applies (unknown model, no user budget): nothing to trim to.
    """
    candidates = []
    window = windows.lookup(model)
    if window is not None:
        candidates.append(Budget(max(window - _reserved_output(body, default_reserve), 0), "window"))
    if user_max > 0:
        candidates.append(Budget(user_max, "user"))
    return min(candidates, key=lambda b: b.tokens, default=None)


def _reserved_output(body: Any, default: int) -> int:
    if isinstance(body, dict):
        for key in _MAX_OUTPUT_KEYS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return default


# --- API shapes ------------------------------------------------------------------------


class _Shape:
    """How one API lays out a conversation. Subclasses answer per item."""

    items_key: str
    """Body key of the conversation list."""
    fixed_keys: tuple[str, ...]
    """Body keys of request-level parts that are always sent (and counted)."""
    text_part_type: str
    """Content part type of plain text, for the notice."""

    def malformed(self, item: Any) -> str | None:
        """Why `item` is not an item this shape understands, or None if it is."""
        raise NotImplementedError

    def pinned(self, item: dict) -> bool:
        """Always kept (system / developer)."""
        return item.get("role") in ("system", "developer")

    def starts_turn(self, item: dict) -> bool:
        """A user message that asks something (not just tool results)."""
        return item.get("role") == "user"

    def calls(self, item: dict) -> Iterator[str]:
        """Ids of tool calls this item makes."""
        raise NotImplementedError

    def results(self, item: dict) -> Iterator[str]:
        """Ids of tool calls this item answers."""
        raise NotImplementedError

    def with_notice(self, item: dict, notice: str) -> dict:
        """`item` (a user message) with the notice in front of its content."""
        content = item.get("content")
        if isinstance(content, list):
            content = [{"type": self.text_part_type, "text": notice}, *content]
        else:
            content = f"{notice}\n\n{content or ''}"
        return {**item, "content": content}


def _content_malformed(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return None
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return None
    return f"content is {type(content).__name__}"


def _ids(values: Any, key: str) -> Iterator[str]:
    """`value[key]` of each dict in a list (malformed() has checked they are strings)."""
    for v in values if isinstance(values, list) else ():
        if isinstance(v, dict) and key in v:
            yield v[key]


class _OpenAIChat(_Shape):
    items_key = "messages"
    fixed_keys = ("tools", "functions")
    text_part_type = "text"

    def malformed(self, item: Any) -> str | None:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            return "message without a role"
        calls = item.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in calls)
        ):
            return "tool_calls without ids"
        if "tool_call_id" in item and not isinstance(item["tool_call_id"], str):
            return "tool_call_id is not a string"
        return _content_malformed(item.get("content"))

    def calls(self, item: dict) -> Iterator[str]:
        return _ids(item.get("tool_calls"), "id")

    def results(self, item: dict) -> Iterator[str]:
        if item.get("role") == "tool" and "tool_call_id" in item:
            yield item["tool_call_id"]


class _OpenAIResponses(_Shape):
    """Input items: messages (typed or not), `*_call` / `*_call_output` pairs joined by
    `call_id`, reasoning and other items that belong to the turn they appear in."""

    items_key = "input"
    fixed_keys = ("instructions", "tools")
    text_part_type = "input_text"

    def malformed(self, item: Any) -> str | None:
        if not isinstance(item, dict):
            return "input item is not an object"
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            return "input item type is not a string"
        if kind == "message":
            if not isinstance(item.get("role"), str):
                return "message without a role"
            return _content_malformed(item.get("content"))
        if "call_id" in item and not isinstance(item["call_id"], str):
            return "call_id is not a string"
        return None

    def _is_message(self, item: dict) -> bool:
        return item.get("type", "message") == "message"

    def pinned(self, item: dict) -> bool:
        return self._is_message(item) and super().pinned(item)

    def starts_turn(self, item: dict) -> bool:
        return self._is_message(item) and super().starts_turn(item)

    def calls(self, item: dict) -> Iterator[str]:
        if item.get("type", "").endswith("_call") and "call_id" in item:
            yield item["call_id"]

    def results(self, item: dict) -> Iterator[str]:
        if item.get("type", "").endswith("_call_output") and "call_id" in item:
            yield item["call_id"]


class _AnthropicMessages(_Shape):
    """`system` is top-level; tool results arrive in user messages, so a user message made
    only of tool results continues a turn instead of starting one."""

    items_key = "messages"
    fixed_keys = ("system", "tools")
    text_part_type = "text"

    def malformed(self, item: Any) -> str | None:
        if not isinstance(item, dict) or item.get("role") not in ("user", "assistant"):
            return "message role is not user or assistant"
        content = item.get("content")
        if isinstance(content, str):
            return None
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            return f"content is {type(content).__name__}"
        for block in content:
            for key in ("id", "tool_use_id"):
                if key in block and not isinstance(block[key], str):
                    return f"{key} is not a string"
        return None

    def pinned(self, item: dict) -> bool:
        return False

    def starts_turn(self, item: dict) -> bool:
        content = item.get("content")
        return item.get("role") == "user" and (
            isinstance(content, str) or any(b.get("type") != "tool_result" for b in content)
        )

    def calls(self, item: dict) -> Iterator[str]:
        # tool_use, server_tool_use, mcp_tool_use: all answered by a block naming their id
        for block in item["content"] if isinstance(item["content"], list) else ():
            if block.get("type", "").endswith("tool_use") and "id" in block:
                yield block["id"]

    def results(self, item: dict) -> Iterator[str]:
        return _ids(item["content"], "tool_use_id")


SHAPES: dict[str, _Shape] = {
    scope.OPENAI_CHAT: _OpenAIChat(),
    scope.OPENAI_RESPONSES: _OpenAIResponses(),
    scope.ANTHROPIC_MESSAGES: _AnthropicMessages(),
}
"""API shapes `trim` understands; requests of any other shape are left alone."""


# --- selection -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrimResult:
    body: dict | None
    """The trimmed request body, or None: forward the original bytes."""
    stats: dict[str, Any]
    """For the timing record: see `trim`."""


def trim(
    body: Any,
    api: str,
    budget: Budget | None,
    counter: TokenCounter,
    *,
    notice: bool = False,
) -> TrimResult:
    """Drop the oldest turns of `body` until it fits `budget`.

    Stats keys: see `untouched_stats`; `reason` says why the body is untouched (None when
    trimmed), `tokens_before_lower_bound` that counting stopped early.
    """
    started = time.perf_counter()
    stats = untouched_stats(None, budget, counter.label)
    new_body = _trim(body, api, budget, counter, notice, stats)
    stats["trim_ms"] = round((time.perf_counter() - started) * 1000, 3)
    return TrimResult(new_body, stats)


def untouched_stats(reason: str | None, budget: Budget | None = None, encoding: str | None = None) -> dict[str, Any]:
    """Stats with every key, for a request left untouched because of `reason`."""
    return {
        "trimmed": False,
        "reason": reason,
        "messages_before": None,
        "messages_after": None,
        "tokens_before": None,
        "tokens_before_lower_bound": False,
        "tokens_after": None,
        "dropped_units": 0,
        "dropped_messages": 0,
        "budget": budget.tokens if budget else None,
        "budget_source": budget.source if budget else None,
        "encoding": encoding,
        "over_budget": False,
        "trim_ms": 0.0,
    }


def _trim(
    body: Any, api: str, budget: Budget | None, counter: TokenCounter, notice: bool, stats: dict[str, Any]
) -> dict | None:
    """The new body, or None with stats["reason"] saying why not."""
    shape = SHAPES.get(api)
    if shape is None:
        stats["reason"] = f"api {api} is not trimmed"
        return None
    if not isinstance(body, dict):
        stats["reason"] = "malformed: body is not an object"
        return None
    items = body.get(shape.items_key)
    if isinstance(items, str):  # Responses `input` as one string: a single user message
        stats["reason"] = "single message"
        return None
    if not isinstance(items, list):
        stats["reason"] = f"malformed: {shape.items_key} is not a list"
        return None
    for item in items:
        if problem := shape.malformed(item):
            stats["reason"] = f"malformed: {problem}"
            return None
    stats["messages_before"] = stats["messages_after"] = len(items)
    if budget is None:
        stats["reason"] = "no budget: unknown model and relay_trim_max_tokens is 0"
        return None

    pinned = [shape.pinned(item) for item in items]
    units = _units(items, shape, pinned)
    fixed = counter.request_overhead
    fixed += sum(counter.value(body[k]) for k in shape.fixed_keys if body.get(k) is not None)
    fixed += sum(counter.message(item) for item, keep in zip(items, pinned) if keep)
    newest = units.pop() if units else []
    minimum = fixed + sum(counter.message(items[i]) for i in newest)

    room = budget.tokens - minimum
    if room < 0:
        stats.update(
            reason="over_budget", over_budget=True, tokens_before=minimum,
            tokens_before_lower_bound=bool(units), tokens_after=minimum,
        )  # fmt: skip
        return None
    # Older turns, newest first, while they fit; the first that does not fit and all older
    # ones are dropped, and none of those older ones gets encoded.
    kept: list[int] = []  # tokens of each kept older turn, newest first
    kept_total = 0
    for u in range(len(units) - 1, -1, -1):
        unit_tokens, counted = 0, 0
        for i in reversed(units[u]):
            unit_tokens += counter.message(items[i])
            counted += 1
            if kept_total + unit_tokens > room:
                break
        if kept_total + unit_tokens > room:
            complete = u == 0 and counted == len(units[u])
            stats.update(tokens_before=minimum + kept_total + unit_tokens, tokens_before_lower_bound=not complete)
            break
        kept.append(unit_tokens)
        kept_total += unit_tokens
    else:
        stats.update(reason="fits", tokens_before=minimum + kept_total, tokens_after=minimum + kept_total)
        return None

    notice_cost = 0
    if notice:
        # Priced as a message of its own saying the largest possible count: an upper bound.
        notice_cost = counter.message({"role": "user", "content": NOTICE.format(n=len(units))})
        if notice_cost <= room:
            while kept_total + notice_cost > room:
                kept_total -= kept.pop()  # make room by dropping the oldest kept turn
        else:
            notice, notice_cost = False, 0
    first_kept = len(units) - len(kept)

    dropped = {i for unit in units[:first_kept] for i in unit}
    first = units[first_kept][0] if first_kept < len(units) else newest[0]
    new_items = []
    for i, item in enumerate(items):
        if i in dropped:
            continue
        if i == first and notice:
            item = shape.with_notice(item, NOTICE.format(n=first_kept))
        new_items.append(item)
    stats.update(
        trimmed=True,
        messages_after=len(new_items),
        tokens_after=minimum + kept_total + notice_cost,
        dropped_units=first_kept,
        dropped_messages=len(dropped),
    )
    return {**body, shape.items_key: new_items}


def _units(items: list[dict], shape: _Shape, pinned: list[bool]) -> list[list[int]]:
    """Indexes of the droppable (not pinned) items, grouped in turns, oldest first.

    A turn starts at a user message that asks something, unless a tool call is still waiting
    for its result: then the call, the result and everything between stay in one turn.
    Items before the first user message form a turn of their own.
    """
    units: list[list[int]] = []
    waiting: set[str] = set()
    for i, item in enumerate(items):
        if not units or (not waiting and shape.starts_turn(item)):
            units.append([])
        if not pinned[i]:
            units[-1].append(i)
        waiting.update(shape.calls(item))
        waiting.difference_update(shape.results(item))
    return [unit for unit in units if unit]


def summary(stats: dict[str, Any]) -> str | None:
    """One line for the X-Relay-Trim header and the mitmweb comment; None if nothing to say.

    Trimmed:     "dropped=3; messages=120->40; tokens=130512+->31870; budget=32000"
                 ("+" after tokens before: at least that many, counting stopped early)
    Over budget: "over_budget; tokens=150000+; budget=120000"
    """
    before = f"{stats['tokens_before']}{'+' if stats['tokens_before_lower_bound'] else ''}"
    if stats.get("trimmed"):
        return (
            f"dropped={stats['dropped_units']}; messages={stats['messages_before']}->{stats['messages_after']}; "
            f"tokens={before}->{stats['tokens_after']}; budget={stats['budget']}"
        )
    if stats.get("over_budget"):
        return f"over_budget; tokens={before}; budget={stats['budget']}"
    return None
