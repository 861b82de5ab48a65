"""Request bodies with the shapes coding agents send, and what makes one valid for its API.

Hand-written to the structure Claude Code 2.1.x (Anthropic Messages) and Codex CLI
(Responses) requests have — system blocks with cache_control, 24 tools, mid-conversation
system messages, thinking with signatures, server tool blocks; developer messages,
AGENTS.md and <environment_context> items, reasoning with encrypted content, function
and custom tool call pairs, web search calls — with deterministic filler text.
`Session.requests()` yields every request of a session as the agent would send it: one
per model call, each the previous history plus what happened since.

`problems(api, original, trimmed)` lists what an upstream would refuse in a trimmed body,
and what trimming must never change.
"""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from ttft_relay import apis
from ttft_relay.trim.policy import without_cache_control

CHAT, RESPONSES, ANTHROPIC = apis.OPENAI_CHAT, apis.OPENAI_RESPONSES, apis.ANTHROPIC_MESSAGES

_VOCAB = (
    "the relay reads file src main py line def return import class self config error test value list dict "
    "request response stream token budget context window model tool call result output input patch diff "
    "函数 返回 错误 配置 {} [] () => == != && || 0 1 2 42 100 /usr/lib/python3 README.md"
).split()


def words(n: int, seed: int) -> str:
    """`n` deterministic filler words (≈ 1.3 cl100k tokens each)."""
    h = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
    x = int.from_bytes(h, "big")
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(_VOCAB[(x >> 33) % len(_VOCAB)])
    return " ".join(out)


def _blob(n: int, seed: int) -> str:
    """Opaque base64 (signatures, encrypted content) of about `n` characters."""
    raw = hashlib.shake_256(str(seed).encode()).digest(max(n * 3 // 4, 3))
    return base64.b64encode(raw).decode()


@dataclass
class Session:
    """A coding-agent session: `turns` prompts, each followed by `rounds` tool rounds."""

    api: str
    turns: int = 30
    rounds: int = 3
    result_words: int = 600
    args_words: int = 60
    seed: int = 1
    shape_seed: int | None = None
    """None: the hand-written shape above. A number: a session of another shape, drawn from
    it (`generated`): how many tool rounds each turn has, how long prompts, results,
    arguments and answers are, where images come, all varying turn by turn."""

    def requests(self) -> Iterator[dict]:
        """Every request of the session, oldest first (deep copies: safe to modify)."""
        builder = {ANTHROPIC: _ClaudeCode, RESPONSES: _Codex, CHAT: _ChatAgent}[self.api](self)
        yield from builder.requests()

    def last(self) -> dict:
        *_, body = self.requests()
        return body


def generated(api: str, shape_seed: int, turns: int = 30) -> Session:
    """A session of a shape the suite did not grow up with, drawn from `shape_seed`."""
    return Session(api, turns=turns, shape_seed=shape_seed, seed=shape_seed + 1000)


PROFILES = ("tool-heavy", "long-messages", "many-short-turns", "images", "mixed")


class _Agent:
    def __init__(self, s: Session) -> None:
        self.s = s
        self.items: list[dict] = []
        self.n = 0
        self.rng = random.Random(s.shape_seed) if s.shape_seed is not None else None
        self.profile = PROFILES[s.shape_seed % len(PROFILES)] if s.shape_seed is not None else None
        self._body: dict | None = None

    def _draw(self, fixed: int, low: int, high: int) -> int:
        """`fixed` for the hand-written shape; else a length from [low, high], long-tailed."""
        if self.rng is None:
            return fixed
        return int(low + (high - low) * self.rng.random() ** 3)

    def rounds(self, t: int) -> int:
        if self.rng is None:
            return self.s.rounds
        most = {"tool-heavy": 10, "long-messages": 2, "many-short-turns": 1, "images": 3, "mixed": 6}[self.profile]
        return self.rng.randint(0, most)

    def prompt_words(self, fixed: int) -> int:
        high = {"long-messages": 6000, "many-short-turns": 40}.get(self.profile or "", 800)
        return self._draw(fixed, 3, high)

    def result_words(self) -> int:
        high = {"tool-heavy": 8000, "many-short-turns": 200}.get(self.profile or "", 2500)
        return self._draw(self.s.result_words, 5, high)

    def args_words(self) -> int:
        return self._draw(self.s.args_words, 2, 400)

    def answer_words(self, fixed: int) -> int:
        high = {"long-messages": 3000, "many-short-turns": 60}.get(self.profile or "", 600)
        return self._draw(fixed, 2, high)

    def image(self, t: int) -> bool:
        if self.rng is None:
            return t % 7 == 3
        return self.rng.random() < {"images": 0.6}.get(self.profile or "", 0.05)

    def seed(self) -> int:
        self.n += 1
        return self.s.seed * 100_003 + self.n

    def snapshot(self) -> dict:
        # A deep copy by a JSON round trip (many times faster than copy.deepcopy); the
        # request-level parts are made once per session.
        if self._body is None:
            self._body = self.body()
        return orjson.loads(orjson.dumps({**self._body, self.items_key: self.items}))

    def requests(self) -> Iterator[dict]:
        self.opening()
        yield self.snapshot()
        for t in range(self.s.turns):
            if t:
                self.prompt(t)
                yield self.snapshot()
            for r in range(self.rounds(t)):
                self.round(t, r)
                yield self.snapshot()
            self.answer(t)


class _ClaudeCode(_Agent):
    items_key = "messages"

    def body(self) -> dict:
        return {
            "model": "claude-opus-4-6",
            "max_tokens": 32000,
            "stream": True,
            "thinking": {"type": "adaptive"},
            "metadata": {"user_id": "user_abc_account_def_session_0b1c"},
            "system": [
                {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                 "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": words(2500, 7), "cache_control": {"type": "ephemeral"}},
            ],
            "tools": [
                {"name": f"Tool{i}", "description": words(120, 1000 + i),
                 "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "arg": {"type": "string"}},
                                  "required": ["path"], "additionalProperties": False}}
                for i in range(24)
            ],
        }  # fmt: skip

    def opening(self) -> None:
        self.items += [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nAs you answer, use this context:\n# claudeMd\n"
                                         + words(900, 11) + "\n</system-reminder>"},
                {"type": "text", "text": "Fix the failing test in tests/test_x.py. " + words(40, 12)},
            ]},
            {"role": "system", "content": "<system-reminder>git status: clean; branch main</system-reminder>"},
        ]  # fmt: skip

    def prompt(self, t: int) -> None:
        content = [{"type": "text", "text": f"Next: step {t}. " + words(self.prompt_words(50), self.seed())}]
        if self.image(t):
            content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                        "data": _blob(6000, self.seed())}})
        self.items.append({"role": "user", "content": content})
        if t % 5 == 4:
            self.items.append({"role": "system", "content": f"<system-reminder>todo list changed {t}</system-reminder>"})

    def round(self, t: int, r: int) -> None:
        seed = self.seed()
        blocks: list[dict] = [{"type": "thinking", "thinking": words(80, seed), "signature": _blob(300, seed)}]
        if (t + r) % 9 == 5:
            blocks[0] = {"type": "redacted_thinking", "data": _blob(800, seed)}
        if r == 0 and t % 6 == 2:
            blocks += [
                {"type": "server_tool_use", "id": f"srvtoolu_{seed}", "name": "web_search", "input": {"query": words(5, seed)}},
                {"type": "web_search_tool_result", "tool_use_id": f"srvtoolu_{seed}", "content": [
                    {"type": "web_search_result", "url": "https://example.com/a", "title": "A",
                     "encrypted_content": _blob(1200, seed), "page_age": None}]},
            ]  # fmt: skip
        calls = 2 if r % 4 == 1 else 1
        ids = [f"toolu_{seed}_{c}" for c in range(calls)]
        blocks += [{"type": "tool_use", "id": i, "name": f"Tool{(seed + c) % 24}",
                    "input": {"path": f"src/f{seed}.py", "arg": words(self.args_words(), seed + c)}}
                   for c, i in enumerate(ids)]  # fmt: skip
        self.items.append({"role": "assistant", "content": blocks})
        results: list[dict] = [{"type": "tool_result", "tool_use_id": i, "content": words(self.result_words(), seed + 7 + c)}
                               for c, i in enumerate(ids)]  # fmt: skip
        if r == 1:
            results[0]["content"] = [{"type": "text", "text": words(self.result_words(), seed + 9)}]
        if r == 2:
            results.append({"type": "text", "text": "<system-reminder>file changed on disk</system-reminder>"})
        results[-1]["cache_control"] = {"type": "ephemeral"}  # Claude Code marks the newest message
        for item in self.items[:-1]:
            for block in item["content"] if isinstance(item["content"], list) else ():
                if item["role"] == "user":
                    block.pop("cache_control", None)
        self.items.append({"role": "user", "content": results})

    def answer(self, t: int) -> None:
        seed = self.seed()
        self.items.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": words(40, seed), "signature": _blob(300, seed)},
            {"type": "text", "text": words(self.answer_words(120), seed + 1)}]})  # fmt: skip


class _Codex(_Agent):
    items_key = "input"

    def body(self) -> dict:
        return {
            "model": "gpt-5.1-codex",
            "instructions": words(3000, 21),
            "tools": [
                {"type": "function", "name": "shell", "description": words(80, 22), "strict": False,
                 "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}},
                {"type": "custom", "name": "apply_patch", "description": words(200, 23),
                 "format": {"type": "grammar", "syntax": "lark", "definition": words(100, 24)}},
                {"type": "function", "name": "update_plan", "description": words(60, 25), "strict": False,
                 "parameters": {"type": "object", "properties": {"plan": {"type": "array"}}}},
                {"type": "web_search"},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "019a-session-uuid",
        }  # fmt: skip

    def opening(self) -> None:
        self.items += [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "<permissions instructions>\n" + words(300, 31) + "\n</permissions instructions>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>\n" + words(700, 32) + "\n</INSTRUCTIONS>"}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Make the tests pass. " + words(30, 33)}]},
        ]  # fmt: skip

    def prompt(self, t: int) -> None:
        if t % 8 == 5:
            self.items.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"<environment_context>\n  <cwd>/repo/sub{t}</cwd>\n</environment_context>"}]})
        content = [{"type": "input_text", "text": f"Now step {t}. " + words(self.prompt_words(40), self.seed())}]
        if self.image(t):
            content.append({"type": "input_image", "image_url": "data:image/png;base64," + _blob(6000, self.seed())})
        self.items.append({"type": "message", "role": "user", "content": content})

    def round(self, t: int, r: int) -> None:
        seed = self.seed()
        self.items.append({"type": "reasoning", "id": f"rs_{seed}", "summary": [{"type": "summary_text", "text": words(30, seed)}],
                           "content": None, "encrypted_content": "gAAAAB" + _blob(1500, seed)})  # fmt: skip
        if r == 0 and t % 6 == 2:
            self.items.append({"type": "web_search_call", "id": f"ws_{seed}", "status": "completed",
                               "action": {"type": "search", "query": words(5, seed)}})  # fmt: skip
        call_id = f"call_{seed}"
        if r % 3 == 2:
            self.items += [
                {"type": "custom_tool_call", "id": f"ctc_{seed}", "status": "completed", "call_id": call_id,
                 "name": "apply_patch", "input": "*** Begin Patch\n" + words(self.args_words() * 3, seed) + "\n*** End Patch"},
                {"type": "custom_tool_call_output", "call_id": call_id, "output": words(self.result_words() // 4, seed + 1)},
            ]  # fmt: skip
        else:
            self.items += [
                {"type": "function_call", "id": f"fc_{seed}", "name": "shell", "call_id": call_id,
                 "arguments": '{"command":["bash","-lc","' + words(self.args_words(), seed) + '"]}'},
                {"type": "function_call_output", "call_id": call_id, "output": words(self.result_words(), seed + 1)},
            ]  # fmt: skip

    def answer(self, t: int) -> None:
        seed = self.seed()
        self.items += [
            {"type": "reasoning", "id": f"rs_{seed}", "summary": [], "content": None, "encrypted_content": "gAAAAB" + _blob(900, seed)},
            {"type": "message", "role": "assistant", "id": f"msg_{seed}",
             "content": [{"type": "output_text", "text": words(self.answer_words(120), seed), "annotations": []}]},
        ]  # fmt: skip


class _ChatAgent(_Agent):
    items_key = "messages"

    def body(self) -> dict:
        return {"model": "gpt-4.1", "stream": True, "tools": [
            {"type": "function", "function": {"name": "read_file", "description": words(60, 41),
                                              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]}

    def opening(self) -> None:
        self.items += [
            {"role": "developer", "content": words(800, 42)},
            {"role": "user", "content": "Review this repository. " + words(300, 43)},
        ]

    def prompt(self, t: int) -> None:
        content: Any = f"Next step {t}. " + words(self.prompt_words(40), self.seed())
        if self.image(t):
            content = [{"type": "text", "text": content},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _blob(6000, self.seed())}}]
        self.items.append({"role": "user", "content": content})

    def round(self, t: int, r: int) -> None:
        seed = self.seed()
        calls = 2 if r % 3 == 1 else 1
        ids = [f"call_{seed}_{c}" for c in range(calls)]
        self.items.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "read_file", "arguments": '{"path": "' + words(self.args_words(), seed) + '"}'}}
            for i in ids]})  # fmt: skip
        self.items += [{"role": "tool", "tool_call_id": i, "content": words(self.result_words(), seed + c)} for c, i in enumerate(ids)]

    def answer(self, t: int) -> None:
        self.items.append({"role": "assistant", "content": words(self.answer_words(120), self.seed())})


def agent_loop(api: str, rounds: int) -> list[dict]:
    """Each request of one prompt's agent loop (ANTHROPIC or RESPONSES) as the real Claude Code
    and Codex send it through the fake upstream (tests/test_trim_clients_e2e.py): each round a
    short answer with one call, and its result of 40 lines; the system prompt and tools of about
    33 kB. Unlike `Session`'s rounds, little of a round stays when its result is shrunk."""
    system = words(1500, 1)
    tools = [{"name": f"Tool{i}", "description": words(300, 2 + i)} for i in range(16)]
    prompt = "Read the files one by one."
    body: dict = (
        {"model": "claude-opus-4-6", "system": system, "tools": tools, "messages": [{"role": "user", "content": prompt}]}
        if api == ANTHROPIC else
        {"model": "gpt-5", "instructions": system, "tools": tools,
         "input": [{"type": "message", "role": "user", "content": prompt}]}
    )  # fmt: skip
    items, requests = items_of(api, body), []
    for n in range(rounds + 1):
        requests.append(orjson.loads(orjson.dumps(body)))
        result = "\n".join(f"{i} " + words(8, n * 1000 + i) for i in range(40))
        if api == ANTHROPIC:
            items.append({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Reading on.", "signature": _blob(16, n)},
                {"type": "tool_use", "id": f"toolu_{n}", "name": "Read", "input": {"file_path": f"f{n}.txt"}}]})
            items.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": result}]})
        else:
            items.append({"type": "function_call", "call_id": f"call_{n}", "name": "exec_command",
                          "arguments": orjson.dumps({"cmd": f"cat f{n}.txt"}).decode()})
            items.append({"type": "function_call_output", "call_id": f"call_{n}", "output": result})
    return requests


# --- validity --------------------------------------------------------------------------


def items_of(api: str, body: dict) -> list:
    return body["input" if api == RESPONSES else "messages"]


def problems(api: str, original: dict, trimmed: dict) -> list[str]:
    """What the upstream would refuse in `trimmed`, or trimming must not have changed."""
    found = []
    key = "input" if api == RESPONSES else "messages"
    if {k: v for k, v in original.items() if k != key} != {k: v for k, v in trimmed.items() if k != key}:
        found.append("request-level parts changed")
    items = trimmed[key]
    found += {ANTHROPIC: _anthropic_problems, RESPONSES: _responses_problems, CHAT: _chat_problems}[api](items)
    # Kept items in their order; untouched kinds of content byte-identical.
    origs = original[key]
    j = 0
    for item in items:
        while j < len(origs) and not _same_skeleton(origs[j], item):
            j += 1
        if j == len(origs):
            found.append(f"item not from the original, or out of order: {str(item)[:120]}")
            break
        j += 1
    return found


def _same_skeleton(a: Any, b: Any) -> bool:
    """`b` is `a` or `a` shrunk: same keys, ids, roles, types; thinking and reasoning intact."""
    if a == b:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    for k in ("role", "type", "id", "call_id", "tool_use_id", "tool_call_id", "name", "signature",
              "thinking", "data", "encrypted_content", "summary"):
        if a.get(k) != b.get(k):
            return False
    if a.get("type") in ("thinking", "redacted_thinking", "reasoning", "server_tool_use", "web_search_tool_result"):
        return False  # never changed, so a == b above
    for k in ("content", "tool_calls"):
        ca, cb = a.get(k), b.get(k)
        if isinstance(ca, list) and isinstance(cb, list):
            if len(ca) != len(cb) and k == "tool_calls":
                return False
            if len(ca) == len(cb) and not all(_same_skeleton(x, y) or _is_placeholder(y) for x, y in zip(ca, cb)):
                return False
    return set(a) == set(b) or set(a) - set(b) <= {"cache_control"} and set(b) - set(a) == set()


def _is_placeholder(part: Any) -> bool:
    return isinstance(part, dict) and "[ttft-relay:" in str(part.get("text", ""))


def _anthropic_problems(messages: list[dict]) -> list[str]:
    found, prev = [], None
    convo = [m for m in messages if m.get("role") != "system"]
    if convo and convo[0]["role"] != "user":
        found.append("first message is not from the user")
    for m in convo:
        if prev is not None and prev["role"] == m["role"] == "assistant":
            found.append("two assistant messages in a row")
        blocks = m["content"] if isinstance(m["content"], list) else []
        if m["role"] == "user":
            wanted = {b["id"] for b in (prev or {}).get("content", []) if isinstance(prev.get("content"), list)
                      and b.get("type") == "tool_use"} if prev and prev["role"] == "assistant" else set()
            got = {b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"}
            if got != wanted:
                found.append(f"tool results {sorted(got)} do not answer the calls {sorted(wanted)} before them")
        else:
            uses = {b["id"] for b in blocks if b.get("type") == "server_tool_use"}
            answered = {b["tool_use_id"] for b in blocks if b.get("type", "").endswith("_tool_result")}
            if uses != answered:
                found.append("server tool use without its result")
        prev = m
    if prev is not None and prev["role"] == "assistant" and any(
            b.get("type") == "tool_use" for b in prev["content"] if isinstance(prev["content"], list)):
        found.append("ends with unanswered tool use")
    return found


def _responses_problems(items: list[dict]) -> list[str]:
    found, calls = [], set()
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind in ("function_call", "custom_tool_call", "local_shell_call"):
            calls.add(item["call_id"])
        elif kind.endswith("_call_output"):
            if item["call_id"] not in calls:
                found.append(f"output {item['call_id']} without its call")
        elif kind == "reasoning":
            after = items[i + 1] if i + 1 < len(items) else None
            if after is None or after.get("type", "message") == "message" and after.get("role") != "assistant":
                found.append(f"reasoning {item['id']} without the item it led to")
    outputs = {item["call_id"] for item in items if item.get("type", "").endswith("_call_output")}
    if calls - outputs:
        found.append(f"calls without output: {sorted(calls - outputs)}")
    return found


def _chat_problems(messages: list[dict]) -> list[str]:
    found, open_calls = [], set()
    for m in messages:
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_calls:
                found.append(f"tool message {m['tool_call_id']} without its call")
            open_calls.discard(m["tool_call_id"])
        else:
            if open_calls:
                found.append(f"calls {sorted(open_calls)} not answered before the next message")
            open_calls = {c["id"] for c in m.get("tool_calls") or ()}
    return found


# --- prefix sharing ------------------------------------------------------------------------


def trimmed_shares(api: str, session: Session, trim: Callable[[dict], Any], trimmed: int) -> tuple[list[float], list[dict]]:
    """Send `session`'s requests through `trim` (a body to a `policy.TrimResult`) until `trimmed`
    of them were trimmed (or the session ends): the `prefix_share` of each trimmed request with
    the request sent before it (trimmed or not), and the stats of those trimmed requests."""
    shares, stats, previous = [], [], None
    for body in session.requests():
        result = trim(body)
        sent = result.body if result.body is not None else body
        if result.stats["trimmed"]:
            shares.append(prefix_share(api, previous, sent) if previous is not None else 0.0)
            stats.append(result.stats)
            if len(shares) == trimmed:
                break
        previous = sent
    return shares, stats


def prefix_share(api: str, previous: dict, body: dict) -> float:
    """The share of `previous`'s items (bytes of their JSON, `cache_control` ignored: clients
    move it every turn) that `body` sends again as its own prefix: what a provider's prompt
    cache can hit."""
    before = [orjson.dumps(without_cache_control(i)) for i in items_of(api, previous)]
    now = [orjson.dumps(without_cache_control(i)) for i in items_of(api, body)]
    common = 0
    for a, b in zip(before, now):
        if a != b:
            break
        common += len(a)
    return common / max(sum(map(len, before)), 1)


def whole_prompt_share(api: str, previous: dict, body: dict) -> float:
    """As `prefix_share`, over the whole prompt a provider caches: the request-level parts
    (`system`, `tools`, `instructions`: its trim shape's `fixed_keys`) first, then the items.
    Changed request-level parts share nothing."""
    shape = apis.get(api).trim_shape
    assert shape is not None, api
    fixed_keys = shape.fixed_keys
    fixed = [len(orjson.dumps(without_cache_control(previous.get(k)))) for k in fixed_keys]
    same = all(without_cache_control(previous.get(k)) == without_cache_control(body.get(k)) for k in fixed_keys)
    items = sum(len(orjson.dumps(without_cache_control(i))) for i in items_of(api, previous))
    kept_items = prefix_share(api, previous, body) * items
    return (sum(fixed) + kept_items) / max(sum(fixed) + items, 1) if same else 0.0
