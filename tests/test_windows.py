"""Context windows (pure): only exact model ids are known, the providers' refusals in their
own words teach a window, and what one relay process learns every other on the log reads."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from ttft_relay import apis, store
from ttft_relay.apis.api import TooLong
from ttft_relay.trim import windows
from ttft_relay.trim.windows import Budget, Learned, LearnedWindows, budget_for
from ttft_relay.testing import sse_samples

OPENAI = apis.get(apis.OPENAI_CHAT).windows
ANTHROPIC = apis.get(apis.ANTHROPIC_MESSAGES).windows
GEMINI = apis.get(apis.GEMINI).windows

IN_USE = (
    "claude-opus-4-6", "claude-opus-4-5-20251101", "claude-opus-4-1-20250805", "claude-opus-4-20250514",
    "claude-sonnet-4-5-20250929", "claude-sonnet-4-20250514", "claude-haiku-4-5-20251001",
    "claude-3-7-sonnet-latest", "claude-3-5-haiku-latest",
    "gpt-5", "gpt-5-mini", "gpt-5-nano", "gpt-5-codex", "gpt-5-chat-latest", "gpt-5-pro",
    "gpt-5.1", "gpt-5.1-codex", "gpt-5.1-codex-max", "gpt-5.1-codex-mini", "gpt-5.2", "gpt-5.2-codex",
    "gpt-4.1", "gpt-4.1-mini", "gpt-4o", "gpt-4o-mini", "codex-mini-latest", "gpt-oss-120b",
    "o1", "o3", "o3-mini", "o3-pro", "o4-mini",
)  # fmt: skip


def test_the_models_in_use_are_known_by_their_exact_ids():
    missing = [m for m in IN_USE if (OPENAI.window(m) or ANTHROPIC.window(m)) is None]
    assert missing == []
    assert OPENAI.window("gpt-4o-2024-08-06") == 128_000  # a dated snapshot is the model
    assert OPENAI.window("openai/gpt-4o") == 128_000  # a routing prefix is not part of the id
    assert ANTHROPIC.window("claude-sonnet-4-5") == 200_000


@pytest.mark.parametrize("model", ["claude-opus-5-5", "claude-sonnet-4-7", "claude-", "gpt-5.5", "gpt-5.1-nova",
                                   "gpt-4o-realtime-2", "o5", "llama-3", "", None])
def test_a_new_model_of_a_known_family_is_unknown(model):
    assert OPENAI.window(model) is None and ANTHROPIC.window(model) is None
    assert budget_for(model, 128_000, windows=ANTHROPIC) is None
    assert budget_for(model, None, windows=OPENAI, user_max=20_000) == Budget(20_000, windows.USER)


def test_budget_window_minus_reserved_output():
    assert budget_for("gpt-4o-2024-08-06", 1000, windows=OPENAI) == Budget(127_000, windows.KNOWN, 128_000)
    assert budget_for("gpt-4.1-mini", 1, windows=OPENAI).tokens == 1_047_575
    assert budget_for("gpt-4o", None, windows=OPENAI).tokens == 128_000 - 4096
    assert budget_for("gpt-4", 10_000, windows=OPENAI).tokens == 0
    assert budget_for("gpt-5.1-codex", None, windows=OPENAI).tokens == 272_000  # its input limit
    assert budget_for("claude-opus-4-6", 64_000, windows=ANTHROPIC).tokens == 136_000
    assert budget_for("gpt-4o", None, windows=OPENAI, user_max=32_000) == Budget(32_000, windows.USER)


def test_the_long_context_header_opens_1m_only_for_the_models_it_opens_it_for():
    assert budget_for("claude-sonnet-4-5", 64_000, windows=ANTHROPIC, long_context=True).tokens == 936_000
    assert budget_for("claude-haiku-4-5", 64_000, windows=ANTHROPIC, long_context=True).tokens == 136_000
    assert budget_for("claude-opus-5-5", 64_000, windows=ANTHROPIC, long_context=True) is None


def test_configured_windows_come_before_known_ones_and_0_makes_a_model_unknown():
    configured = windows.parse_context_windows(["llama-3=8192", " GPT-4o-mini = 64000", "claude-=0"])
    assert budget_for("llama-3.1-70b", 192, windows=OPENAI, configured=configured) == Budget(8000, windows.CONFIGURED, 8192)
    assert budget_for("gpt-4o-mini", 0, windows=OPENAI, configured=configured).tokens == 64000 - 4096
    assert budget_for("claude-opus-4-6", 1000, windows=ANTHROPIC, configured=configured) is None
    for bad in ["llama", "=5", "x=", "x=-1", "x=1k"]:
        with pytest.raises(ValueError):
            windows.parse_context_windows([bad])


def entry(model: str, *, max_input: int | None = None, window: int | None = None, ratio: float = 1.0,
          upstream: str = "api.anthropic.com", key: str = "k1", confirmed: str | None = None) -> Learned:
    return Learned(upstream, model, max_input, window, ratio, ts=1.0, status=400, error="invalid_request_error",
                   key=key, confirmed=confirmed)


def test_a_learned_window_comes_before_the_known_one_in_the_providers_tokens_scaled_to_the_relays():
    learned = entry("claude-opus-4-6", max_input=150_000, ratio=0.8)
    budget = budget_for("claude-opus-4-6", 64_000, windows=ANTHROPIC, learned=learned)
    assert budget == Budget(int(150_000 / 0.8 * windows.LEARNED_MARGIN), windows.LEARNED, 150_000)
    # OpenAI names the window of prompt and answer together: the reserve comes off it
    learned = entry("gpt-5.5", window=258_000, upstream="api.openai.com")
    assert budget_for("gpt-5.5", 8_000, windows=OPENAI, learned=learned).tokens == int(250_000 * windows.LEARNED_MARGIN)
    assert budget_for("gpt-5.5", 8_000, windows=OPENAI, learned=learned, user_max=1000) == Budget(1000, windows.USER)


def test_the_operators_window_wins_over_a_learned_one_above_or_below_it():
    configured = windows.parse_context_windows(["claude-opus-5=300000", "acme-=0"])
    for limit in (250_000, 5_000_000):
        learned = entry("claude-opus-5-5", max_input=limit)
        assert budget_for("claude-opus-5-5", 0, windows=ANTHROPIC, configured=configured, learned=learned) == Budget(
            300_000 - 4096, windows.CONFIGURED, 300_000)
    # 0: the table's window is switched off, what the provider said still counts
    assert budget_for("acme-1", 0, windows=ANTHROPIC, configured=configured,
                      learned=entry("acme-1", max_input=50_000)).source == windows.LEARNED


# --- the providers' refusals, as they word them ----------------------------------------------


def body(obj) -> bytes:
    return orjson.dumps(obj)


def test_openai_chat_names_the_window():
    refusal = OPENAI.too_long(400, body(sse_samples.too_long_body(apis.OPENAI_CHAT, 130_012, 128_000)))
    assert refusal == TooLong(max_input=None, window=128_000, prompt_tokens=130_012, output_tokens=None,
                              kind="context_length_exceeded")
    requested = {"error": {"message": "This model's maximum context length is 4097 tokens. However, you requested "
                                      "4130 tokens (3130 in the messages, 1000 in the completion). Please reduce the "
                                      "length of the messages or completion.", "type": "invalid_request_error",
                           "param": "messages", "code": "context_length_exceeded"}}  # fmt: skip
    assert OPENAI.too_long(400, body(requested)) == TooLong(None, 4097, 3130, 1000, "context_length_exceeded")


def test_the_responses_api_refuses_without_a_limit():
    refusal = OPENAI.too_long(400, body(sse_samples.too_long_body(apis.OPENAI_RESPONSES, 300_000, 272_000)))
    assert refusal is not None and not refusal.limit_given
    assert judge(refusal, "gpt-5.5", 290_000) == "it names no limit"


def test_anthropic_names_the_prompts_maximum_or_the_window_with_max_tokens():
    refusal = ANTHROPIC.too_long(400, body(sse_samples.too_long_body(apis.ANTHROPIC_MESSAGES, 219_898, 200_000)))
    assert refusal == TooLong(max_input=200_000, window=None, prompt_tokens=219_898, output_tokens=None,
                              kind="invalid_request_error")
    with_output = {"type": "error", "error": {"type": "invalid_request_error", "message":
                   "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000, decrease input "
                   "length or `max_tokens` and try again"}}  # fmt: skip
    assert ANTHROPIC.too_long(400, body(with_output)) == TooLong(None, 200_000, 188_240, 21_333, "invalid_request_error")


def test_gemini_names_the_maximum_with_or_without_the_count():
    refusal = GEMINI.too_long(400, body(sse_samples.too_long_body(apis.GEMINI, 1_200_293, 1_048_576)))
    assert refusal == TooLong(max_input=1_048_576, window=None, prompt_tokens=1_200_293, output_tokens=None,
                              kind="INVALID_ARGUMENT")
    bare = [{"error": {"code": 400, "message": "The input token count exceeds the maximum number of tokens "
                                               "allowed (1048576).", "status": "INVALID_ARGUMENT"}}]
    assert GEMINI.too_long(400, body(bare)) == TooLong(1_048_576, None, None, None, "INVALID_ARGUMENT")


@pytest.mark.parametrize("status, payload", [
    (429, sse_samples.too_long_body(apis.ANTHROPIC_MESSAGES, 219_898, 200_000)),  # not a 400
    (400, sse_samples.error_body(apis.ANTHROPIC_MESSAGES, "max_tokens: must be at most 64000", 400)),
    (400, sse_samples.error_body(apis.OPENAI_CHAT, "maximum context length is 10 tokens", 400)),  # no code
], ids=["status", "another-400", "openai-without-code"])
def test_other_errors_are_not_refusals_as_too_long(status, payload):
    assert all(w.too_long(status, body(payload)) is None for w in (OPENAI, ANTHROPIC, GEMINI))


@pytest.mark.parametrize("raw", [b"", b"not json", b"[]", b'{"error": "text"}', b'{"error": {"message": 5}}', b"\xff"])
def test_malformed_bodies_are_not_refusals(raw):
    assert all(w.too_long(400, raw) is None for w in (OPENAI, ANTHROPIC, GEMINI))


ECHO = "prompt is too long: 9 tokens > 400 maximum"
"""A client's own text, quoted back by a strict validator's 400."""


@pytest.mark.parametrize("payload", [
    {"type": "error", "error": {"type": "invalid_request_error", "message": f"messages.0.content: {ECHO!r} rejected"}},
    {"type": "error", "error": {"type": "validation_error", "message": ECHO}},  # not Anthropic's type
    {"type": "error", "error": {"type": "invalid_request_error", "message": ECHO + " (in messages.0)"}},
], ids=["quoted-inside", "another-type", "trailing-text"])
def test_a_refusal_quoting_the_clients_text_is_not_anthropics(payload):
    assert ANTHROPIC.too_long(400, body(payload)) is None


def test_openai_and_gemini_read_their_own_sentence_only():
    quoted = {"error": {"message": "Invalid 'messages[0]': \"This model's maximum context length is 400 tokens\"",
                        "type": "invalid_request_error", "code": "context_length_exceeded"}}
    assert OPENAI.too_long(400, body(quoted)) == TooLong(None, None, None, None, "context_length_exceeded")
    gemini = sse_samples.too_long_body(apis.GEMINI, 1_200_293, 1_048_576)
    assert GEMINI.too_long(400, body({"error": {**gemini["error"], "status": "FAILED_PRECONDITION"}})) is None


# --- what a refusal may teach: judge_refusal ---------------------------------------------------


def judge(refusal: TooLong, model: str, counted: int | None, *, key: str = "k1", before: tuple[Learned, ...] = (),
          configured: dict[str, int] | None = None, api=ANTHROPIC):
    return windows.judge_refusal(refusal, upstream="api.anthropic.com", model=model, status=400, counted=counted,
                                 key=key, before=before, windows=api, configured=configured or {}, now=5.0)


def anthropic_refusal(prompt: int | None, limit: int) -> TooLong:
    return TooLong(limit, None, prompt, None, "invalid_request_error")


def test_a_genuine_refusal_teaches_its_limit_with_where_it_came_from():
    learned = judge(anthropic_refusal(219_898, 200_000), "Claude-Opus-5-5", 215_000)
    assert learned == Learned("api.anthropic.com", "Claude-Opus-5-5", 200_000, None, round(219_898 / 215_000, 4),
                              ts=5.0, status=400, error="invalid_request_error", key="k1", confirmed=None)
    assert learned.usable_by("k1") and not learned.usable_by("k2")
    # no count of its own from the provider: the relay's count must be near the limit
    assert judge(anthropic_refusal(None, 60_000), "acme-1", 61_000).ratio == 1.0


@pytest.mark.parametrize("refusal, model, counted, why", [
    (anthropic_refusal(9, 400), "acme-1", 60, "outside"),  # the echoed limit
    (anthropic_refusal(9, 40_000), "acme-1", 60, "not over its limit"),  # the provider's count under its limit
    (anthropic_refusal(50_000, 40_000), "acme-1", 60, "not the refused request"),  # the relay counted 60
    (anthropic_refusal(None, 40_000), "acme-1", 60, "far below"),
    (anthropic_refusal(None, 50), "acme-1", 100, "outside"),  # a silly small limit
    (anthropic_refusal(2 * 10**8, 10**8 + 1), "acme-1", 2, "outside"),  # a huge one
    (anthropic_refusal(10**8, 9_000_000), "acme-1", 1, "not the refused request"),  # a ratio of 1e8
    (anthropic_refusal(61_000, 60_000), "claude-opus-5-5", 60_000, "below 200000, the smallest window"),
    (anthropic_refusal(61_000, 60_000), "Evil-Tenant/CLAUDE-SONNET-4-5", 60_000, "smallest window"),
    (anthropic_refusal(61_000, 60_000), "acme-1", None, "no count"),
    (anthropic_refusal(61_000, 60_000), "acme-" + "1" * 300, 60_000, "longer than 256"),
], ids=["echo", "incoherent", "ratio", "far-below", "small", "huge", "ratio-1e8", "family", "alias-family",
        "uncounted", "long-name"])
def test_what_a_refusal_does_not_teach_and_why(refusal, model, counted, why):
    assert why in judge(refusal, model, counted)


def test_the_operators_window_is_never_overruled_by_a_refusal():
    assert "the operator's word stands" in judge(anthropic_refusal(61_000, 60_000), "acme-1", 60_000,
                                                 configured={"acme-": 80_000})


def test_openai_names_the_window_of_prompt_and_answer_together():
    refusal = TooLong(None, 128_000, 121_000, 8_000, "context_length_exceeded")
    learned = judge(refusal, "gpt-4o-fork", 120_000, api=OPENAI)  # the gpt-4o family's smallest: 128000
    assert isinstance(learned, Learned) and learned.window == 128_000 and learned.limit == 128_000
    assert "smallest window" in judge(TooLong(None, 32_000, 33_000, None, "x"), "gpt-5.5", 33_000, api=OPENAI)


def test_a_window_is_confirmed_by_another_keys_refusal_not_the_same_keys():
    first = judge(anthropic_refusal(61_000, 60_000), "acme-1", 60_000, key="k1")
    assert judge(anthropic_refusal(62_000, 60_000), "acme-1", 61_000, key="k1", before=(first,)) is first
    confirmed = judge(anthropic_refusal(62_000, 60_000), "acme-1", 61_000, key="k2", before=(first,))
    assert confirmed.confirmed == "k2" and confirmed.key == "k1" and confirmed.usable_by("k3")
    assert judge(anthropic_refusal(62_000, 60_000), "acme-1", 61_000, key="k3", before=(confirmed,)) is confirmed
    # another limit from another key: the new word, for that key until confirmed
    other = judge(anthropic_refusal(52_000, 50_000), "acme-1", 51_000, key="k3", before=(confirmed,))
    assert other.limit == 50_000 and other.key == "k3" and other.confirmed is None
    # ... and confirmed by a fourth key's refusal naming it
    assert judge(anthropic_refusal(52_000, 50_000), "acme-1", 51_000, key="k4",
                 before=(confirmed, other)).confirmed == "k4"


def test_an_accepted_request_confirms_or_refutes_an_unconfirmed_window():
    pending = entry("acme-1", max_input=100_000, ratio=1.1)
    old = Budget(60_000, windows.KNOWN, 64_000)
    assert windows.judge_accepted(pending, 100_000, old, 5.0) is None  # the provider took 110k: refuted
    assert windows.judge_accepted(pending, 80_000, old, 5.0).confirmed == windows.ACCEPTED  # the old one cut it
    assert windows.judge_accepted(pending, 50_000, old, 5.0) == "nothing to confirm"
    assert windows.judge_accepted(pending, 80_000, None, 5.0) == "nothing to confirm"
    confirmed = entry("acme-1", max_input=100_000, confirmed="k2")
    assert windows.judge_accepted(confirmed, 500_000, old, 5.0) == "already confirmed"


def test_a_family_is_the_longest_prefix_a_known_id_shares():
    assert windows.family_floor(ANTHROPIC, "claude-opus-5-5") == 200_000
    assert windows.family_floor(OPENAI, "gpt-5.5") == 128_000  # gpt-5-chat-latest
    assert windows.family_floor(OPENAI, "gpt-4o-2099-01-01") == 128_000
    assert windows.family_floor(OPENAI, "acme-1") is None and windows.family_floor(GEMINI, "gemini-9") is None


# --- shared by the processes on one log ------------------------------------------------------


def test_what_one_process_learns_the_others_read(tmp_path):
    path = tmp_path / store.FILE_NAME
    worker1, worker2 = LearnedWindows(path), LearnedWindows(path)
    assert worker2.get("api.anthropic.com", "claude-opus-5-5", "k1") is None
    worker1.keep(entry("claude-opus-5-5", max_input=200_000))
    worker2.refresh()
    assert worker2.get("api.anthropic.com", "claude-opus-5-5", "k1").max_input == 200_000
    assert worker2.get("api.anthropic.com", "claude-opus-5-5", "k2") is None  # not confirmed: k1's only
    worker2.keep(entry("claude-opus-5-5", max_input=200_000, confirmed="k2"))  # confirmed, in every process
    worker1.refresh()
    assert worker1.get("api.anthropic.com", "claude-opus-5-5", "k9").max_input == 200_000
    # a key's own word stays its own: the others keep the confirmed one
    worker1.keep(entry("claude-opus-5-5", max_input=150_000, key="k7"))
    worker2.refresh()
    assert worker2.get("api.anthropic.com", "claude-opus-5-5", "k7").max_input == 150_000
    assert worker2.get("api.anthropic.com", "claude-opus-5-5", "k9").max_input == 200_000
    assert len(worker2.held("api.anthropic.com", "claude-opus-5-5")) == 2
    worker2.forget(entry("claude-opus-5-5", max_input=150_000, key="k7"))
    worker1.keep(entry("claude-opus-5-5", max_input=180_000, confirmed="k2"))  # newer word wins, everywhere
    worker1.refresh()
    assert worker1.get("api.anthropic.com", "claude-opus-5-5", "k7").max_input == 180_000
    assert worker1.get("api.anthropic.com", "CLAUDE-OPUS-5-5", "k9") is None  # the exact name only
    assert worker1.get("other.host", "claude-opus-5-5", "k9") is None  # per upstream
    restarted = LearnedWindows(path)
    restarted.refresh()
    assert len(restarted) == 1 and restarted.get("api.anthropic.com", "claude-opus-5-5", "k9").max_input == 180_000
    assert len(path.read_bytes().splitlines()) == 1  # one current entry per key
    worker1.forget(restarted.get("api.anthropic.com", "claude-opus-5-5", "k9"))
    worker2.refresh()
    assert len(worker2) == 0


def test_bad_entries_and_a_replaced_file(tmp_path):
    path = tmp_path / store.FILE_NAME
    good = windows._entry(entry("a", max_input=100_000))
    bad = [dataclasses.replace(good, value={**good.value, "max_input": value}) for value in (-1, 50, "x", None)]
    bad += [dataclasses.replace(good, key='["api.anthropic.com", "a", "k9"]'),  # not the slot its window says
            dataclasses.replace(good, value={**good.value, "ratio": 1e8}),
            dataclasses.replace(good, value=[1]), dataclasses.replace(good, key="not json")]
    path.write_bytes(b"".join(e.encode() + b"\n" for e in [*bad, good]))
    learned = LearnedWindows(path)
    learned.refresh()
    assert len(learned) == 1 and learned.get("api.anthropic.com", "a", "k1").max_input == 100_000
    path.unlink()
    path.write_bytes(windows._entry(entry("c", max_input=100_000)).encode() + b"\n")  # replaced (written anew)
    learned.refresh()
    assert learned.get("api.anthropic.com", "c", "k1").max_input == 100_000 and len(learned) == 1


def test_the_file_stays_bounded_and_the_unconfirmed_go_first(tmp_path, monkeypatch):
    monkeypatch.setattr(windows, "KIND", dataclasses.replace(windows.KIND, max_entries=20))
    path = tmp_path / store.FILE_NAME
    learned = LearnedWindows(path)
    learned.keep(entry("confirmed", max_input=100_000, confirmed="k2"))
    for i in range(50):
        learned.keep(entry(f"m{i}", max_input=100_000))
    assert len(learned) == 20 and len(path.read_bytes().splitlines()) == 20
    assert learned.held("api.anthropic.com", "m0") == []  # the least recently used unconfirmed went first
    assert learned.held("api.anthropic.com", "confirmed") != []


def test_the_previous_versions_file_is_read_once(tmp_path):
    old = tmp_path / windows.LEGACY_FILE
    kept = [entry("a", max_input=100_000), entry("b", window=64_000, confirmed="k2")]
    old.write_bytes(b"garbage\n" + b"".join(orjson.dumps(dataclasses.asdict(w)) + b"\n" for w in kept))
    learned = LearnedWindows(tmp_path / store.FILE_NAME)
    learned.refresh()
    assert sorted(learned.entries(), key=lambda w: w.model) == kept
    learned.forget(kept[0])
    restarted = LearnedWindows(tmp_path / store.FILE_NAME)
    restarted.refresh()
    assert restarted.entries() == [kept[1]]  # read once: what was forgotten since stays forgotten


def test_without_a_file_it_learns_in_memory(tmp_path):
    learned = LearnedWindows(None)
    learned.keep(entry("x", max_input=5_000))
    assert learned.get("api.anthropic.com", "x", "k1").max_input == 5_000


def test_a_file_it_cannot_write_is_said_once_and_the_window_kept(tmp_path, caplog):
    learned = LearnedWindows(tmp_path / "missing-dir" / store.FILE_NAME)
    learned.keep(entry("x", max_input=5_000))
    learned.keep(entry("y", max_input=5_000))
    assert learned.get("api.anthropic.com", "x", "k1").max_input == 5_000
    assert caplog.text.count("this process alone knows it") == 1


def test_get_and_held_read_memory_only(tmp_path):
    # What the event loop calls never touches the file: only refresh/keep/forget do (off the loop).
    path = tmp_path / store.FILE_NAME
    learned = LearnedWindows(path)
    learned.keep(entry("a", max_input=100_000))
    path.unlink()
    assert learned.get("api.anthropic.com", "a", "k1").max_input == 100_000
    assert [w.max_input for w in learned.held("api.anthropic.com", "a")] == [100_000]
    learned.refresh()
    assert learned.get("api.anthropic.com", "a", "k1") is None
