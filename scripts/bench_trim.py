"""Trimming benchmark: how long the relay's trimmer takes on a long conversation.

Builds a deterministic history of 1,000 OpenAI chat messages (about 700k tokens of mixed
English, Chinese and code, with tool calls and their results), and trims it to each budget:

    cold       first sight of the conversation: every kept message is encoded
    next turn  the same conversation plus the assistant's reply and a new question, with
               the counts of the previous request in the cache

against a naive trimmer in the same run, which (like LiteLLM's `trim_messages`) walks from
the newest message back and recounts the whole kept list at every step, without a cache.
Times are medians over --repeat runs (the naive one runs once: it is slow and has no cache).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from addons import scope, tokens, trimming  # noqa: E402

MODEL = "gpt-4o"
ENGLISH = (
    "the relay keeps each request within the model context window so that the first token "
    "arrives sooner and the bill stays small while the conversation history grows longer "
    "every turn users paste logs stack traces and documents into the chat"
).split()
CHINESE = "模型在生成第一个令牌之前需要读取整个提示因此过长的对话历史会导致首字延迟增加成本上升甚至超出上下文长度限制我们的中继会在请求发送到上游之前裁剪最早的轮次"
CODE = [
    "def handle(flow):\n    st = state.get(flow)\n    if st is None:\n        return\n",
    "for i, item in enumerate(items):\n    if i in dropped:\n        continue\n    out.append(item)\n",
    "class Budget:\n    tokens: int\n    source: str\n",
    'SELECT id, created_at FROM requests WHERE model = "gpt-4o" ORDER BY created_at DESC LIMIT 50;\n',
    "const res = await fetch(url, { method: 'POST', body: JSON.stringify(payload) });\n",
]


def text(rng: random.Random, tokens_wanted: int) -> str:
    """Roughly `tokens_wanted` tokens: English, a Chinese passage, a code block."""
    parts = [" ".join(rng.choice(ENGLISH) for _ in range(int(tokens_wanted * 0.45)))]
    start = rng.randrange(len(CHINESE))
    parts.append((CHINESE[start:] + CHINESE)[: int(tokens_wanted * 0.2)])
    parts.append("```python\n" + "".join(rng.choice(CODE) for _ in range(max(1, tokens_wanted // 60))) + "```")
    return "\n\n".join(parts)


def history(n_messages: int, seed: int = 7) -> list[dict[str, Any]]:
    """System prompt, then turns of question, maybe tool calls with results, answer."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant."}]
    call = 0
    while len(messages) < n_messages - 1:
        messages.append({"role": "user", "content": text(rng, rng.randint(250, 1050))})
        if rng.random() < 0.4:
            ids = [f"call_{(call := call + 1)}" for _ in range(rng.randint(1, 2))]
            messages.append({
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": "search_docs", "arguments": '{"query": "%s"}' % rng.choice(ENGLISH)}}
                    for i in ids
                ],
            })  # fmt: skip
            messages += [{"role": "tool", "tool_call_id": i, "content": text(rng, rng.randint(500, 1800))} for i in ids]
        messages.append({"role": "assistant", "content": text(rng, rng.randint(350, 1400))})
    messages = messages[: n_messages - 1]
    while messages[-1]["role"] == "tool" or messages[-1].get("tool_calls"):  # don't end mid tool call
        messages.pop()
    messages.append({"role": "user", "content": text(rng, 300)})
    return messages


def naive_trim(messages: list[dict], budget: int, counter: tokens.Counter) -> list[dict]:
    """Newest first, recounting the kept list at every step (LiteLLM's trim_messages loop)."""

    def count(ms: list[dict]) -> int:
        return counter.request_overhead + sum(counter.message(m) for m in ms)

    system = [m for m in messages if m["role"] == "system"]
    kept: list[dict] = []
    for m in reversed([m for m in messages if m["role"] != "system"]):
        used = count(system + kept)
        if used + count([m]) - counter.request_overhead > budget:
            break
        kept.insert(0, m)
    return system + kept


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        setup = fn()
        t = time.perf_counter()
        setup()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[120_000, 32_000])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--tiktoken-file", help="local o200k_base.tiktoken (else cl100k_base offline)")
    args = parser.parse_args()

    loader = tokens.TokenizerLoader(args.tiktoken_file, download=None)
    loader.start()
    loader.wait()
    encoding = loader.get(tokens.encoding_for(MODEL).name)
    plain = tokens.Counter(encoding.encoding, encoding.label)  # no cache: for totals and the naive trimmer

    old = history(args.messages)
    rng = random.Random(99)
    new = old + [{"role": "assistant", "content": text(rng, 600)}, {"role": "user", "content": text(rng, 200)}]
    total = plain.request_overhead + sum(map(plain.message, old))
    calls = sum(len(m.get("tool_calls") or ()) for m in old)
    print(f"history: {len(old)} messages, {total:,} tokens ({encoding.label}), {calls} tool calls; model {MODEL}")
    print(f"next turn: +{len(new) - len(old)} messages (the reply and a new question); median of {args.repeat} runs\n")

    windows = trimming.ContextWindows()
    header = f"{'budget':>8}  {'case':<10} {'ours ms':>9} {'naive ms':>10} {'naive/ours':>11}  {'kept':>5} {'tokens after':>13}"
    print(header)
    print("-" * len(header))
    for budget_tokens in args.budgets:
        budget = trimming.budget_for(MODEL, {}, windows=windows, user_max=budget_tokens)

        def trim(messages: list[dict], counter: tokens.Counter) -> trimming.TrimResult:
            return trimming.trim({"model": MODEL, "messages": messages}, scope.OPENAI_CHAT, budget, counter)

        def cold():
            counter = tokens.Counter(encoding.encoding, encoding.label, cache=tokens.CountCache())
            return lambda: trim(old, counter)

        def next_turn():
            counter = tokens.Counter(encoding.encoding, encoding.label, cache=tokens.CountCache())
            trim(old, counter)  # the previous request fills the cache
            return lambda: trim(new, counter)

        # The floor for a cold trim: counting just the messages that are kept, once, no cache.
        kept = old[-trim(old, plain).stats["messages_after"] + 1 :]
        floor_ms = median_ms(lambda: lambda: sum(map(plain.message, kept)), args.repeat)
        print(f"{budget.tokens:>8}  {'(counting only the kept messages, once)':<33} {floor_ms:>9.1f}")
        for case, messages, ours in (("cold", old, cold), ("next turn", new, next_turn)):
            ours_ms = median_ms(ours, args.repeat)
            stats = ours()().stats
            t = time.perf_counter()
            naive_kept = naive_trim(messages, budget.tokens, plain)
            naive_ms = (time.perf_counter() - t) * 1000
            print(
                f"{budget.tokens:>8}  {case:<10} {ours_ms:>9.1f} {naive_ms:>10.1f} {naive_ms / ours_ms:>10.0f}x"
                f"  {stats['messages_after']:>5} {stats['tokens_after']:>13,}"
            )
            assert stats["tokens_after"] <= budget.tokens and len(naive_kept) > 1
    print("\ngoals on a 2-core machine: cold <= 60 ms, next turn <= 10 ms")


if __name__ == "__main__":
    main()
