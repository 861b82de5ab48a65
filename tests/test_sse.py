"""SSE parser and stream watcher: spec rules, chunking invariance, per-API marks, usage, errors, fuzz.

Times fed to the watcher are made-up numbers (event index or byte offset), never
the clock: what is checked is which chunk a mark lands on.
"""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from ttft_relay import apis
from ttft_relay.apis import reader
from ttft_relay.stream import sse
from ttft_relay.stream.sse import Event
from ttft_relay.stream.sse import SSEParser
from ttft_relay.stream.sse import StreamWatcher
from ttft_relay.testing import sse_samples as samples

TOOL = ("get_weather", ['{"city"', ':"Par', 'is"}'])
APIS = ("openai.chat", "openai.responses", "anthropic.messages", "gemini", "other")


def parse(*chunks: bytes, **kwargs) -> list[Event]:
    parser = SSEParser(**kwargs)
    return [event for chunk in chunks for event in parser.feed(chunk)]


def split_at(body: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(body)]
    return [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


# --- parser: the WHATWG rules ---------------------------------------------------------


class TestParserRules:
    def test_multiline_data_is_joined_with_lf(self):
        assert parse(b"data: a\ndata:b\ndata:  c\n\n") == [Event("", b"a\nb\n c")]

    def test_event_field_and_reset_after_dispatch(self):
        assert parse(b"event: delta\ndata: 1\n\ndata: 2\n\n") == [Event("delta", b"1"), Event("", b"2")]

    def test_line_ends_lf_crlf_cr_mixed(self):
        body = b"data: a\r\n\r\ndata: b\r\rdata: c\n\ndata: d\r\n\n"
        assert [e.data for e in parse(body)] == [b"a", b"b", b"c", b"d"]

    def test_crlf_split_across_chunks_is_one_line_end(self):
        # Were the LF read as a second line end, "data: a" would be dispatched alone and "b" lost in a new event.
        assert parse(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == [Event("", b"a\nb")]

    def test_comments_and_unknown_fields_are_ignored(self):
        body = b": keep-alive\nid: 7\nretry: 1000\nfoo: bar\ndata: x\n\n:\n\n"
        assert parse(body) == [Event("", b"x")]

    def test_field_without_colon(self):
        assert parse(b"data\n\n") == [Event("", b"")]
        assert parse(b"event: x\nevent\ndata: 1\n\n") == [Event("", b"1")]

    def test_only_one_space_after_colon_is_dropped(self):
        assert parse(b"data:  two\n\nevent:x\ndata:\n\n") == [Event("", b" two"), Event("x", b"")]

    def test_event_without_data_is_not_dispatched(self):
        assert parse(b"event: ping\n\ndata: 1\n\n") == [Event("", b"1")]

    def test_unterminated_last_event_is_not_dispatched(self):
        assert parse(b"data: 1\n\ndata: 2\n") == [Event("", b"1")]

    def test_bom_is_skipped_at_start_only_even_when_split(self):
        bom = b"\xef\xbb\xbf"
        assert parse(bom + b"data: 1\n\n") == [Event("", b"1")]
        assert parse(bom[:1], bom[1:2], bom[2:] + b"data: 1\n\n") == [Event("", b"1")]
        assert parse(b"\xef", b"\xbbdata: 1\n\ndata: 2\n\n") == [Event("", b"2")]  # not a BOM: a bad field name
        # A second BOM is part of the field name, so that line is ignored.
        assert parse(bom + b"data: 1\n\n" + bom + b"data: 2\n\n") == [Event("", b"1")]

    def test_utf8_split_inside_a_character(self):
        text = "héllo 世界 🙂".encode()
        body = b"data: " + text + b"\n\n"
        assert parse(*(body[i : i + 1] for i in range(len(body)))) == [Event("", text)]

    def test_invalid_utf8_is_passed_as_bytes(self):
        assert parse(b"event: \xff\ndata: \xfe\xff\n\n") == [Event("\ufffd", b"\xfe\xff")]


class TestParserBounds:
    def test_overlong_line_is_truncated_and_memory_bounded(self):
        parser = SSEParser(max_event_bytes=64)
        events = parser.feed(b"data: ")
        for _ in range(1000):
            events += parser.feed(b"x" * 1000)
            assert len(parser._line) <= 64  # the pending line, the only buffer that grows with input
        events += parser.feed(b"\n\ndata: next\n\n")
        assert events[0].truncated and events[0].data == b"x" * 58
        assert events[1] == Event("", b"next")

    def test_many_data_lines_are_bounded(self):
        parser = SSEParser(max_event_bytes=100)
        for _ in range(1000):
            parser.feed(b"data: 0123456789\n")
        assert parser._size <= 100 + 11 and len(parser._data) <= 10
        (event,) = parser.feed(b"\n")
        assert event.truncated and len(event.data) <= 100

    def test_overlong_comment_does_not_mark_the_next_event(self):
        # The comment's line overflows while it waits for its end, in an event that then has no data.
        assert parse(b": " + b"x" * 100, b"\n\ndata: 1\n\n", max_event_bytes=64) == [Event("", b"1")]

    def test_event_at_the_cap_is_whole(self):
        assert parse(b"data: " + b"x" * 64 + b"\n\n", max_event_bytes=64) == [Event("", b"x" * 64)]


# --- parser: chunking invariance ------------------------------------------------------

ALL_SAMPLES = {
    "openai.chat": samples.openai_chat_stream(["Hel", "lo", " wörld"], reasoning=["hm"], tool_call=TOOL),
    "openai.responses": samples.responses_stream(["Hel", "lo", " wörld"], reasoning=["hm"], tool_call=TOOL),
    "anthropic.messages": samples.anthropic_stream(["Hel", "lo", " wörld"], thinking=["hm"], tool_call=TOOL),
    "gemini": samples.gemini_stream(["Hel", "lo", " wörld"]),
}


@pytest.mark.parametrize("api", ALL_SAMPLES)
def test_parser_every_split_point_gives_the_same_events(api):
    body = b"".join(ALL_SAMPLES[api])
    whole = parse(body)
    assert len(whole) == len(ALL_SAMPLES[api])
    for k in range(len(body) + 1):
        assert parse(body[:k], body[k:]) == whole, k
    assert parse(*(body[i : i + 1] for i in range(len(body)))) == whole


@given(body=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=20))
def test_parser_chunking_never_changes_events_of_any_bytes(body, cuts):
    assert parse(*split_at(body, cuts)) == parse(body)


@given(
    pieces=st.lists(st.sampled_from([b"data:", b"data: ", b"event: e", b": c", b"x", b"\xc3\xa9", b"\r", b"\n", b"\r\n"]), max_size=60),
    cuts=st.lists(st.integers(0, 300), max_size=30),
)
def test_parser_chunking_never_changes_events_of_sse_like_bytes(pieces, cuts):
    body = b"".join(pieces)
    assert parse(*split_at(body, cuts)) == parse(body)


# --- watcher: marks per API -------------------------------------------------------------


def watch(api: str, chunks: list[bytes], times: list[float] | None = None) -> StreamWatcher:
    watcher = StreamWatcher(apis.get(api))
    for i, chunk in enumerate(chunks):
        watcher.feed(chunk, float(i) if times is None else times[i])
    watcher.feed(b"", 1e9)  # the end-of-message call mitmproxy makes: not a chunk
    return watcher


def outcome(w: StreamWatcher) -> tuple:
    return w.token_events, w.events, w.done, w.error, w.usage


# (api, stream, index of first token event, index of last token event, token events)
MARK_CASES = [
    # role chunk (0) is not a token; reasoning (1), 3 text, tool call head + 3 arg pieces are; finish, usage, [DONE] are not
    ("openai.chat", ALL_SAMPLES["openai.chat"], 1, 8, 8),
    # created, in_progress, item added, summary part added (0-3), summary delta (4), ..., 3 text deltas (10-12), ...,
    # 3 function argument deltas (17-19), arguments done, item done, completed
    ("openai.responses", ALL_SAMPLES["openai.responses"], 4, 19, 7),
    # message_start, thinking block start (0-1), thinking delta (2), signature (3) no, ..., 3 input_json deltas
    ("anthropic.messages", ALL_SAMPLES["anthropic.messages"], 2, 14, 7),
    ("gemini", ALL_SAMPLES["gemini"], 0, 2, 3),
]


@pytest.mark.parametrize("api,stream,first,last,count", MARK_CASES)
def test_marks_one_event_per_chunk(api, stream, first, last, count):
    w = watch(api, stream)
    assert (w.first_byte, w.first_event, w.first_token, w.last_token) == (0, 0, first, last)
    assert w.token_events == count
    assert w.chunks == len(stream) and w.bytes == len(b"".join(stream))
    assert w.done and w.error is None and w.usage


def dispatch_offsets(stream: list[bytes]) -> list[int]:
    """Byte offset at which each event is complete: its blank line's first line-end byte."""
    offsets, end = [], 0
    for event in stream:
        end += len(event)
        offsets.append(end - 1 if event.endswith(b"\r\n") else end)
    return offsets


def check_chunking(api: str, stream: list[bytes], first: int, last: int, cuts: list[int]) -> None:
    """Feed the stream cut at `cuts`, each chunk stamped with the offset where it ends.

    A mark must then be the end of the first chunk that completes the event it belongs to.
    """
    body = b"".join(stream)
    chunks = split_at(body, cuts)
    ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]
    w = watch(api, chunks, [float(e) for e in ends])

    def landing(offset: int) -> float:
        return float(next(e for e in ends if e >= offset))

    offsets = dispatch_offsets(stream)
    assert w.first_byte == ends[0]
    assert w.first_event == landing(offsets[0])
    assert w.first_token == landing(offsets[first])
    assert w.last_token == landing(offsets[last])
    assert w.max_gap == max(b - a for a, b in zip([ends[0], *ends], ends))
    assert outcome(w) == outcome(watch(api, stream))


@pytest.mark.parametrize("api,stream,first,last,count", MARK_CASES)
def test_marks_at_every_split_point(api, stream, first, last, count):
    body = b"".join(stream)
    for k in range(1, len(body)):
        check_chunking(api, stream, first, last, [k])


@pytest.mark.parametrize("api,stream,first,last,count", MARK_CASES)
def test_marks_byte_by_byte(api, stream, first, last, count):
    check_chunking(api, stream, first, last, list(range(1, len(b"".join(stream)))))


@pytest.mark.parametrize("api,stream,first,last,count", MARK_CASES)
@given(data=st.data())
def test_marks_random_chunkings(api, stream, first, last, count, data):
    size = len(b"".join(stream))
    check_chunking(api, stream, first, last, data.draw(st.lists(st.integers(1, size - 1), max_size=40)))


# --- first-token rules -----------------------------------------------------------------


def chat_chunk(delta: dict, **extra) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return samples.sse_event({"id": "c", "object": "chat.completion.chunk", "choices": [choice], **extra})


def typed(type_: str, event: bool = True, **fields) -> bytes:
    return samples.sse_event({"type": type_, **fields}, type_ if event else None)


def gemini_chunk(*parts: dict) -> bytes:
    return samples.sse_event({"candidates": [{"content": {"parts": list(parts), "role": "model"}, "index": 0}]})


TOKENS = {
    "openai.chat": [
        chat_chunk({"content": "Hi"}),
        chat_chunk({"content": "\n"}),
        chat_chunk({"reasoning_content": "think"}),
        chat_chunk({"reasoning": "think"}),
        chat_chunk({"refusal": "I can't"}),
        chat_chunk({"role": "assistant", "content": None, "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}),
        samples.sse_event('{"choices": [{"index": 0, "delta": {"content": "spaced"}}]}'),
    ],
    "openai.responses": [
        typed("response.output_text.delta", delta="Hi"),
        typed("response.output_text.delta", event=False, delta="no event: line"),
        typed("response.reasoning_summary_text.delta", delta="think"),
        typed("response.reasoning_text.delta", delta="think"),
        typed("response.function_call_arguments.delta", delta="{"),
        typed("response.refusal.delta", delta="no"),
    ],
    "anthropic.messages": [
        typed("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hi"}),
        typed("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "hm"}),
        typed("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": "{\"a"}),
        typed("content_block_delta", event=False, index=0, delta={"type": "text_delta", "text": "no event: line"}),
    ],
    "gemini": [
        gemini_chunk({"text": "Hi"}),
        gemini_chunk({"text": "hm", "thought": True}),
        gemini_chunk({"functionCall": {"name": "f", "args": {}}}),
    ],
}

NOT_TOKENS = {
    "openai.chat": [
        chat_chunk({"role": "assistant", "content": "", "refusal": None}),
        chat_chunk({"content": ""}),
        chat_chunk({"content": None}),
        chat_chunk({}, usage=None),
        chat_chunk({"tool_calls": []}),
        samples.sse_event({"id": "c", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}),
        samples.sse_event("[DONE]"),
        samples.error_event("openai.chat"),
        b": OPENROUTER PROCESSING\n\n",
    ],
    "openai.responses": [
        typed("response.created", response={"id": "r", "status": "in_progress", "output": []}),
        typed("response.output_item.added", output_index=0, item={"type": "message", "content": []}),
        typed("response.content_part.added", part={"type": "output_text", "text": ""}),
        typed("response.output_text.delta", delta=""),
        typed("response.output_text.done", text="the whole text"),
        typed("response.completed", response={"usage": {"input_tokens": 1}}),
        samples.error_event("openai.responses"),
    ],
    "anthropic.messages": [
        samples.anthropic_stream([])[0],  # message_start
        typed("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        typed("ping"),
        typed("content_block_delta", index=0, delta={"type": "text_delta", "text": ""}),
        typed("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "EqQBCgIYAh"}),
        typed("content_block_delta", index=1, delta={"type": "input_json_delta", "partial_json": ""}),
        typed("content_block_start", index=1, content_block={"type": "tool_use", "id": "t", "name": "f", "input": {}}),
        typed("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 3}),
        typed("message_stop"),
        samples.error_event("anthropic.messages"),
    ],
    "gemini": [
        gemini_chunk({"text": ""}),
        gemini_chunk(),
        samples.sse_event({"candidates": [{"finishReason": "STOP", "index": 0}], "usageMetadata": {"promptTokenCount": 3}}),
        samples.error_event("gemini"),
    ],
}


def token_cases(table: dict[str, list[bytes]]) -> list[tuple[str, bytes]]:
    return [(api, event) for api, events in table.items() for event in events]


@pytest.mark.parametrize("api,event", token_cases(TOKENS))
def test_is_a_token_before_and_after_the_first(api, event):
    assert watch(api, [event]).first_token == 0
    # After a first token the watcher switches to its byte-level check: it must agree.
    assert watch(api, [TOKENS[api][0], event]).token_events == 2


@pytest.mark.parametrize("api,event", token_cases(NOT_TOKENS))
def test_is_not_a_token_before_nor_after_the_first(api, event):
    assert watch(api, [event]).first_token is None
    w = watch(api, [TOKENS[api][0], event])
    assert (w.token_events, w.last_token) == (1, 0)


def test_other_api_has_no_tokens():
    w = watch("other", [b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n", b"data: [DONE]\n\n"])
    assert (w.first_event, w.first_token, w.token_events, w.done) == (0, None, 0, True)


def test_first_event_ignores_comments_and_partial_events():
    w = watch("anthropic.messages", [b": hello\n\n", b"event: ping\ndata: {\"type\"", b":\"ping\"}\n\n"])
    assert (w.first_byte, w.first_event) == (0, 2)


def test_max_gap_is_the_longest_silence_between_chunks():
    w = watch("openai.chat", [b"data: 1\n\n"] * 4, [10.0, 10.5, 13.0, 13.2])
    assert w.max_gap == pytest.approx(2.5)


# --- usage ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "api,stream,expected",
    [
        (
            "openai.chat",
            samples.openai_chat_stream(["a", "b"], reasoning=["r"], input_tokens=100, cached_tokens=64),
            {"input_tokens": 100, "output_tokens": 3, "cached_tokens": 64, "reasoning_tokens": 1},
        ),
        (
            "openai.responses",
            samples.responses_stream(["a", "b"], reasoning=["r"], input_tokens=100, cached_tokens=64),
            {"input_tokens": 100, "output_tokens": 3, "cached_tokens": 64, "reasoning_tokens": 1},
        ),
        (
            "anthropic.messages",
            samples.anthropic_stream(["a", "b"], input_tokens=10, cache_read_tokens=64, cache_creation_tokens=26),
            {"input_tokens": 100, "output_tokens": 2, "cached_tokens": 64, "cache_creation_tokens": 26},
        ),
        (
            "gemini",
            samples.gemini_stream(["a", "b", "c"], input_tokens=100, cached_tokens=64),
            {"input_tokens": 100, "output_tokens": 3, "cached_tokens": 64},
        ),
    ],
)
def test_stream_usage(api, stream, expected):
    assert watch(api, stream).usage == expected


def test_usage_absent_or_null():
    assert watch("openai.chat", samples.openai_chat_stream(["a"], usage=False)).usage is None
    assert watch("openai.chat", [chat_chunk({"content": "a"}, usage=None)]).usage is None
    assert watch("other", samples.openai_chat_stream(["a"])).usage is None


def test_anthropic_message_delta_overrides_start_counts():
    start, *_ = samples.anthropic_stream(["a"], input_tokens=5)
    delta = typed("message_delta", delta={}, usage={"input_tokens": 7, "output_tokens": 9, "cache_read_input_tokens": None})
    assert watch("anthropic.messages", [start, delta]).usage == {
        "input_tokens": 7,
        "output_tokens": 9,
        "cached_tokens": 0,
        "cache_creation_tokens": 0,
    }


def test_gemini_thoughts_count_as_output_and_reasoning():
    chunk = samples.sse_event({"usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 2, "thoughtsTokenCount": 5}})
    assert watch("gemini", [chunk]).usage == {"input_tokens": 4, "output_tokens": 7, "reasoning_tokens": 5}


def test_usage_read_mid_stream_follows_later_events():
    stream = samples.gemini_stream(["a", "b"])
    w = StreamWatcher(apis.get(apis.GEMINI))
    w.feed(stream[0], 0.0)
    assert w.usage["output_tokens"] == 1
    w.feed(stream[1], 1.0)
    assert w.usage["output_tokens"] == 2


@pytest.mark.parametrize(
    "api,body,expected",
    [
        ("openai.chat", samples.openai_chat_completion(["a", "b"], input_tokens=50, cached_tokens=10), {"input_tokens": 50, "output_tokens": 2, "cached_tokens": 10, "reasoning_tokens": 0}),
        ("openai.responses", samples.responses_response(["a"], reasoning=["r"], input_tokens=50, cached_tokens=10), {"input_tokens": 50, "output_tokens": 2, "cached_tokens": 10, "reasoning_tokens": 1}),
        ("anthropic.messages", samples.anthropic_message(["a"], input_tokens=5, cache_read_tokens=40), {"input_tokens": 45, "output_tokens": 1, "cached_tokens": 40, "cache_creation_tokens": 0}),
        ("gemini", samples.gemini_response(["a", "b"], input_tokens=9, cached_tokens=3), {"input_tokens": 9, "output_tokens": 2, "cached_tokens": 3}),
        ("gemini", [samples.gemini_response(["a"]), {"candidates": []}], {"input_tokens": 8, "output_tokens": 1}),
        ("other", {"object": "list", "data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}}, {"input_tokens": 8}),
        ("openai.chat", {"usage": {"prompt_tokens": 5, "prompt_cache_hit_tokens": 4}}, {"input_tokens": 5, "cached_tokens": 4}),
    ],
)
def test_usage_from_body(api, body, expected):
    assert apis.get(api).reader.usage_from_body(body) == expected


@pytest.mark.parametrize("body", [None, "x", 3, [], [1], {"usage": None}, {"usage": "x"}, {"usage": {"prompt_tokens": "7", "completion_tokens": True}}])
@pytest.mark.parametrize("api", APIS)
def test_usage_from_odd_bodies_is_none(api, body):
    assert apis.get(api).reader.usage_from_body(body) is None


# --- errors and the end ------------------------------------------------------------------


@pytest.mark.parametrize(
    "api,stream,expected",
    [
        ("openai.chat", samples.openai_chat_stream(["a"], done=False)[:2], "server_error: Boom"),
        ("openai.responses", samples.responses_stream(["a"])[:5], "server_error: Boom"),
        ("anthropic.messages", samples.anthropic_stream(["a"])[:4], "overloaded_error: Boom"),
        ("gemini", samples.gemini_stream(["a", "b"])[:1], "503: Boom"),
    ],
)
def test_in_stream_error(api, stream, expected):
    w = watch(api, [*stream, samples.error_event(api, "Boom")])
    assert (w.error, w.done, w.token_events) == (expected, False, 1)


def test_responses_failed_is_an_error_and_the_end():
    failed = typed("response.failed", response={"status": "failed", "error": {"code": "server_error", "message": "Boom"}, "usage": None})
    w = watch("openai.responses", [failed])
    assert (w.error, w.done, w.usage) == ("server_error: Boom", True, None)


def test_responses_incomplete_is_the_end_without_error():
    incomplete = typed("response.incomplete", response={"status": "incomplete", "usage": {"input_tokens": 3, "output_tokens": 16}})
    w = watch("openai.responses", [incomplete])
    assert (w.error, w.done, w.usage) == (None, True, {"input_tokens": 3, "output_tokens": 16})


def test_first_error_is_kept_and_long_messages_are_cut():
    w = watch("openai.chat", [samples.error_event("openai.chat", "x" * 5000), samples.error_event("openai.chat", "second")])
    assert w.error.startswith("server_error: xxx") and len(w.error) == reader.MAX_ERROR_CHARS


def test_error_event_with_non_json_data():
    assert watch("other", [b"event: error\ndata: upstream went away\n\n"]).error == "upstream went away"


def test_not_done_without_terminal_event():
    assert not watch("openai.chat", samples.openai_chat_stream(["a"], done=False)).done
    assert not watch("anthropic.messages", samples.anthropic_stream(["a"])[:-1]).done
    assert not watch("gemini", samples.gemini_stream(["a", "b"])[:1]).done


# --- never raises --------------------------------------------------------------------------

SSE_ALPHABET = [
    b"data: ", b"event: ", b"error", b"message_start", b"content_block_delta", b"response.completed",
    b"response.failed", b"[DONE]", b"{", b"}", b"[", b"]", b'"type":', b'"delta":', b'"usage":', b'"error":',
    b'"text":"', b'"content":"', b'"choices":', b'"usageMetadata":', b'"finishReason"', b'"message":', b"null",
    b"1", b"-1e999", b"99999999999999999999999", b'"', b",", b"\xff", b"\xc3", b"\r", b"\n", b"\n\n", b": ",
]


@contextlib.contextmanager
def no_safety_net():
    """Fail if the watcher's catch-all logged: "never raises" must hold without it."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    sse.logger.addHandler(handler)
    try:
        yield
    finally:
        sse.logger.removeHandler(handler)
    assert not records, records[0].exc_info


@settings(max_examples=300)
@given(api=st.sampled_from(APIS), body=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=10))
def test_watcher_never_raises_on_random_bytes(api, body, cuts):
    with no_safety_net():
        w = watch(api, split_at(body, cuts))
        assert w.bytes == len(body) and (w.usage is None or isinstance(w.usage, dict))


@settings(max_examples=500)
@given(
    api=st.sampled_from(APIS),
    pieces=st.lists(st.sampled_from(SSE_ALPHABET), max_size=80),
    cuts=st.lists(st.integers(0, 400), max_size=10),
)
def test_watcher_never_raises_on_sse_like_garbage(api, pieces, cuts):
    with no_safety_net():
        w = watch(api, split_at(b"".join(pieces), cuts))
        _ = (w.usage, w.error, w.done)
    sse.transcript(apis.get(api), parse(b"".join(pieces)))


@settings(max_examples=300)
@given(api=st.sampled_from(APIS), events=st.lists(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "delta", "usage", "error", "choices", "message", "candidates", "content", "parts",
                         "text", "response", "index", "tool_calls", "function", "item", "prompt_tokens", "input_tokens"]),
        children, max_size=4),
    max_leaves=12), max_size=6), name=st.sampled_from(["", "error", "message_start", "message_delta",
                                                       "content_block_delta", "response.completed", "response.failed"]))
def test_watcher_never_raises_on_wrongly_typed_json(api, events, name):
    stream = [samples.sse_event(json.dumps(e), name or None) for e in events]
    with no_safety_net():
        w = watch(api, stream)
        _ = (w.usage, w.error)
        apis.get(api).reader.usage_from_body(events[0] if events else None)
    sse.transcript(apis.get(api), parse(*stream))


# --- transcripts -----------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["openai.chat", "openai.responses", "anthropic.messages"])
def test_transcript_assembles_text_reasoning_and_tool_call(api):
    events = parse(b"".join(ALL_SAMPLES[api]))
    assert apis.for_events(events) is apis.get(api)
    t = sse.transcript(apis.get(api), events)
    assert (t.text, t.reasoning) == ("Hello wörld", "hm")
    assert [(c.name, c.arguments) for c in t.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    assert t.tool_calls[0].id


def test_transcript_gemini():
    events = parse(b"".join(ALL_SAMPLES["gemini"]) + gemini_chunk({"text": "hm", "thought": True}, {"functionCall": {"name": "f", "args": {"a": 1}}}))
    assert apis.for_events(events) is apis.get(apis.GEMINI)
    t = sse.transcript(apis.get(apis.GEMINI), events)
    assert (t.text, t.reasoning, [(c.name, c.arguments) for c in t.tool_calls]) == ("Hello wörld", "hm", [("f", '{"a":1}')])


def test_for_events_other():
    assert apis.for_events(parse(b"data: hello\n\n")) is apis.OTHER_API
    assert apis.for_events([]) is apis.OTHER_API
