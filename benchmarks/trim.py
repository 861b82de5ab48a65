"""Trimming benchmark: what the relay's trimmer costs, and how much prompt cache it keeps.

Five parts, each beside baselines measured in the same run (`--only` runs some of them), the
relay's trimmer in each shrink order of --orders (relay_trim_shrink_order: "new" shrinks
oldest first, the default; "newest" from the newest round back):

1. Cost (ms, median of --repeat runs) on four histories —
     chat        1,000 OpenAI chat messages (~680k tokens of English, Chinese, code, tool calls)
     claude      a Claude Code-like session (ttft_relay/testing/shaped.py): 30 turns x 3 tool rounds
     codex       a Codex-like Responses session, same size
     loop        one prompt and an 8-round agent loop (~130k tokens): one turn, nothing to drop
   each trimmed
     cold        on first sight: every kept message is encoded
     next turn   the same conversation one model call later, with the caches of the previous
               request (token counts, and the conversation's cut)
   by this trimmer ("new"), by the trimmer before it ("before": ttft_relay/ of --baseline-commit,
   loaded from git), and for the chat history by a naive one that, like LiteLLM's
   `trim_messages`, recounts the whole kept list at every step.
2. Prefix sharing on a 30-turn agent session per API (every model call a request, budget
   --share-budget): for each trimmed request, the share of the previous request's items
   (bytes of their JSON, `cache_control` markers ignored: clients move them every turn)
   that it sends again as its own prefix. A provider's prompt cache hits on that prefix.
   Untrimmed it is the whole previous request. The same over --generated sessions per
   profile of other shapes (`ttft_relay/testing/shaped.py`'s `generated`: tool-heavy, long messages,
   many short turns, images, mixed), each until --generated-trimmed of its requests were
   trimmed, at --generated-budgets, with the relay's cut depth (room for 16 requests at the
   conversation's growth) beside the fixed 60 % before it and 8 or 24 requests' room:
   the mean and minimum share, how often a new cut came, and the context kept.
3. Cuts across a restart: in the same sessions (30 turns per API, and --generated per
   profile at the first --generated-budgets), at every trimmed request after the first
   cut, what a relay restarted just before it would send (a fresh process: empty count
   cache, its plans read from the file the one before kept, `plans.KeptPlans`), beside one
   that keeps plans in memory only (as before): the share of the previous request it sends
   again, and how often it made a new cut.
4. Whole-prompt sharing in the real CLIs' agent loop (`shaped.agent_loop`: one prompt,
   --loop-rounds tool rounds of 40-line results, budget --loop-budget; what
   tests/test_trim_clients_e2e.py drives the real Claude Code and Codex through): the
   share of the previous request's whole prompt each request sends again (median, min, the
   lowest at new cuts), the context kept, and whether the loop's first result is still whole.
5. Counting speed on English, Chinese and code text (the `chat` history's messages):
   tiktoken with cl100k_base (what counted gpt-4o before o200k_base could be had
   offline: the baseline), tiktoken with o200k_base from the bpe-openai wheel (what
   counts now), and bpe-openai's own Rust BPE with o200k_base; time per pass, ratios
   against the baseline, and whether the two o200k_base counts agree.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from ttft_relay import apis, store
from ttft_relay.trim import plans, policy, tokens
from ttft_relay.testing import shaped

REPO = Path(__file__).resolve().parent.parent

MODEL = "gpt-4o"
BASELINE_COMMIT = "b819cce"
"""main before issue 12's trimmer: whole turns dropped, first user message not pinned, no plans."""
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


def load_baseline(commit: str) -> Any | None:
    """The `trimming` module of `commit` (with its own tokens/scope/state), or None without git."""
    target = Path(tempfile.mkdtemp(prefix="bench-trim-")) / "trim_before"
    target.mkdir()
    try:
        for name in ("__init__", "scope", "state", "tokens", "trimming"):
            source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:addons/{name}.py"],
                                    check=True, capture_output=True).stdout  # fmt: skip
            (target / f"{name}.py").write_bytes(source)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"(no baseline: cannot read {commit} from git: {e})")
        return None
    # A package of its own name, from its folder (not put on sys.path): its modules import one another.
    spec = importlib.util.spec_from_file_location("trim_before", target / "__init__.py",
                                                  submodule_search_locations=[str(target)])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return importlib.import_module("trim_before.trimming")


class Trimmer:
    """One trimmer (new, shrinking in `order`, or before) with its tokenizer, called the same way for both."""

    def __init__(self, module: Any, encoding: Any, label: str, new: bool, order: str = policy.OLDEST) -> None:
        self.module, self.encoding, self.label, self.new, self.order = module, encoding, label, new, order
        self.tokens = sys.modules[module.__name__.rsplit(".", 1)[0] + ".tokens"]

    @property
    def name(self) -> str:
        """"before", "new" (oldest first, the default) or "newest" (relay_trim_shrink_order=newest)."""
        return "before" if not self.new else "new" if self.order == policy.OLDEST else self.order

    def fresh(self) -> tuple[Any, Any]:
        """A counter with an empty count cache, and an empty plan cache (new only)."""
        counter = self.tokens.Counter(self.encoding, self.label, cache=self.tokens.CountCache())
        return counter, policy.PlanCache() if self.new else None

    def trim(self, body: dict, api: str, budget: int, state: tuple[Any, Any]):
        counter, plans = state
        b = self.module.Budget(budget, "user")
        if self.new:
            return self.module.trim(body, apis.get(api), b, counter, plans=plans, order=self.order)
        return self.module.trim(body, api, b, counter)  # the old module takes the API's name


def median_ms(make, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        run = make()
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def outcome(stats: dict) -> str:
    if stats["trimmed"]:
        return f"{stats['tokens_after']:>7,} tokens, {stats['messages_after']} items"
    return f"untouched: {stats['reason']}"


def cost_table(trimmers: list[Trimmer], args, plain: tokens.Counter) -> None:
    claude = list(shaped.Session(shaped.ANTHROPIC, turns=30).requests())
    codex = list(shaped.Session(shaped.RESPONSES, turns=30).requests())
    loop = list(shaped.Session(shaped.ANTHROPIC, turns=1, rounds=8, result_words=10_000).requests())
    old = history(args.messages)
    rng = random.Random(99)
    chat_next = old + [{"role": "assistant", "content": text(rng, 600)}, {"role": "user", "content": text(rng, 200)}]
    cases = [
        *[(f"chat {len(old)} messages", apis.OPENAI_CHAT, {"model": MODEL, "messages": old},
           {"model": MODEL, "messages": chat_next}, b) for b in args.budgets],
        ("claude 30 turns", apis.ANTHROPIC_MESSAGES, claude[-2], claude[-1], args.share_budget),
        ("codex 30 turns", apis.OPENAI_RESPONSES, codex[-2], codex[-1], args.share_budget),
        ("loop 8 rounds", apis.ANTHROPIC_MESSAGES, loop[-2], loop[-1], args.share_budget),
    ]
    print(f"cost in ms, median of {args.repeat}; next turn = one model call later, caches of the previous request\n")
    header = f"{'history':<20} {'budget':>7}  {'trimmer':<7} {'cold':>7} {'next':>7}  outcome (next turn)"
    print(header)
    print("-" * (len(header) + 30))
    for name, api, body, following, budget in cases:
        full = plain.request_overhead + sum(map(plain.message, shaped.items_of(api, body)))
        for t in trimmers:
            def cold(t=t, body=body, api=api, budget=budget):
                state = t.fresh()
                return lambda: t.trim(body, api, budget, state)

            def next_turn(t=t, body=body, following=following, api=api, budget=budget):
                state = t.fresh()
                t.trim(body, api, budget, state)  # the previous request fills the caches
                return lambda: t.trim(following, api, budget, state)

            cold_ms, next_ms = median_ms(cold, args.repeat), median_ms(next_turn, args.repeat)
            state = t.fresh()
            t.trim(body, api, budget, state)
            stats = t.trim(following, api, budget, state).stats
            print(f"{name:<20} {budget:>7}  {t.name:<7} {cold_ms:>7.1f} {next_ms:>7.1f}  {outcome(stats)}")
        if api == apis.OPENAI_CHAT:
            t0 = time.perf_counter()
            naive_trim(body["messages"], budget, plain)
            print(f"{name:<20} {budget:>7}  {'naive':<7} {(time.perf_counter() - t0) * 1000:>7.1f}")
        print(f"{'':<20} {'':>7}  (history: {full:,} tokens, {len(shaped.items_of(api, body))} items)")


def sharing(trimmer: Trimmer | None, api: str, budget: int) -> tuple[list[float], int, int]:
    """Per trimmed request, the share of the previous request's item bytes it sends again."""
    state = trimmer.fresh() if trimmer else None
    shares, new_plans, previous = [], 0, None
    n = 0
    for body in shaped.Session(api, turns=30).requests():
        n += 1
        result = trimmer.trim(body, api, budget, state) if trimmer else None
        sent = result.body if result and result.body is not None else body
        items = [orjson.dumps(policy.without_cache_control(i)) for i in shaped.items_of(api, sent)]
        if previous is not None and (trimmer is None or result.stats["trimmed"]):
            common = 0
            for a, b in zip(previous, items):
                if a != b:
                    break
                common += len(a)
            shares.append(common / sum(map(len, previous)))
            new_plans += bool(result and result.stats.get("plan") == "new")
        previous = items
    return shares, new_plans, n


def sharing_table(trimmers: list[Trimmer], budget: int) -> None:
    print(f"\nprefix sharing, 30-turn agent sessions (3 tool rounds per turn, every model call a request), budget {budget:,}:")
    print("share of the previous request's items (bytes) that each trimmed request sends again as its prefix\n")
    header = f"{'session':<10} {'trimmer':<9} {'requests':>8} {'trimmed':>8} {'mean':>7} {'< 50 %':>7} {'min':>7}  new cuts"
    print(header)
    print("-" * len(header))
    for label, api in (("claude", shaped.ANTHROPIC), ("codex", shaped.RESPONSES), ("chat", shaped.CHAT)):
        for trimmer in [None, *trimmers]:
            shares, new_plans, n = sharing(trimmer, api, budget)
            name = "untrimmed" if trimmer is None else trimmer.name
            if not shares:
                print(f"{label:<10} {name:<9} {n:>8} {0:>8}     (nothing trimmed)")
                continue
            low = sum(s < 0.5 for s in shares)
            print(f"{label:<10} {name:<9} {n:>8} {len(shares):>8} {statistics.mean(shares):>7.1%} {low:>7} "
                  f"{min(shares):>7.1%}  {new_plans if trimmer and trimmer.new else ''}")


CUT_POLICIES = {
    "fixed 40 %": (policy.REQUESTS_BETWEEN_CUTS, 0.4, 0.4),
    "8 requests": (8, policy.LEAST_HEADROOM, policy.MOST_HEADROOM),
    "16 requests": (16, policy.LEAST_HEADROOM, policy.MOST_HEADROOM),
    "24 requests": (24, policy.LEAST_HEADROOM, policy.MOST_HEADROOM),
}
"""How deep a new cut goes: (REQUESTS_BETWEEN_CUTS, LEAST_HEADROOM, MOST_HEADROOM). "fixed 40 %":
every cut to 60 % of the budget, as before issue 25; the others leave room for that many
requests at the conversation's growth (16: the relay's). Shrinking newest first only a drop
goes by them: that order is measured with the relay's alone."""
RELAYS_CUTS = "16 requests"


@contextlib.contextmanager
def cut_policy(name: str) -> Iterator[None]:
    names = ("REQUESTS_BETWEEN_CUTS", "LEAST_HEADROOM", "MOST_HEADROOM")
    saved = [getattr(policy, n) for n in names]
    for n, value in zip(names, CUT_POLICIES[name]):
        setattr(policy, n, value)
    try:
        yield
    finally:
        for n, value in zip(names, saved):
            setattr(policy, n, value)


def sharing_generated(trimmers: list[Trimmer], budgets: list[int], seeds: int, trimmed: int) -> None:
    apis_ = (shaped.ANTHROPIC, shaped.RESPONSES, shaped.CHAT)
    print(f"\nprefix sharing on generated sessions (ttft_relay/testing/shaped.py generated), {seeds} per profile and API, each "
          f"until {trimmed} of its requests were trimmed:")
    print("mean: of a session's trimmed requests' shares (the worst session's, and over all); min: the lowest share "
          "(a new cut);\nnew cuts: of the trimmed requests; context: tokens sent / budget, mean over trimmed requests "
          "and right after a new cut\n")
    header = (f"{'budget':>7} {'cuts':<12} {'order':<7} {'profile':<17} {'sessions':>8} {'worst':>7} {'mean':>7} "
              f"{'min':>6} {'new cuts':>8} {'context':>8} {'at cut':>7}")
    print(header)
    print("-" * len(header))
    for budget in budgets:
        for cut_name, new in [(cut, t) for t in trimmers if t.new for cut in CUT_POLICIES
                              if t.order == policy.OLDEST or cut == RELAYS_CUTS]:
            rows: dict[str, list[tuple[list[float], list[dict]]]] = {}
            with cut_policy(cut_name):
                for api in apis_:
                    for seed in range(seeds * len(shaped.PROFILES)):
                        state = new.fresh()
                        session = shaped.generated(api, seed, turns=100_000)
                        trim = functools.partial(new.trim, api=api, budget=budget, state=state)
                        found = shaped.trimmed_shares(api, session, trim, trimmed)
                        rows.setdefault(shaped.PROFILES[seed % len(shaped.PROFILES)], []).append(found)
            for profile, sessions in rows.items():
                means = [statistics.mean(shares) for shares, _ in sessions]
                stats = [st for _, sts in sessions for st in sts]
                cuts = [st for st in stats if st["plan"] == "new"]
                print(f"{budget:>7,} {cut_name:<12} {new.order:<7} {profile:<17} {len(sessions):>8} {min(means):>7.1%} "
                      f"{statistics.mean(means):>7.1%} {min(min(sh) for sh, _ in sessions):>6.1%} "
                      f"{len(cuts) / len(stats):>8.1%} {statistics.mean(st['tokens_after'] for st in stats) / budget:>8.0%} "
                      f"{statistics.mean(st['tokens_after'] for st in cuts) / budget:>7.0%}")


def restart_shares(trimmer: Trimmer, api: str, session: shaped.Session, budget: int, trimmed: int,
                   path: Path) -> dict[str, list[tuple[float, bool]]]:
    """For each trimmed request after the session's first cut (up to `trimmed` of them): the
    share of the previous request that a relay restarted just before it sends again, and
    whether it made a new cut, with plans kept in `path` ("kept") and in memory ("memory")."""
    path.unlink(missing_ok=True)
    counter, _ = trimmer.fresh()
    running = plans.KeptPlans(path)
    found: dict[str, list[tuple[float, bool]]] = {"kept": [], "memory": []}
    previous, cut_seen = None, False
    for body in session.requests():
        if cut_seen and previous is not None:
            for label, restarted in (("kept", plans.KeptPlans(path)), ("memory", policy.PlanCache())):
                if isinstance(restarted, plans.KeptPlans):
                    restarted.refresh()
                fresh, _ = trimmer.fresh()
                result = trimmer.trim(body, api, budget, (fresh, restarted))
                if result.stats["trimmed"]:
                    sent = result.body if result.body is not None else body
                    found[label].append((shaped.prefix_share(api, previous, sent), result.stats["plan"] == "new"))
        running.refresh()
        result = trimmer.trim(body, api, budget, (counter, running))
        running.save()
        cut_seen = cut_seen or result.stats["trimmed"]
        previous = result.body if result.body is not None else body
        if len(found["kept"]) >= trimmed:
            break
    return found


def restart_table(trimmers: list[Trimmer], budget: int, seeds: int, trimmed: int) -> None:
    print(f"\ncuts across a restart, budget {budget:,}: the first request after a restart before each trimmed request "
          f"(after the first cut, up to {trimmed} per session)\nshare of the previous request it sends again; new cuts: "
          "how often the restarted relay made one\n")
    header = f"{'sessions':<17} {'order':<7} {'plans':<7} {'restarts':>8} {'mean':>7} {'min':>7} {'new cuts':>9}"
    print(header)
    print("-" * len(header))
    groups: dict[str, list[shaped.Session]] = {
        f"{label} 30 turns": [shaped.Session(api, turns=30)]
        for label, api in (("claude", shaped.ANTHROPIC), ("codex", shaped.RESPONSES), ("chat", shaped.CHAT))}
    for seed in range(seeds * len(shaped.PROFILES)):
        for api in (shaped.ANTHROPIC, shaped.RESPONSES, shaped.CHAT):
            groups.setdefault(shaped.PROFILES[seed % len(shaped.PROFILES)], []).append(
                shaped.generated(api, seed, turns=100_000))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / store.FILE_NAME
        for name, sessions in groups.items():
            for trimmer in trimmers:
                rows: dict[str, list[tuple[float, bool]]] = {"kept": [], "memory": []}
                for session in sessions:
                    for label, found in restart_shares(trimmer, session.api, session, budget, trimmed, path).items():
                        rows[label] += found
                for label, found in rows.items():
                    if not found:
                        continue
                    shares = [share for share, _ in found]
                    print(f"{name:<17} {trimmer.order:<7} {label:<7} {len(found):>8} {statistics.mean(shares):>7.1%} "
                          f"{min(shares):>7.1%} {sum(new for _, new in found) / len(found):>9.1%}")


def loop_table(trimmers: list[Trimmer], budget: int, rounds: int) -> None:
    print(f"\nwhole-prompt sharing in an agent loop of one prompt and {rounds} tool rounds, as the real Claude Code "
          f"and Codex send it (shaped.agent_loop), budget {budget:,}:\nthe share of the previous request's whole prompt "
          "(system, tools, items) each request sends again, over every request after the first; context: tokens "
          "sent / budget, mean over the trimmed requests; first result: whether the last request still has the "
          "loop's first tool result whole\n")
    header = (f"{'loop':<8} {'order':<7} {'trimmed':>8} {'new cuts':>8} {'median':>7} {'min':>7} {'at cuts, lowest':<24} "
              f"{'context':>7}  first result")
    print(header)
    print("-" * len(header))
    for label, api in (("claude", shaped.ANTHROPIC), ("codex", shaped.RESPONSES)):
        for trimmer in trimmers:
            state, previous, whole, cuts, trimmed = trimmer.fresh(), None, [], [], []
            for body in shaped.agent_loop(api, rounds):
                result = trimmer.trim(body, api, budget, state)
                sent = result.body if result.body is not None else body
                if previous is not None:
                    whole.append(shaped.whole_prompt_share(api, previous, sent))
                    if result.stats["plan"] == "new":
                        cuts.append(whole[-1])
                if result.stats["trimmed"]:
                    trimmed.append(result.stats["tokens_after"] / budget)
                previous = sent
            shape = apis.get(api).trim_shape
            assert shape is not None
            first = next(i for i in shaped.items_of(api, previous) if any(shape.results(i)))
            lowest = ", ".join(f"{c:.1%}" for c in sorted(cuts)[:3])
            print(f"{label:<8} {trimmer.order:<7} {len(trimmed):>8} {len(cuts):>8} {statistics.median(whole):>7.1%} "
                  f"{min(whole):>7.1%} {lowest:<24} {statistics.mean(trimmed) if trimmed else 0:>7.0%}  "
                  f"{'shrunk' if '[ttft-relay:' in str(first) else 'whole'}")


def counting_speed(repeat: int, messages: int) -> None:
    import bpe_openai

    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    loader.load()
    o200k = loader.get(tokens.O200K)
    cl100k = loader.get(tokens.CL100K)
    assert o200k is not None and cl100k is not None and o200k.label == tokens.O200K
    rust = bpe_openai.get_encoding("o200k_base")
    texts = [m["content"] for m in history(messages) if isinstance(m.get("content"), str)]
    chars = sum(map(len, texts))
    counters = [("tiktoken cl100k_base (before)", cl100k.encoding), ("tiktoken o200k_base (now)", o200k.encoding),
                ("bpe-openai o200k_base", rust)]  # fmt: skip
    print(f"\ncounting speed: {len(texts)} messages, {chars:,} characters (English, Chinese, code); median of {repeat}\n")
    header = f"{'counter':<32} {'tokens':>9} {'ms':>8} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    base = None
    for name, encoding in counters:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            n = sum(len(encoding.encode_ordinary(x)) for x in texts)
            times.append((time.perf_counter() - t) * 1000)
        ms = statistics.median(times)
        base = base or ms
        print(f"{name:<32} {n:>9,} {ms:>8.1f} {ms / base:>7.2f}")
    same = all(o200k.encoding.encode_ordinary(x) == rust.encode_ordinary(x) for x in texts)
    print(f"o200k_base: tiktoken and bpe-openai give the same tokens: {same}")


PARTS = ("cost", "sharing", "generated", "restart", "loop", "counting")
"""The bench's parts, in the order of the module docstring (sharing: its 30-turn sessions, generated: the rest)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[120_000, 32_000])
    parser.add_argument("--share-budget", type=int, default=40_000)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    parser.add_argument("--tiktoken-file", help="local o200k_base.tiktoken (else the bpe-openai wheel's)")
    parser.add_argument("--generated", type=int, default=2, help="generated sessions per profile and API (0: none)")
    parser.add_argument("--generated-budgets", type=int, nargs="+", default=[40_000, 80_000])
    parser.add_argument("--generated-trimmed", type=int, default=60, help="trimmed requests per generated session")
    parser.add_argument("--orders", choices=policy.SHRINK_ORDERS, nargs="+", default=list(policy.SHRINK_ORDERS),
                        help="the shrink orders to measure (relay_trim_shrink_order)")
    parser.add_argument("--loop-rounds", type=int, default=80, help="tool rounds of the agent loop (part loop)")
    parser.add_argument("--loop-budget", type=int, default=30_000, help="its budget: about half the loop trimmed")
    parser.add_argument("--only", choices=PARTS, nargs="+", default=list(PARTS),
                        help="run only these parts (e.g. --only restart: the cuts across a restart)")
    args = parser.parse_args()

    loader = tokens.TokenizerLoader(args.tiktoken_file)
    loader.load()
    encoding = loader.get(tokens.encoding_for(MODEL).name)
    plain = tokens.Counter(encoding.encoding, encoding.label)  # no cache: for totals and the naive trimmer
    trimmers = [Trimmer(policy, encoding.encoding, encoding.label, new=True, order=order) for order in args.orders]
    if {"cost", "sharing"} & set(args.only) and (before := load_baseline(args.baseline_commit)) is not None:
        trimmers.append(Trimmer(before, encoding.encoding, encoding.label, new=False))
    print(f"encoding {encoding.label}; baseline: ttft_relay/ at {args.baseline_commit}\n")
    if "cost" in args.only:
        cost_table(trimmers, args, plain)
    if "sharing" in args.only:
        sharing_table(trimmers, args.share_budget)
    if "generated" in args.only and args.generated:
        sharing_generated(trimmers, args.generated_budgets, args.generated, args.generated_trimmed)
    if "restart" in args.only:
        restart_table([t for t in trimmers if t.new], args.generated_budgets[0], args.generated, args.generated_trimmed)
    if "loop" in args.only:
        loop_table([t for t in trimmers if t.new], args.loop_budget, args.loop_rounds)
    if "counting" in args.only:
        counting_speed(args.repeat, args.messages)


if __name__ == "__main__":
    main()
