"""The first-token line (ttft_relay/observe/prefill.py) as an operator sharing one relay needs it:
no client owns it (a bounded share of samples per source, a fit no source dominates), it is
keyed by what changes prefill (model, reasoning effort / thinking budget, tools' size), junk
names do not push a proven line out, a lasting change of the provider's speed is re-learned in
a few requests, and while a line is learned a request is not named a slow hop for that; the
shared file through which the workers use each other's samples at once."""

from __future__ import annotations

import asyncio
import os
import random

import orjson

import pytest

from ttft_relay import apis, store
from ttft_relay.observe import prefill, verdicts
from ttft_relay.timing import phases

KEY, UP = "api.test:443 · gpt-4o", "api.test:443"


def sample(t: float, own: float, *, source: str = "a", tokens: int = 1000) -> prefill.Sample:
    return (t, tokens, 0, own, source)


def verdict(rates: prefill.PrefillRates, own: float, *, key: str = KEY, tokens: int = 1000) -> str:
    """The verdict of a request whose first token is all the upstream's own wait."""
    p = rates.expect(key, (tokens, 0))
    return phases.verdict({"upstream_wait": own, "ttft": own}, expectation=p.expectation, unlearned=p.unlearned,
                          learning=p.learning)


def judged_then_learned(rates: prefill.PrefillRates, own: float, t: float, *, source: str = "a",
                        key: str = KEY, tokens: int = 1000) -> str:
    words = verdict(rates, own, key=key, tokens=tokens)
    rates.add(key, UP, sample(t, own, source=source, tokens=tokens))
    return words


# --- learning ---------------------------------------------------------------------------------


def test_a_line_being_learned_names_no_slow_hop_for_the_provider_unless_far_out_of_what_it_saw():
    rates = prefill.PrefillRates()
    rng = random.Random(1)
    # The very first requests: nothing to hold them against, and none blamed on the provider.
    first = [judged_then_learned(rates, 160 + rng.gauss(0, 5), t) for t in range(prefill.MIN_SAMPLES + 4)]
    assert first == [phases.OK] * len(first)
    p = rates.expect(KEY, (1000, 0))
    assert p.expectation is not None and not p.learning
    # While learning (3 to 7 samples), a wait far beyond what the first requests took is the
    # provider's, not told apart yet; one in line is ok, and says it is learning.
    learning = prefill.PrefillRates()
    for t in range(prefill.PROVISIONAL_MIN):
        learning.add(KEY, UP, sample(t, 160))
    far = learning.expect(KEY, (1000, 0))
    v = phases.judge({"upstream_wait": 3000.0, "ttft": 3000.0}, expectation=far.expectation,
                     unlearned=far.unlearned, learning=far.learning)
    assert v.words == phases.UPSTREAM_WAIT and "18.8× the 160 ms it took on this line's first requests" in v.detail
    assert v.expected_ttft_ms is None  # nothing learned well enough to predict
    v = phases.judge({"upstream_wait": 200.0, "ttft": 200.0}, expectation=far.expectation,
                     unlearned=far.unlearned, learning=far.learning)
    assert v.words == phases.OK and "learning this upstream · model: 3 of 8 requests" in v.detail
    # A prompt far longer than the first ones: its prefill may explain any wait; not blamed.
    assert verdict(learning, 3000.0, tokens=20_000) == phases.OK
    # Before any such line, a wait with no expectation and no learning is the old `against nothing`.
    assert phases.verdict({"upstream_wait": 3000.0, "ttft": 3000.0}) == phases.UPSTREAM_WAIT


@pytest.mark.parametrize("seed", range(5))
def test_a_lasting_change_of_the_providers_speed_is_relearned_within_10_requests(seed):
    rng = random.Random(seed)
    rates = prefill.PrefillRates()
    t = 0.0
    for _ in range(200):  # a long learned history: 1 s first tokens
        t += 1
        judged_then_learned(rates, 1000 + rng.gauss(0, 30), t, tokens=rng.randint(500, 1500))
    # The model becomes 2× slower for everyone, for good: 96 requests, none of them queued.
    after = []
    for _ in range(96):
        t += 1
        after.append(judged_then_learned(rates, 2000 + rng.gauss(0, 60), t, tokens=rng.randint(500, 1500)))
    misnamed = [i for i, words in enumerate(after) if words != phases.OK]
    assert len(misnamed) <= 0.05 * len(after), after
    assert max(misnamed, default=-1) < 10, after  # right again from the 10th request on at the latest
    # And a queue comes and goes: spikes on a third of the requests never become the line.
    spiked = []
    for _ in range(60):
        t += 1
        queued = rng.random() < 0.33
        own = 2000 + rng.gauss(0, 60) + (rng.uniform(2000, 6000) if queued else 0)
        spiked.append((queued, judged_then_learned(rates, own, t, tokens=rng.randint(500, 1500))))
    assert sum(words == phases.UPSTREAM_QUEUEING for queued, words in spiked if queued) >= 0.9 * sum(
        queued for queued, _ in spiked)
    assert all(words == phases.OK for queued, words in spiked if not queued)


# --- no client owns the line ------------------------------------------------------------------


def test_one_clients_slow_requests_neither_move_the_line_nor_hide_a_real_queue_from_the_others():
    rates = prefill.PrefillRates()
    rng = random.Random(2)
    t = 0.0
    for _ in range(30):  # the team's own traffic: 300 ms first tokens, from four keys
        t += 1
        rates.add(KEY, UP, sample(t, 300 + rng.gauss(0, 15), source=f"key {rng.randrange(4)}"))
    for _ in range(300):  # one client whose first token comes 4 s late, in a row
        t += 1
        judged_then_learned(rates, 4000 + rng.gauss(0, 100), t, source="key poison")
    line = rates.lines[KEY]
    assert sum(s[4] != "key poison" for s in line.samples) == 30  # its samples pushed none of theirs out
    p = rates.expect(KEY, (1000, 0))
    assert p.expectation.own_ms == pytest.approx(300, abs=40)
    # A real 3 s provider queue still reads as one for every other client, and the poisoner's run
    # with it is no new speed.
    assert judged_then_learned(rates, 3300, t + 1, source="key 1") == phases.UPSTREAM_QUEUEING
    assert verdict(rates, 320) == phases.OK and not rates.expect(KEY, (1000, 0)).learning


def test_a_full_window_drops_the_oldest_sample_of_the_source_holding_most():
    line = prefill.Line(UP)
    for t in range(prefill.WINDOW):
        line.add(sample(t, 100.0, source="many" if t % 4 else "few"))
    line.add(sample(10_000, 100.0, source="few"))
    counts = {src: sum(s[4] == src for s in line.samples) for src in ("many", "few")}
    assert counts == {"many": prefill.WINDOW * 3 // 4 - 1, "few": prefill.WINDOW // 4 + 1}
    assert prefill.balanced([sample(t, 1, source="x") for t in range(50)] + [sample(99, 1, source="y")]) \
        == [sample(t, 1, source="x") for t in range(42, 50)] + [sample(99, 1, source="y")]


# --- keyed by what changes prefill ------------------------------------------------------------


def test_the_line_is_keyed_by_model_reasoning_effort_thinking_budget_and_tools_size():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"description": "x" * 20_000}}}]
    chat = apis.get(apis.OPENAI_CHAT).prefill_traits
    assert chat({"model": "o3", "messages": []}) == ""
    assert chat({"reasoning_effort": "high", "tools": tools}) == "effort high · tools ≤64 kB"
    assert chat({"reasoning_effort": "high", "tools": tools[:0]}) == "effort high"
    responses = apis.get(apis.OPENAI_RESPONSES).prefill_traits
    assert responses({"reasoning": {"effort": "low"}}) == "effort low"
    # Codex's WebSocket turn: the websocket addon reads the same from its response.create.
    assert responses({"type": "response.create", "reasoning": {"effort": "xhigh"}, "tools": tools}) == \
        "effort xhigh · tools ≤64 kB"
    anthropic = apis.get(apis.ANTHROPIC_MESSAGES).prefill_traits
    assert anthropic({"thinking": {"type": "enabled", "budget_tokens": 10_000}}) == "thinking ≤16384 tokens"
    assert anthropic({"thinking": {"type": "disabled", "budget_tokens": 10_000}}) == ""
    gemini = apis.get(apis.GEMINI).prefill_traits
    assert gemini({"generationConfig": {"thinkingConfig": {"thinkingBudget": 900}}}) == "thinking ≤1024 tokens"
    for api in apis.ALL:  # never raises, whatever the body
        for body in (None, [], "x", {"tools": "x", "reasoning_effort": 5, "thinking": [], "reasoning": 1}):
            assert api.prefill_traits(body) == ""
    assert prefill.model_key(UP, "o3", "effort high") == "api.test:443 · o3 · effort high"
    assert prefill.model_key(UP, None) == "api.test:443 · ?"


def test_high_effort_requests_learn_their_own_line():
    rates = prefill.PrefillRates()
    high = prefill.model_key(UP, "gpt-4o", "effort high")
    for t in range(40):
        rates.add(KEY, UP, sample(t, 300 + t % 5))
        rates.add(high, UP, sample(t, 4000 + 10 * (t % 5)))
    assert verdict(rates, 3300) == phases.UPSTREAM_QUEUEING
    assert verdict(rates, 4020, key=high) == phases.OK


# --- a proven line is never pushed out by junk ------------------------------------------------


def test_80_junk_models_do_not_send_a_proven_model_back_to_learning():
    rates = prefill.PrefillRates()
    for t in range(20):
        rates.add(KEY, UP, sample(t, 300))
    for i in range(80):  # on the real upstream, and on an upstream of the client's choosing
        assert rates.add(prefill.model_key(UP, f"junk-{i}"), UP, sample(100 + i, 50)) == (i < 15) or i >= 15
        rates.add(prefill.model_key("evil.test:443", f"junk-{i}"), "evil.test:443", sample(100 + i, 50))
    assert rates.expect(KEY, (1000, 0)).expectation is not None
    per_upstream = {up: sum(line.upstream == up for line in rates.lines.values()) for up in (UP, "evil.test:443")}
    assert per_upstream == {UP: prefill.UPSTREAM_MODELS, "evil.test:443": prefill.UPSTREAM_MODELS}
    # Even a table full of proven junk lines keeps the proven real one; a new name waits.
    full = prefill.PrefillRates()
    for t in range(10):
        full.add(KEY, UP, sample(t, 300))
    for i in range(prefill.MAX_MODELS * 2):
        up = f"evil{i % 8}.test:443"
        for t in range(prefill.MIN_SAMPLES):
            full.add(prefill.model_key(up, f"junk-{i}"), up, sample(100 + t, 50))
    assert KEY in full.lines and len(full.lines) == prefill.MAX_MODELS
    # Unless it went unused for a week.
    assert full.add(prefill.model_key("new.test", "m"), "new.test", sample(prefill.STALE_S + 200, 50))
    assert KEY not in full.lines


# --- shared by every process logging into one directory --------------------------------------


def process(path) -> verdicts.Verdicts:
    """A relay process's Verdicts on the store at `path`."""
    v = verdicts.Verdicts()
    v.shared = store.SharedStore(path, [verdicts.KIND])
    return v


def learn(v: verdicts.Verdicts, s: prefill.Sample) -> None:
    """As `observe` does with a record's sample."""
    assert v.rates.add(KEY, UP, s)
    v.changed.add(KEY)


def test_what_one_process_learns_the_other_uses_at_its_next_sync(tmp_path):
    path = tmp_path / store.FILE_NAME
    a, b = process(path), process(path)
    for t in range(prefill.MIN_SAMPLES):
        learn(a, sample(t, 300))
    asyncio.run(b.sync())
    assert b.rates.expect(KEY, (1000, 0)).expectation is None
    asyncio.run(a.sync())
    asyncio.run(b.sync())
    assert b.rates.expect(KEY, (1000, 0)).expectation.learned_from == prefill.MIN_SAMPLES
    asyncio.run(a.sync())  # a reads its own line back, and does not learn it twice
    assert len(a.rates.lines[KEY].samples) == prefill.MIN_SAMPLES
    # A new process (a restart) starts from the store.
    c = process(path)
    asyncio.run(c.sync())
    assert len(c.rates.lines[KEY].samples) == prefill.MIN_SAMPLES
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert len(path.read_bytes().splitlines()) == 1  # one entry per line


def test_two_processes_learning_one_line_at_once_lose_nothing_and_no_source_owns_it(tmp_path):
    path = tmp_path / store.FILE_NAME
    a, b = process(path), process(path)
    t = 0
    for _ in range(30):
        for name, v in (("a", a), ("b", b)):
            for _ in range(10):
                t += 1
                learn(v, sample(t, 300, source=f"{name}{t % 3}"))
            asyncio.run(v.sync())
    asyncio.run(a.sync())
    asyncio.run(b.sync())
    (value,) = [e.value for e in verdicts.learned_lines(path)]
    assert len(value["samples"]) == prefill.WINDOW and value["samples"][-1][0] == t  # the newest of both
    for v in (a, b):
        assert len(v.rates.lines[KEY].samples) == prefill.WINDOW
        assert v.rates.lines[KEY].samples[-1][0] == t
    # 300 samples of one source on the line in the store push none of the others' out.
    flood = process(path)
    asyncio.run(flood.sync())
    for n in range(300):
        learn(flood, sample(t + 1 + n, 300, source="flood"))
    asyncio.run(flood.sync())
    (value,) = [e.value for e in verdicts.learned_lines(path)]
    sources = {s[4] for s in value["samples"]}
    assert "flood" in sources and len(sources) == 7
    assert not list(tmp_path.glob("*.tmp"))


def test_a_new_speed_learned_in_one_process_is_the_lines_in_the_store(tmp_path):
    path = tmp_path / store.FILE_NAME
    a, b = process(path), process(path)
    for t in range(prefill.MIN_SAMPLES):
        learn(a, sample(t, 300))
    asyncio.run(a.sync())
    asyncio.run(b.sync())
    line = a.rates.lines[KEY]
    line.since = 100.0  # as a new speed from a run starting at t=100 does
    line.samples = type(line.samples)(s for s in line.samples if s[0] >= 100.0)
    learn(a, sample(100, 900))
    asyncio.run(a.sync())
    asyncio.run(b.sync())
    assert [s[0] for s in b.rates.lines[KEY].samples] == [100]
    assert [s[0] for s in verdicts.learned_lines(path)[0].value["samples"]] == [100]


def test_the_previous_versions_file_is_read_once(tmp_path):
    old = tmp_path / verdicts.LEGACY_FILE
    old.write_bytes(b"".join(orjson.dumps(["w", KEY, UP, *sample(t, 300)]) + b"\n" for t in range(5)) + b"torn")
    v = process(tmp_path / store.FILE_NAME)
    asyncio.run(v.sync())
    assert len(v.rates.lines[KEY].samples) == 5


def test_a_server_that_holds_every_request_far_longer_stays_queueing_until_it_lasts():
    rates = prefill.PrefillRates()
    t = 0.0
    for _ in range(20):
        t += 1
        judged_then_learned(rates, 12 + t % 3, t)
    held = []
    for _ in range(prefill.RELEARN_RUN_FAR + 3):  # 300 ms more on every request: 25 times the line
        t += 1
        held.append(judged_then_learned(rates, 312 + t % 5, t))
    assert held[:prefill.RELEARN_RUN_FAR] == [phases.UPSTREAM_QUEUEING] * prefill.RELEARN_RUN_FAR
    assert held[-1] == phases.OK  # it lasted: the new normal


def test_while_learning_a_prompt_is_held_only_against_first_requests_at_least_as_long():
    rates = prefill.PrefillRates()
    for t, (tokens, own) in enumerate([(100, 110.0), (14_000, 1500.0), (500, 150.0)]):
        rates.add(KEY, UP, sample(t, own, tokens=tokens))
    assert verdict(rates, 1100, tokens=10_000) == phases.OK  # the 14k prompt took 1.5 s: prefill, maybe
    assert verdict(rates, 3500, tokens=10_000) == phases.UPSTREAM_WAIT
    assert verdict(rates, 900, tokens=200) == phases.UPSTREAM_WAIT  # the 500-token one took 150 ms
    assert verdict(rates, 3500, tokens=30_000) == phases.OK  # none as long: its prefill may explain it
