"""OpenAI Chat Completions (`…/chat/completions`), and the error format most
OpenAI-compatible servers copy for every endpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .reader import Event, Reader, Transcript, Watcher, as_int, as_str, counts, dig, loads
from .shape import ARGUMENTS, RESULTS, SHRINK_MIN_CHARS, Shape, id_problem, ids, json_placeholder, placeholder, size
from .api import (
    Api, ErrorFormat, Probe, TooLong, Windows, as_dict, error_code, error_field, model_and_stream_from_body, traits,
    number)

NAME = "openai.chat"


class OpenAIErrors(ErrorFormat):
    """`{"error": {"message", "type", "param", "code"}}`; in a stream, a data-only event
    whose object is that error."""

    def body(self, status: int, message: str) -> dict[str, Any]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": error_code(status)}}


class ChatReader(Reader):
    """`/v1/chat/completions`: `data:` JSON chunks, a usage-only last chunk, `data: [DONE]`."""

    _TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")
    # A non-empty string in a delta field, or a tool call (name or arguments).
    _TOKEN = re.compile(rb'"(?:content|reasoning_content|reasoning|refusal|arguments|name)"\s*:\s*"[^"]')
    _USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')

    def is_token(self, event: Event) -> bool:
        for choice in _choices(loads(event.data)):
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if any(isinstance(delta.get(k), str) and delta[k] for k in self._TEXT_FIELDS):
                return True
            if delta.get("tool_calls") or delta.get("function_call"):
                return True
        return False

    def looks_like_token(self, event: Event) -> bool:
        # Start at the delta: halves the scan, the id/model/fingerprint come first.
        data = event.data
        return self._TOKEN.search(data, max(data.find(b'"delta"'), 0)) is not None

    def recognizes(self, event: Event) -> bool:
        return b'"chat.completion.chunk"' in event.data or b'"choices"' in event.data

    def observe(self, event: Event, watcher: Watcher) -> None:
        data = event.data
        # With include_usage every chunk says "usage":null; only the last one has an object.
        at = data.find(b'"usage"')
        if at >= 0 and self._USAGE_OBJECT.match(data, at):
            watcher.keep_usage("final", data)
        super().observe(event, watcher)

    def usage(self, source: str, obj: Any) -> dict | None:
        return dig(obj, "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        cached = dig(raw, "prompt_tokens_details", "cached_tokens")
        if cached is None:
            cached = raw.get("prompt_cache_hit_tokens")  # DeepSeek's spelling
        return counts(
            input_tokens=as_int(raw.get("prompt_tokens")),
            output_tokens=as_int(raw.get("completion_tokens")),
            cached_tokens=as_int(cached),
            reasoning_tokens=as_int(dig(raw, "completion_tokens_details", "reasoning_tokens")),
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        for choice in _choices(obj):
            delta = choice.get("delta")
            # Only the first choice: n > 1 streams are rare and would interleave.
            if choice.get("index", 0) != 0 or not isinstance(delta, dict):
                continue
            out.add(out.text_parts, delta.get("content"))
            out.add(out.text_parts, delta.get("refusal"))
            out.add(out.reasoning_parts, delta.get("reasoning_content"))
            out.add(out.reasoning_parts, delta.get("reasoning"))
            tools = delta.get("tool_calls")
            for tool in tools if isinstance(tools, list) else ():
                if not isinstance(tool, dict):
                    continue
                call = out.call(tool.get("index", 0))
                call.id = as_str(tool.get("id")) or call.id
                call.name = as_str(dig(tool, "function", "name")) or call.name
                call.arguments += as_str(dig(tool, "function", "arguments"))


def _choices(obj: Any) -> list[dict]:
    choices = dig(obj, "choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


class ChatShape(Shape):
    items_key = "messages"
    fixed_keys = ("tools", "functions")
    text_part_type = "text"
    image_part_types = frozenset({"image_url", "input_audio", "file"})
    max_output_keys = ("max_completion_tokens", "max_tokens")  # max_tokens: the older name

    def problem(self, item: Any) -> str | None:
        if problem := super().problem(item):
            return problem
        calls = item.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return "tool_calls is not a list of objects"
        if "tool_call_id" in item and not isinstance(item["tool_call_id"], str):
            return "tool_call_id is not a string"
        return id_problem(calls, "id")

    def calls(self, item: dict) -> Iterator[str]:
        return ids(item.get("tool_calls"), "id")

    def results(self, item: dict) -> Iterator[str]:
        if item.get("role") == "tool" and "tool_call_id" in item:
            yield item["tool_call_id"]

    def shrink(self, item: dict, kind: str) -> dict | None:
        role = item.get("role")
        if kind == RESULTS and role in ("tool", "function"):
            content = item.get("content")
            if size(content) >= SHRINK_MIN_CHARS:
                return {**item, "content": placeholder("tool result", size(content))}
        elif kind == ARGUMENTS and role == "assistant" and isinstance(item.get("tool_calls"), list):
            calls, changed = [], False
            for call in item["tool_calls"]:
                fn = call.get("function")
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str) and len(args) >= SHRINK_MIN_CHARS:
                    call = {**call, "function": {**fn, "arguments": json_placeholder("arguments", len(args))}}
                    changed = True
                calls.append(call)
            return {**item, "tool_calls": calls} if changed else None
        return super().shrink(item, kind)


WINDOWS: dict[str, int] = {
    # GPT-5 family: 400k, of which at most 272k prompt (MAX_INPUT); the chat snapshots 128k
    **dict.fromkeys(("gpt-5", "gpt-5-mini", "gpt-5-nano", "gpt-5-pro", "gpt-5-codex", "gpt-5.1", "gpt-5.1-codex",
                     "gpt-5.1-codex-mini", "gpt-5.1-codex-max", "gpt-5.2", "gpt-5.2-codex", "gpt-5.2-pro"), 400_000),
    **dict.fromkeys(("gpt-5-chat-latest", "gpt-5.1-chat-latest", "gpt-5.2-chat-latest"), 128_000),
    "codex-mini-latest": 200_000,
    **dict.fromkeys(("gpt-4.1", "gpt-4.1-mini", "gpt-4.1-nano"), 1_047_576),
    **dict.fromkeys(("gpt-4o", "gpt-4o-mini", "chatgpt-4o-latest", "gpt-4.5-preview", "gpt-4-turbo",
                     "gpt-4-turbo-preview", "gpt-4-1106-preview", "gpt-4-0125-preview"), 128_000),
    "gpt-4": 8_192,
    "gpt-4-0613": 8_192,
    "gpt-4-32k": 32_768,
    **dict.fromkeys(("gpt-3.5-turbo", "gpt-3.5-turbo-0125", "gpt-3.5-turbo-1106"), 16_385),
    **dict.fromkeys(("gpt-oss-120b", "gpt-oss-20b"), 131_072),
    **dict.fromkeys(("o1", "o1-pro", "o3", "o3-mini", "o3-pro", "o4-mini"), 200_000),
    **dict.fromkeys(("o1-mini", "o1-preview"), 128_000),
}  # fmt: skip
"""OpenAI's context windows by exact model id (platform.openai.com/docs/models), dated
snapshots included. A model not named here is unknown: `gpt-5.5` is not `gpt-5`."""

MAX_INPUT: dict[str, int] = dict.fromkeys(
    ("gpt-5", "gpt-5-mini", "gpt-5-nano", "gpt-5-pro", "gpt-5-codex", "gpt-5.1", "gpt-5.1-codex", "gpt-5.1-codex-mini",
     "gpt-5.1-codex-max", "gpt-5.2", "gpt-5.2-codex", "gpt-5.2-pro"), 272_000)  # fmt: skip
"""GPT-5's API takes at most 272k prompt tokens of its 400k window."""

_CONTEXT = re.compile(r"This model's maximum context length is (\d+) tokens\b")
_RESULTED = re.compile(r"(?:messages|input) resulted in (\d+) tokens")
_REQUESTED = re.compile(r"you requested (\d+) tokens \((\d+) in the messages, (\d+) in the completion\)")
REFUSAL_CODE = "context_length_exceeded"


def too_long(status: int, body: bytes) -> TooLong | None:
    """OpenAI's `context_length_exceeded` (400). Chat Completions says the window, its
    message beginning "This model's maximum context length is 128000 tokens. However, your
    messages resulted in 130012 tokens …", or "… you requested 8250 tokens (250 in the
    messages, 8000 in the completion) …"; the Responses API does not ("Your input exceeds the
    context window of this model …"). A window is read only from a message that begins with
    OpenAI's own sentence, never from text quoted further on."""
    if status != 400 or error_field(body, "code") != REFUSAL_CODE:
        return None
    message = error_field(body, "message") or ""
    if (window := _CONTEXT.match(message)) is None:
        return TooLong(max_input=None, window=None, prompt_tokens=None, output_tokens=None, kind=REFUSAL_CODE)
    requested = _REQUESTED.search(message, window.end())
    return TooLong(
        max_input=None,
        window=number(window),
        prompt_tokens=number(requested, 2) if requested else number(_RESULTED.search(message, window.end())),
        output_tokens=number(requested, 3),
        kind=REFUSAL_CODE,
    )


OPENAI_WINDOWS = Windows(known=WINDOWS, max_input=MAX_INPUT, long_context={}, too_long=too_long)


class ChatProbe(Probe):
    def streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with streaming, and usage in the stream, switched on."""
        return {**super().streamed(body), "stream_options": {"include_usage": True}}


def prefill_traits(body: Any) -> str:
    """`reasoning_effort` and the tools' size."""
    body = as_dict(body)
    return traits(effort=body.get("reasoning_effort"), tools=body.get("tools"))


API = Api(
    name=NAME,
    scope=r"/chat/completions/?(?:\?|$)",
    matches=lambda path: path.endswith("/chat/completions"),
    model_and_stream=model_and_stream_from_body,
    prefill_traits=prefill_traits,
    client_headers=(),
    key_headers=("authorization", "api-key"),  # api-key: Azure OpenAI
    key_params=(),
    websocket_turns=None,
    trim_shape=ChatShape(),
    windows=OPENAI_WINDOWS,
    reader=ChatReader(),
    errors=OpenAIErrors(),
    semconv=("chat", "openai"),
    probe=ChatProbe(
        NAME, "/v1/chat/completions", "OPENAI_API_KEY", "https://api.openai.com", "gpt-4o-mini", "max_completion_tokens"
    ),
)
