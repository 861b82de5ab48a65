"""The observe floor's pure logic: the learned prefill model, prompt cache misses, attempt groups."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import orjson

from ttft_relay import apis
from ttft_relay.observe import attempts, conversations, prefill
from ttft_relay.timing import phases, record

# --- the prefill model ------------------------------------------------------------------------


def traffic(n: int, *, base=100.0, per_1k=100.0, per_1k_cached=10.0, noise=15.0, spikes=0.0, spike_ms=1500.0,
            seed=1, cached=True, source="client a") -> list[prefill.Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u, c = rng.randint(100, 20_000), rng.randint(0, 50_000) if cached else 0
        y = base + per_1k * u / 1000 + per_1k_cached * c / 1000 + rng.gauss(0, noise)
        if rng.random() < spikes:
            y += spike_ms
        out.append((1000.0 + i, u, c, max(0.0, y), source))
    return out


def test_the_fit_recovers_base_and_both_rates():
    f = prefill.fit(traffic(120))
    assert f.base_ms == pytest.approx(100, abs=15)
    assert f.per_1k_uncached == pytest.approx(100, rel=0.05)
    assert f.per_1k_cached == pytest.approx(10, rel=0.2)
    assert f.scale_ms == pytest.approx(15, rel=0.5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), spikes=st.floats(0, 0.35), base=st.floats(50, 800), per_1k=st.floats(5, 300))
@example(seed=187, spikes=0.3125, base=50.0, per_1k=5.0)  # a single median fit predicted 413 ms for 133
@example(seed=7948, spikes=0.3427, base=354.5, per_1k=268.0)  # ... and a single pass that dropped spikes, 300 ms off
def test_queue_spikes_on_a_third_of_the_requests_do_not_bend_the_fit(seed, spikes, base, per_1k):
    f = prefill.fit(traffic(96, base=base, per_1k=per_1k, spikes=spikes, seed=seed))
    clean = prefill.fit(traffic(96, base=base, per_1k=per_1k, seed=seed))
    for tokens in (500, 5_000, 20_000):
        assert f.expect(tokens, 0).own_ms == pytest.approx(clean.expect(tokens, 0).own_ms, abs=60 + 0.1 * base)
    # Least squares would have lifted every prediction by about spikes × 1.5 s.
    spiked = prefill.fit(traffic(96, base=base, per_1k=per_1k, spikes=spikes, seed=seed))
    assert spiked.expect(5_000, 0).tolerance_ms >= prefill.QUEUE_MIN_MS


def test_nothing_is_predicted_before_enough_requests_nor_far_beyond_what_was_seen():
    rates = prefill.PrefillRates()
    for s in traffic(prefill.PROVISIONAL_MIN - 1, cached=False):
        rates.add("up · m", "up", s)
    assert rates.expect("up · m", (5000, 0)) == (
        None, f"learning this upstream · model: {prefill.PROVISIONAL_MIN - 1} of 8 requests", True)
    for s in traffic(prefill.MIN_SAMPLES - 1, cached=False)[prefill.PROVISIONAL_MIN - 1:]:
        rates.add("up · m", "up", s)
    expectation, why, learning = rates.expect("up · m", (5000, 0))
    assert expectation.provisional and learning and why == "learning this upstream · model: 7 of 8 requests"
    rates.add("up · m", "up", (2000.0, 10_000, 0, 1100.0, "client a"))
    expectation, why, learning = rates.expect("up · m", (5000, 0))
    assert expectation is not None and why is None and not learning and expectation.learned_from == prefill.MIN_SAMPLES
    assert not expectation.provisional
    expectation, why, learning = rates.expect("up · m", (500_000, 0))
    assert expectation is None and why.startswith("no prompt this long learned yet") and learning
    assert rates.expect("up · m", None) == (None, "the prompt's size is unknown: the upstream reported no usage", False)


def test_a_rate_is_learned_only_from_sizes_that_varied_and_never_negative():
    same_size = [(float(i), 1000 + i % 3, 0, 300.0 + i % 5) for i in range(20)]
    f = prefill.fit(same_size)
    assert f.per_1k_uncached is None and f.per_1k_cached is None and f.base_ms == pytest.approx(302, abs=2)
    assert f.expect(1001, 0).prompt_ms == 0  # no claim about the prompt's share: never "context length"
    shrinking = [(float(i), 1000 * i, 0, 2000.0 - 10 * i) for i in range(1, 20)]
    assert prefill.fit(shrinking).per_1k_uncached is None


def test_the_tolerance_grows_with_the_prediction_and_the_traffics_own_spread():
    calm = prefill.fit(traffic(60, noise=5)).expect(10_000, 0)
    assert calm.tolerance_ms == pytest.approx(prefill.QUEUE_RELATIVE * calm.own_ms, rel=0.01)
    noisy = prefill.fit(traffic(60, noise=400)).expect(10_000, 0)
    assert noisy.tolerance_ms > noisy.own_ms  # its own spread: a 1.5 s wait more is not queueing there
    assert prefill.fit(traffic(60)).expect(200, 0).tolerance_ms == prefill.QUEUE_MIN_MS


def test_prompt_tokens_come_from_the_providers_usage_first():
    assert prefill.prompt_of({"input_tokens": 5000, "cached_tokens": 4000}, 7) == (1000, 4000)
    assert prefill.prompt_of({"input_tokens": 5000}, 7) == (5000, 0)
    assert prefill.prompt_of({"output_tokens": 5}, 700) == (700, 0)
    assert prefill.prompt_of(None, None) is None
    assert prefill.prompt_of({"input_tokens": True}, None) is None


def test_the_previous_versions_samples_are_read_and_garbage_is_skipped():
    rows = [prefill.Row("up · m", "up", s) for s in traffic(20)]
    data = b"".join(orjson.dumps(["w1", r.key, r.upstream, *r.sample]) + b"\n" for r in rows)
    assert [row for _, row in prefill.decode_rows(data)] == rows
    assert {writer for writer, _ in prefill.decode_rows(data)} == {"w1"}
    good = data.splitlines(keepends=True)[0]
    for garbage in (b"", b"{", b'["w", "k", "u", 1, -2, 0, 3, "s"]', b'["w", "k", "u", "x", 1, 0, 3, "s"]', b"[]",
                    b'{"version": 1, "samples": {}}', good[:-5]):
        assert prefill.decode_rows(garbage + b"\n") == []
    assert len(prefill.decode_rows(b"{torn\n" + good)) == 1


def test_a_line_in_the_store_round_trips_and_garbage_is_not_a_line():
    line = prefill.Line("up")
    for s in traffic(20):
        line.add(s)
    assert prefill.line_of(orjson.loads(orjson.dumps(prefill.line_value(line)))) == ("up", 0.0, list(line.samples))
    value = prefill.line_value(line)
    for garbage in ([], {**value, "since": "x"}, {**value, "samples": [[1, 2, 3]]}, {**value, "upstream": 1},
                    {**value, "samples": [[1, -2, 0, 3, "s"]]}, {**value, "samples": [[1, 2, 0, 3, "s"]] * 300}):
        assert prefill.line_of(garbage) is None


def test_the_lines_learned_are_bounded_whatever_clients_name():
    rates = prefill.PrefillRates()
    for i in range(prefill.MAX_MODELS + 10):
        upstream = f"up{i % 8}"
        rates.add(prefill.model_key(upstream, f"model-{i}" * 50), upstream, (float(i), 100, 0, 10.0, "a"))
    assert len(rates.lines) == prefill.MAX_MODELS
    assert all(len(key) <= prefill.KEY_MAX for key in rates.lines)


# --- prompt cache misses ---------------------------------------------------------------------


def chat(turns: int, system: str = "You are terse.") -> dict:
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i} " + "x" * 4000},
                     {"role": "assistant", "content": f"answer {i}"}]
    return {"model": "gpt-4o", "stream": True, "messages": messages[:-1]}


def step(conv: conversations.Conversations, body: dict, cached: int, *, ts: float, total: int = 8000,
         client: str = "10.0.0.1") -> str | None:
    return conv.step(apis.get(apis.OPENAI_CHAT), body, client=client, model="gpt-4o", ts=ts,
                     usage={"input_tokens": total, "cached_tokens": cached})


def test_a_continuation_the_provider_reads_uncached_after_caching_is_a_miss():
    conv = conversations.Conversations()
    assert step(conv, chat(1), 0, ts=0) is None  # nothing cached yet: no miss to speak of
    assert step(conv, chat(2), 4000, ts=10) is None  # cached: a hit
    miss = step(conv, chat(3), 0, ts=22)
    assert miss == "this conversation's previous request, 12 s earlier, had 4,000 tokens cached"
    assert step(conv, chat(4), 0, ts=30) is None  # the one before reported nothing cached


def test_no_miss_without_a_continuation_a_long_pause_or_a_cacheable_size():
    conv = conversations.Conversations()
    step(conv, chat(2), 4000, ts=0)
    assert step(conv, chat(3, system="Another agent."), 0, ts=5) is None  # another conversation
    step(conv, chat(2), 4000, ts=10)
    edited = chat(3)
    edited["messages"][3]["content"] = "the user edited an earlier turn"
    assert step(conv, edited, 0, ts=15) is None  # not the previous prefix
    step(conv, chat(2), 4000, ts=20)
    assert step(conv, chat(3), 0, ts=20 + conversations.CACHE_TTL_S + 1) is None  # the cache may have expired
    step(conv, chat(2), 4000, ts=1000)
    assert step(conv, chat(3), 0, ts=1001, total=500) is None  # below what providers cache
    step(conv, chat(2), 4000, ts=2000)
    assert step(conv, chat(3), 0, ts=2001, client="10.0.0.2") is None  # another client


def test_conversations_remembered_are_bounded_and_odd_bodies_pass():
    conv = conversations.Conversations(limit=10)
    for i in range(50):
        step(conv, chat(1, system=f"s{i}"), 100, ts=i)
    assert len(conv.known) == 10
    for body in (None, [], {"messages": "text"}, {"messages": []}, {"messages": [{"content": 2 ** 70}]}):
        assert conv.step(apis.get(apis.OPENAI_CHAT), body, client="c", model="m", usage={"input_tokens": 9000}, ts=0) is None


# --- attempt groups --------------------------------------------------------------------------


def attempt_record(rid: str, ts: float, *, cut: bool, total_ms: float) -> record.Record:
    marks = {"request_body": 1.0, "forwarded": 2.0, "end": total_ms}
    if not cut:
        marks |= {"response_head": total_ms - 50, "first_token": total_ms - 40}
    return record.build_record(record.RecordInput(id=rid, ts=ts, api="openai.chat", model="m", stream=True, status=None if cut else 200,
                                                  upstream="u", marks=marks, tokens_expected=True, tls_expected=False,
                                                  reused_connection=True, rtt_ms=None, client_aborted=cut,
                                                  error="Client disconnected." if cut else None))


def run(table: dict[bytes, attempts.Attempt], rec: record.Record, key: bytes) -> record.Record:
    placed, after = attempts.group(rec, table.get(key), key)
    if after is not None:
        table[key] = after
    return record.judged(rec, placed)


def test_three_attempts_each_cut_at_60_s_share_a_group():
    table: dict[bytes, attempts.Attempt] = {}
    key = attempts.request_key("key k1", "", "POST", "/v1/chat/completions", b'{"model": "m"}')
    first = run(table, attempt_record("a", 1000.0, cut=True, total_ms=60_000), key)
    second = run(table, attempt_record("b", 1060.5, cut=True, total_ms=60_000), key)
    third = run(table, attempt_record("c", 1121.0, cut=False, total_ms=4_000), key)
    assert [(r.attempt_group, r.attempt) for r in (first, second, third)] == [("a", 1), ("a", 2), ("a", 3)]
    # The success closed the group: the same request again is a new one.
    again = run(table, attempt_record("d", 1130.0, cut=False, total_ms=100), key)
    assert (again.attempt_group, again.attempt) == (None, None)


def test_not_a_retry_another_request_another_client_too_late_or_alongside():
    table: dict[bytes, attempts.Attempt] = {}
    key = attempts.request_key("key k1", "s1", "POST", "/v1/x", b"body")
    run(table, attempt_record("a", 1000.0, cut=True, total_ms=5_000), key)
    for other in (attempts.request_key("key k2", "s1", "POST", "/v1/x", b"body"),  # another key, one address
                  attempts.request_key("key k1", "s2", "POST", "/v1/x", b"body"),  # another session of the key
                  attempts.request_key("address 10.0.0.1", "s1", "POST", "/v1/x", b"body"),
                  attempts.request_key("key k1", "s1", "POST", "/v1/x", b"bodY")):
        assert run(dict(table), attempt_record("b", 1006.0, cut=False, total_ms=100), other).attempt is None
    late = attempt_record("c", 1005.0 + attempts.WINDOW_S + 1, cut=False, total_ms=100)
    assert run(dict(table), late, key).attempt is None
    alongside = attempt_record("d", 1001.0, cut=False, total_ms=100)  # sent while the first still ran
    assert run(dict(table), alongside, key).attempt is None


def test_the_body_digest_reads_only_its_edges():
    big = b"a" * (3 * attempts.BODY_EDGE)
    middle_changed = big[:attempts.BODY_EDGE + 5] + b"b" + big[attempts.BODY_EDGE + 6:]
    def key(method: str, body: bytes | None) -> bytes:
        return attempts.request_key("key c", "", method, "/p", body)

    assert key("POST", big) == key("POST", middle_changed)
    assert key("POST", big) != key("POST", big + b"a")
    assert key("GET", None) == key("GET", b"")


def test_phases_expectation_is_what_the_fit_says():
    f = prefill.fit(traffic(40, cached=False))
    e = f.expect(10_000, 0)
    assert isinstance(e, phases.Expectation) and e.prompt_ms == pytest.approx(e.ms_per_1k * 10, abs=1)
