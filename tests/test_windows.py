"""Context windows (pure): only exact model ids are known, the providers' refusals in their
own words teach a window, and what one relay process learns every other on the log reads."""

from __future__ import annotations

import orjson
import pytest

from ttft_relay import apis
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


def test_a_learned_window_comes_first_in_the_providers_tokens_scaled_to_the_relays():
    learned = Learned("api.anthropic.com", "claude-opus-4-6", max_input=150_000, window=None, ratio=0.8, ts=0)
    budget = budget_for("claude-opus-4-6", 64_000, windows=ANTHROPIC, learned=learned)
    assert budget == Budget(int(150_000 / 0.8 * windows.LEARNED_MARGIN), windows.LEARNED, 150_000)
    # OpenAI names the window of prompt and answer together: the reserve comes off it
    learned = Learned("api.openai.com", "gpt-5.5", max_input=None, window=258_000, ratio=1.0, ts=0)
    assert budget_for("gpt-5.5", 8_000, windows=OPENAI, learned=learned).tokens == int(250_000 * windows.LEARNED_MARGIN)
    assert budget_for("gpt-5.5", 8_000, windows=OPENAI, learned=learned, user_max=1000) == Budget(1000, windows.USER)


# --- the providers' refusals, as they word them ----------------------------------------------


def body(obj) -> bytes:
    return orjson.dumps(obj)


def test_openai_chat_names_the_window():
    refusal = OPENAI.too_long(400, body(sse_samples.too_long_body(apis.OPENAI_CHAT, 130_012, 128_000)))
    assert refusal == TooLong(max_input=None, window=128_000, prompt_tokens=130_012, output_tokens=None)
    requested = {"error": {"message": "This model's maximum context length is 4097 tokens. However, you requested "
                                      "4130 tokens (3130 in the messages, 1000 in the completion). Please reduce the "
                                      "length of the messages or completion.", "type": "invalid_request_error",
                           "param": "messages", "code": "context_length_exceeded"}}  # fmt: skip
    assert OPENAI.too_long(400, body(requested)) == TooLong(None, 4097, 3130, 1000)


def test_the_responses_api_refuses_without_a_limit():
    refusal = OPENAI.too_long(400, body(sse_samples.too_long_body(apis.OPENAI_RESPONSES, 300_000, 272_000)))
    assert refusal is not None and not refusal.limit_given
    assert windows.learned_from("api.openai.com", "gpt-5.5", refusal, 290_000) is None


def test_anthropic_names_the_prompts_maximum_or_the_window_with_max_tokens():
    refusal = ANTHROPIC.too_long(400, body(sse_samples.too_long_body(apis.ANTHROPIC_MESSAGES, 219_898, 200_000)))
    assert refusal == TooLong(max_input=200_000, window=None, prompt_tokens=219_898, output_tokens=None)
    with_output = {"type": "error", "error": {"type": "invalid_request_error", "message":
                   "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000, decrease input "
                   "length or `max_tokens` and try again"}}  # fmt: skip
    assert ANTHROPIC.too_long(400, body(with_output)) == TooLong(None, 200_000, 188_240, 21_333)


def test_gemini_names_the_maximum_with_or_without_the_count():
    refusal = GEMINI.too_long(400, body(sse_samples.too_long_body(apis.GEMINI, 1_200_293, 1_048_576)))
    assert refusal == TooLong(max_input=1_048_576, window=None, prompt_tokens=1_200_293, output_tokens=None)
    bare = [{"error": {"code": 400, "message": "The input token count exceeds the maximum number of tokens "
                                               "allowed (1048576).", "status": "INVALID_ARGUMENT"}}]
    assert GEMINI.too_long(400, body(bare)) == TooLong(1_048_576, None, None, None)


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


def test_the_ratio_between_the_providers_count_and_the_relays():
    refusal = TooLong(max_input=200_000, window=None, prompt_tokens=219_898, output_tokens=None)
    learned = windows.learned_from("h", "Claude-Opus-5-5", refusal, 250_000)
    assert learned.model == "claude-opus-5-5" and learned.ratio == round(219_898 / 250_000, 4)
    assert windows.learned_from("h", "m", TooLong(200_000, None, None, None), 250_000).ratio == 1.0


# --- shared by the processes on one log ------------------------------------------------------


def learned(model: str, limit: int) -> Learned:
    return Learned("api.anthropic.com", model, max_input=limit, window=None, ratio=1.0, ts=1.0)


def test_what_one_process_learns_the_others_read(tmp_path):
    path = tmp_path / windows.FILE_NAME
    worker1, worker2 = LearnedWindows(path), LearnedWindows(path)
    assert worker2.get("api.anthropic.com", "claude-opus-5-5") is None
    worker1.learn(learned("claude-opus-5-5", 200_000))
    assert worker2.get("api.anthropic.com", "claude-opus-5-5").max_input == 200_000
    worker2.learn(learned("claude-opus-5-5", 180_000))  # newer word wins, in every process
    assert worker1.get("api.anthropic.com", "CLAUDE-OPUS-5-5").max_input == 180_000
    assert worker1.get("other.host", "claude-opus-5-5") is None  # per upstream
    restarted = LearnedWindows(path)
    restarted.refresh()
    assert len(restarted) == 1 and restarted.get("api.anthropic.com", "claude-opus-5-5").max_input == 180_000


def test_a_line_being_written_bad_lines_and_a_replaced_file(tmp_path):
    path = tmp_path / windows.FILE_NAME
    line = orjson.dumps({"upstream": "h", "model": "a", "max_input": 100, "window": None, "ratio": 1.0, "ts": 1.0})
    b_line = line.replace(b'"a"', b'"b"')
    path.write_bytes(b"garbage\n" + b'{"upstream": "h"}\n' + line.replace(b"100", b"-1") + b"\n" + line + b"\n"
                     + b_line[:-5])  # the last line still being appended
    store = LearnedWindows(path)
    assert store.get("h", "a").max_input == 100 and store.get("h", "b") is None
    with open(path, "ab") as f:
        f.write(b_line[-5:] + b"\n")
    assert store.get("h", "b").max_input == 100
    path.unlink()
    path.write_bytes(line.replace(b'"a"', b'"c"') + b"\n")  # replaced (rotated away, written anew)
    assert store.get("h", "c").max_input == 100


def test_without_a_file_it_learns_in_memory(tmp_path):
    store = LearnedWindows(None)
    store.learn(learned("x", 5))
    assert store.get("api.anthropic.com", "x").max_input == 5


def test_a_file_it_cannot_write_is_said_once_and_the_window_kept(tmp_path, caplog):
    store = LearnedWindows(tmp_path / "missing-dir" / windows.FILE_NAME)
    store.learn(learned("x", 5))
    assert store.get("api.anthropic.com", "x").max_input == 5
    assert "cannot keep the learned window" in caplog.text
