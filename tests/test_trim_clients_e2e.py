"""The real coding-agent CLIs (the newest Claude Code and Codex CLI on npm) in agent loops through a
real relay: with no budget set, trimmed only on the provider's word; with one, cache-stable.

The fake upstream answers each request with a tool call (Claude Code: `Read` a file of the
sandbox; Codex: `exec_command` to `cat` it) until the conversation carries `rounds` results, so
the CLI sends one request per round, each the previous history plus the call and its result,
as in a real session; then the text answer. With a `window`, the fake refuses a longer request
(its tokens: body bytes / 4) in its API's own words: Anthropic names the limit ("prompt is too
long: N tokens > M maximum"), the Responses API does not. Codex talks HTTP SSE
(`supports_websockets = false`) or, where a test says so, its default WebSocket, which the
fake answers with the same agent loop.

What each CLI did is what docs/trimming.md reports.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import orjson
import pytest

from ttft_relay import apis, store
from ttft_relay.trim import policy, windows
from ttft_relay.testing import shaped
from tests.agent_clis import AgentSandbox, Clis, CliRun, claude_print, claude_result, codex_exec
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import Behaviour, FakeUpstream, RefusingProxy
from ttft_relay.testing.fakes.replies import CHARS_PER_TOKEN, answer_text

PROMPT = "Read the files f0.txt, f1.txt, ... one by one."
RUN_TIMEOUT_S = 240
CLAUDE_MODEL, CLAUDE_MAX_TOKENS = "claude-opus-5-5", 128_000
"""What Claude Code 2.1.332 asks for: a model in no table of the relay's, and 128k of output,
so that a guessed 200k window would leave 72,000 tokens of prompt."""
GUESSED_BUDGET = 200_000 - CLAUDE_MAX_TOKENS
OTHER_MODEL = "acme-coder-2"
"""A model of another provider's on the Anthropic API (Claude Code's ANTHROPIC_MODEL), of a family
no table of the relay's names: a window of tens of thousands is its provider's word alone (a
Claude model's is never learned below 200k, the smallest of its family's)."""
NEW_GPT = "gpt-5.5"
"""A model the Codex CLI knows (its own window: 272k) and the relay's table does not."""
CODEX_CONTEXT_FULL = "Codex ran out of room in the model's context window"
SHARE_GOAL = 0.90
CUT_SHARE_GOAL = 0.80
"""Shrinking the newest old results first: the least whole-prompt share of any request."""
SHRUNK = b"[ttft-relay: tool result removed"
SHAPES = {api: shape for api in (shaped.ANTHROPIC, shaped.RESPONSES) if (shape := apis.get(api).trim_shape)}


def write_files(sandbox: AgentSandbox, rounds: int, lines: int) -> None:
    """`f0.txt` ... one per round, `lines` numbered lines of filler words each (English, code, Chinese)."""
    for n in range(rounds):
        text = "\n".join(f"{i} " + shaped.words(8, n * 100_003 + i) for i in range(lines))
        (sandbox.workdir / f"f{n}.txt").write_text(text + "\n")


def claude_loop(clis: Clis, refusing: RefusingProxy, root: Path, fake: FakeUpstream, relay_url: str,
                rounds: int, lines: int, model: str | None = None) -> CliRun:
    """Claude Code's agent loop over `rounds` files; `model`: ANTHROPIC_MODEL (None: its own)."""
    sandbox = AgentSandbox(root, refusing.url)
    write_files(sandbox, rounds, lines)
    fake.behaviour.tool_call = 'Read {"file_path": "%s/f{n}.txt"}' % sandbox.workdir
    fake.behaviour.tool_rounds = rounds
    env = sandbox.env(ANTHROPIC_BASE_URL=relay_url, **({"ANTHROPIC_MODEL": model} if model else {}))
    return claude_print(clis, sandbox, PROMPT, env, timeout=RUN_TIMEOUT_S)


def codex_sandbox(refusing: RefusingProxy, root: Path, fake: FakeUpstream, relay_url: str, rounds: int, lines: int,
                  model: str, websockets: bool = False) -> AgentSandbox:
    sandbox = AgentSandbox(root, refusing.url)
    write_files(sandbox, rounds, lines)
    config = sandbox.write_codex_config(relay_url + "/v1", websockets=websockets)
    config.write_text(config.read_text().replace('model = "gpt-test"', f'model = "{model}"'))
    fake.behaviour.tool_call = 'exec_command {"cmd": "cat f{n}.txt"}'
    fake.behaviour.tool_rounds = rounds
    return sandbox


def codex_failure(run: CliRun) -> str | None:
    return next((e["error"]["message"] for _, e in run.events() if e.get("type") == "turn.failed"), None)


def agent_loop(cli: str, clis: Clis, refusing: RefusingProxy, root: Path, fake: FakeUpstream, relay_url: str,
               rounds: int) -> None:
    """The real CLI (`claude` or `codex`) through the relay in a loop of `rounds` tool rounds of 40-line
    files, on to its answer."""
    if cli == "claude":
        run = claude_loop(clis, refusing, root, fake, relay_url, rounds=rounds, lines=40)
        assert run.returncode == 0 and claude_result(run)["result"] == answer_text(5), run.describe()
    else:
        sandbox = codex_sandbox(refusing, root, fake, relay_url, rounds=rounds, lines=40, model="gpt-test")
        run = codex_exec(clis, sandbox, PROMPT, sandbox.env(), timeout=RUN_TIMEOUT_S)
        assert run.returncode == 0 and codex_failure(run) is None, run.describe()


def posts(fake: FakeUpstream) -> list[tuple[bytes, int]]:
    """Each model request the fake read (Claude Code also counts big tool results' tokens at
    /v1/messages/count_tokens), its body and the status it answered."""
    return [(r.body, s.status) for r, s in zip(fake.received, fake.sent)
            if r.method == "POST" and r.path.partition("?")[0].endswith(("/messages", "/responses"))]


def fake_tokens(body: bytes) -> int:
    return len(body) // CHARS_PER_TOKEN


def records(relay) -> list[dict]:
    relay.stop()  # flushes the timing log
    return [r for r in relay.log.records() if r["trim"] is not None]  # model requests (not count_tokens)


def tool_results(body: dict) -> list[str]:
    return [str(b["content"]) for m in body["messages"] if isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_result"]


# --- no budget: trimmed on the provider's word only ---------------------------------------------


def test_claude_code_with_no_budget_is_not_trimmed_on_a_guess(clis, refusing, start_relay, tmp_path):
    # Claude Code's newest model is in no table: its window is not known, so nothing is trimmed,
    # however long the prompt grows (here beyond the 72,000 tokens a guessed 200k window left).
    with FakeUpstream(behaviour=Behaviour()) as fake:
        relay = start_relay(reverse_to(fake))
        run = claude_loop(clis, refusing, tmp_path, fake, relay.url(), rounds=9, lines=600)
        assert run.returncode == 0 and claude_result(run)["result"] == answer_text(5), run.describe()
        sent = [orjson.loads(body) for body, status in posts(fake)]
    assert len(sent) == 10 and {(b["model"], b["max_tokens"]) for b in sent} == {(CLAUDE_MODEL, CLAUDE_MAX_TOKENS)}
    for n, body in enumerate(sent):  # every file's content went upstream whole
        assert len(tool_results(body)) == n and "[ttft-relay:" not in orjson.dumps(body).decode()
    recs = records(relay)
    assert len(recs) == len(sent)
    for rec in recs:
        assert rec["trim"]["trimmed"] is False and rec["trim"]["budget"] is None, rec["trim"]
        assert rec["trim"]["reason"].startswith("no budget: the model's window is not known")
    assert recs[-1]["prompt_tokens"] > GUESSED_BUDGET


def test_claude_code_refused_as_too_long_is_trimmed_once_on_the_providers_word(clis, refusing, start_relay, tmp_path):
    # The fake's window is 40k of its tokens: the loop's fifth request is over it. The relay
    # learns the limit from the refusal, trims that request to it and sends it once more;
    # Claude Code gets the answer and goes on, and its next requests are trimmed at once.
    window = 40_000
    with FakeUpstream(behaviour=Behaviour(window=window)) as fake:
        relay = start_relay(reverse_to(fake))
        run = claude_loop(clis, refusing, tmp_path, fake, relay.url(), rounds=9, lines=600, model=OTHER_MODEL)
        assert run.returncode == 0 and claude_result(run)["result"] == answer_text(5), run.describe()
        sent = posts(fake)
        learned_file = relay.log.path.parent / store.FILE_NAME
    statuses = [status for _, status in sent]
    assert statuses.count(400) == 1 and set(statuses) == {200, 400}, statuses
    refused_at = statuses.index(400)
    refused, resent = (orjson.loads(body) for body, _ in sent[refused_at : refused_at + 2])
    assert fake_tokens(sent[refused_at][0]) > window
    assert all(fake_tokens(body) <= window for body, status in sent if status == 200)
    assert shaped.problems(shaped.ANTHROPIC, refused, resent) == []  # a request the API takes
    assert resent["messages"][-1] == refused["messages"][-1]  # the newest result whole
    assert len(tool_results(resent)) == len(tool_results(refused)) and "[ttft-relay:" in str(tool_results(resent)[0])

    recs = records(relay)
    assert len(recs) == len(sent) - 1  # one record for the refused request and its resend
    before, (refusal_rec, *after) = recs[:refused_at], recs[refused_at:]
    assert [r["trim"]["trimmed"] for r in before] == [False] * refused_at  # accepted: untouched
    refusal = refusal_rec["trim"]["refused"]
    assert refusal["resent"] is True and refusal["max_input"] == window and refusal_rec["status"] == 200
    assert after and all(r["trim"]["budget_source"] == "learned" and r["trim"]["trimmed"] for r in after)
    assert all("refused" not in r["trim"] for r in after)
    # Only requests the provider would refuse are trimmed: none smaller than the refused one.
    assert min(r["trim"]["tokens_before"] for r in [refusal_rec, *after]) >= refusal["relay_tokens"]
    assert [(w.model, w.max_input) for w in windows.learned_in(learned_file)] == [(OTHER_MODEL, window)]


def test_codex_gets_a_refusal_that_names_no_limit_as_it_came(clis, refusing, start_relay, tmp_path):
    # The Responses API's refusal names no limit: nothing to trim to, so the relay passes it on.
    # Codex CLI 0.171.0 then fails the turn at once, and a resumed thread sends its whole history
    # again, to the same refusal: it does not compact on a refusal.
    with FakeUpstream(behaviour=Behaviour(window=30_000)) as fake:
        relay = start_relay(reverse_to(fake))
        sandbox = codex_sandbox(refusing, tmp_path, fake, relay.url(), rounds=12, lines=300, model=NEW_GPT)
        run = codex_exec(clis, sandbox, PROMPT, sandbox.env(), timeout=RUN_TIMEOUT_S)
        assert run.returncode != 0 and CODEX_CONTEXT_FULL in (codex_failure(run) or ""), run.describe()
        first = posts(fake)
        fake.behaviour.tool_rounds = 0
        resumed = sandbox.run([str(clis.codex), "exec", "--json", "--skip-git-repo-check", "resume", "--last",
                               "Go on."], sandbox.env(), timeout=RUN_TIMEOUT_S)
        assert resumed.returncode != 0 and CODEX_CONTEXT_FULL in (codex_failure(resumed) or ""), resumed.describe()
        again = posts(fake)[len(first):]
    statuses = [status for _, status in first]
    assert statuses[-1] == 400 and statuses[:-1] == [200] * (len(first) - 1)  # refused once, not retried
    ((body, status),) = again
    assert status == 400 and fake_tokens(body) > fake_tokens(first[-1][0])  # the whole history and "Go on."
    recs = records(relay)
    assert [r["status"] for r in recs] == statuses + [400]
    assert all(r["trim"]["trimmed"] is False and r["trim"]["budget"] is None for r in recs)
    for rec in recs[-2:]:
        assert rec["trim"]["refused"]["resent"] is False and rec["trim"]["refused"]["window"] is None
    assert windows.learned_in(relay.log.path.parent / store.FILE_NAME) == []


# --- a budget set: prefix sharing on the real sessions -------------------------------------------


def socket_prompts(socket) -> list[tuple[dict, int]]:
    """Each model turn of a Responses WebSocket as the provider reads it (a turn continuing a
    response: that response's whole prompt, its output, then the turn's own input), with its
    index among the socket's turns (the prewarm, which generates nothing, left out)."""
    whole: dict[str, dict] = {}
    prompts = []
    for n, turn in enumerate(socket.turns):
        create = {k: v for k, v in turn.request.items() if k != "previous_response_id"}
        if (previous := turn.request.get("previous_response_id")) is not None:
            before = whole[previous]
            create["input"] = before["input"] + before["output"] + create["input"]
        whole[turn.response_id] = {**create, "output": turn.output}
        if not turn.prewarm:
            prompts.append((create, n))
    return prompts


@pytest.mark.parametrize(("cli", "order", "rounds"), [
    *((cli, order, 80) for order in policy.SHRINK_ORDERS for cli in ("claude", "codex", "codex-ws")),
    # Newest first in a longer loop: past shrinking, rounds go from the middle, the front kept.
    ("claude", policy.NEWEST, 160), ("codex", policy.NEWEST, 160),
])  # fmt: skip
def test_a_real_session_trimmed_to_a_budget_keeps_its_prefix(clis, refusing, start_relay, tmp_path, cli, order, rounds):
    # 80 tool rounds of ~700 tokens each over a 40k budget: about half the session is trimmed.
    # Each request, as the provider reads it, shares its whole prompt (system, tools, then the
    # items) with the one before it: what the provider's prompt cache hits.
    budget = 40_000
    api = shaped.ANTHROPIC if cli == "claude" else shaped.RESPONSES
    with FakeUpstream(behaviour=Behaviour()) as fake:
        relay = start_relay(reverse_to(fake), relay_trim_max_tokens=budget, relay_trim_shrink_order=order)
        if cli == "codex-ws":
            sandbox = codex_sandbox(refusing, tmp_path, fake, relay.url(), rounds=rounds, lines=40, model="gpt-test",
                                    websockets=True)
            run = codex_exec(clis, sandbox, PROMPT, sandbox.env(), timeout=RUN_TIMEOUT_S)
            assert run.returncode == 0 and codex_failure(run) is None, run.describe()
            assert posts(fake) == []  # no fallback to HTTP
            (socket,) = fake.sockets
            prompts = socket_prompts(socket)
        else:
            agent_loop(cli, clis, refusing, tmp_path, fake, relay.url(), rounds=rounds)
            prompts = [(orjson.loads(body), n) for n, (body, status) in enumerate(posts(fake))]
    recs = records(relay)
    if cli == "codex-ws":
        recs = sorted(recs, key=lambda r: r["turn"])
    sent = [body for body, _ in prompts]
    trims = [recs[n]["trim"] for _, n in prompts]
    assert len(sent) == rounds + 1 and len(recs) == (rounds + 1 if cli != "codex-ws" else len(socket.turns))
    shares = [shaped.prefix_share(api, previous, body)
              for previous, body, trim in zip(sent, sent[1:], trims[1:]) if trim["trimmed"]]
    whole = [shaped.whole_prompt_share(api, previous, body) for previous, body in zip(sent, sent[1:])]
    kept = [share for share, trim in zip(whole, trims[1:]) if trim["plan"] == "kept"]
    cuts = sorted(share for share, trim in zip(whole, trims[1:]) if trim["plan"] == "new")
    summary = (f"{cli}, {order} first: {len(shares)} of {len(sent)} requests trimmed, items' prefix share of the trimmed mean "
               f"{statistics.mean(shares):.3f}, min {min(shares):.3f}; whole prompt, every request after the first: "
               f"median {statistics.median(whole):.3f}, min {min(whole):.3f}; with the cut kept: min {min(kept, default=0.0):.3f}; "
               f"at the {len(cuts)} new cuts: {', '.join(f'{c:.3f}' for c in cuts)}")
    print(summary)
    assert len(shares) > 30 and all(r["trim"]["tokens_after"] <= budget for r in recs), summary
    # The text as the CLI wrote it, a trimmed WebSocket turn too (re-framed: fixes/websocket_text.py).
    assert "\ufffd" not in orjson.dumps(sent).decode()
    assert statistics.mean(shares) >= SHARE_GOAL, summary
    assert statistics.median(whole) >= SHARE_GOAL and min(kept, default=0.0) >= SHARE_GOAL, summary
    first_result = next(orjson.dumps(i) for i in shaped.items_of(api, sent[-1]) if any(SHAPES[api].results(i)))
    if order == policy.OLDEST:
        # Only a new cut (here where shrinking reaches further) misses the prompt cache: it changes
        # the oldest result still whole, and every one after it. New cuts are rare.
        assert len(cuts) <= len(shares) / 10, summary
        assert SHRUNK in first_result  # the model lost what it read first
    else:
        # A new cut changes the newest old results it shrinks, and what follows them: shallow
        # cuts, more often, each keeping most of the prompt the provider cached.
        assert min(whole) >= CUT_SHARE_GOAL, summary
        assert SHRUNK not in first_result  # the model lost what it read last


# --- over budget: the newest turn alone is too long ------------------------------------------------


@pytest.mark.parametrize("cli", ["claude", "codex"])
def test_a_real_agent_loop_over_budget_is_still_trimmed(clis, refusing, start_relay, tmp_path, cli):
    # One prompt and 40 tool rounds: the whole loop is the newest turn, and with every old
    # result shrunk it is still over the budget. Its oldest rounds go (it used to go out
    # whole, growing past the budget round by round); the CLI goes on to its answer.
    budget = OVER_BUDGET[cli]
    with FakeUpstream(behaviour=Behaviour()) as fake:
        relay = start_relay(reverse_to(fake), relay_trim_max_tokens=budget)
        agent_loop(cli, clis, refusing, tmp_path, fake, relay.url(), rounds=40)
        sent = [orjson.loads(body) for body, status in posts(fake)]
    recs = records(relay)
    assert len(recs) == len(sent) == 41
    over = [r["trim"] for r in recs if r["trim"]["over_budget"]]
    summary = (f"{cli}: {len(over)} of {len(recs)} requests over budget {budget}, tokens before "
               f"{max(t['tokens_before'] for t in over)} at most, after {max(t['tokens_after'] for t in over)}, "
               f"rounds dropped {max(t['dropped_rounds'] for t in over)} at most")
    print(summary)
    assert len(over) > 10 and all(t["trimmed"] and t["dropped_rounds"] > 0 for t in over), summary
    assert all(r["trim"]["tokens_after"] <= budget for r in recs), summary
    assert max(t["tokens_before"] for t in over) > 1.5 * budget, summary


def test_codex_over_its_websocket_is_trimmed_turn_by_turn(clis, refusing, start_relay, tmp_path):
    # Codex's default transport: one socket, a prewarm with the whole input, then each turn
    # as what it adds to the previous response. Over budget, the relay sends each turn whole
    # and trimmed on the same socket; Codex goes on to its answer.
    budget = OVER_BUDGET["codex"]
    with FakeUpstream(behaviour=Behaviour()) as fake:
        relay = start_relay(reverse_to(fake), relay_trim_max_tokens=budget)
        sandbox = codex_sandbox(refusing, tmp_path, fake, relay.url(), rounds=40, lines=40, model="gpt-test",
                                websockets=True)
        run = codex_exec(clis, sandbox, PROMPT, sandbox.env(), timeout=RUN_TIMEOUT_S)
        assert run.returncode == 0 and codex_failure(run) is None, run.describe()
        (socket,) = fake.sockets
        creates = socket.response_creates
    assert posts(fake) == []  # no fallback to HTTP
    turns = sorted(records(relay), key=lambda r: r["turn"])
    assert len(turns) == len(creates) >= 41
    trimmed = [(r, create) for r, create in zip(turns, creates) if r["trim"]["trimmed"]]
    summary = (f"codex over WebSocket: {len(trimmed)} of {len(turns)} turns trimmed, "
               f"{sum(r['trim']['over_budget'] for r, _ in trimmed)} over budget, tokens before "
               f"{max(r['trim']['tokens_before'] for r, _ in trimmed)} at most")
    print(summary)
    assert len(trimmed) > 20 and all(r["trim"]["tokens_after"] <= budget for r in turns), summary
    assert all("previous_response_id" not in create for _, create in trimmed)  # sent whole


OVER_BUDGET = {"claude": 16_000, "codex": 10_500}
"""Budgets the loops above pass with every old result shrunk (Claude Code's first request is
~10k tokens of system, tools and prompt; Codex's ~9.8k)."""
