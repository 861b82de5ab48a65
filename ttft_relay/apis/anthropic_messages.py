"""Anthropic Messages (`…/messages`, under Anthropic-compatible base URLs too)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from .reader import Event, Reader, Transcript, Watcher, as_int, as_str, counts, dig, loads, reported_error, type_of
from .shape import ARGUMENTS, IMAGES, RESULTS, SHRINK_MIN_CHARS, Shape, id_problem, ids, placeholder, size
from .api import Api, ErrorFormat, Probe, TooLong, Windows, as_dict, error_field, model_and_stream_from_body, traits

NAME = "anthropic.messages"


def matches(path: str) -> bool:
    # OpenAI's Assistants API has /v1/threads/<id>/messages: not Anthropic's shape.
    return path.endswith("/messages") and "/threads/" not in path


class AnthropicErrors(ErrorFormat):
    """`{"type": "error", "error": {"type", "message"}}`, in a stream as an `error` event."""

    sse_event = "error"

    def body(self, status: int, message: str) -> dict[str, Any]:
        kind = {401: "authentication_error", 413: "request_too_large", 504: "timeout_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesReader(Reader):
    """`/v1/messages`: message_start, content blocks and their deltas, message_delta, message_stop."""

    # Delta type -> the field holding its visible text. signature_delta is not output.
    _DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
    _TOKEN = re.compile(rb'"(?:text|thinking|partial_json)"\s*:\s*"[^"]')

    def is_token(self, event: Event) -> bool:
        if type_of(event) != "content_block_delta":
            return False
        delta = dig(loads(event.data), "delta")
        key = self._DELTA_FIELDS.get(dig(delta, "type"))
        return key is not None and isinstance(delta.get(key), str) and delta[key] != ""

    def looks_like_token(self, event: Event) -> bool:
        return type_of(event) == "content_block_delta" and self._TOKEN.search(event.data) is not None

    def recognizes(self, event: Event) -> bool:
        return type_of(event) in ("message_start", "content_block_start", "content_block_delta")

    def observe(self, event: Event, watcher: Watcher) -> None:
        kind = type_of(event)
        if kind == "message_start":
            watcher.keep_usage("message_start", event.data)
        elif kind == "message_delta":
            watcher.keep_usage("message_delta", event.data)
        elif kind == "message_stop":
            watcher.done = True
        elif kind == "error":
            watcher.set_error(reported_error(event))

    def usage(self, source: str, obj: Any) -> dict | None:
        return dig(obj, "message", "usage") if source == "message_start" else dig(obj, "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        # Anthropic's input_tokens leaves out the cached part; the relay's counts all of the prompt.
        uncached = as_int(raw.get("input_tokens"))
        cache_read = as_int(raw.get("cache_read_input_tokens"))
        cache_creation = as_int(raw.get("cache_creation_input_tokens"))
        return counts(
            input_tokens=None if uncached is None else uncached + (cache_read or 0) + (cache_creation or 0),
            output_tokens=as_int(raw.get("output_tokens")),
            cached_tokens=cache_read,
            cache_creation_tokens=cache_creation,
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        index = obj.get("index")
        if event_type == "content_block_start":
            if dig(obj, "content_block", "type") in ("tool_use", "server_tool_use"):
                call = out.call(index)
                call.name = as_str(dig(obj, "content_block", "name"))
                call.id = as_str(dig(obj, "content_block", "id"))
        elif event_type == "content_block_delta":
            kind = dig(obj, "delta", "type")
            if kind == "text_delta":
                out.add(out.text_parts, dig(obj, "delta", "text"))
            elif kind == "thinking_delta":
                out.add(out.reasoning_parts, dig(obj, "delta", "thinking"))
            elif kind == "input_json_delta":
                out.call(index).arguments += as_str(dig(obj, "delta", "partial_json"))


LONG_CONTEXT_BETA = "context-1m-"
"""Start of the `anthropic-beta` value that opens Claude's 1M-token window."""


class MessagesShape(Shape):
    """`system` is top-level, and mid-conversation system messages may sit in `messages`;
    tool results arrive as blocks in user messages, so a user message with tool results
    continues a turn instead of starting one. Server tool blocks (`server_tool_use`,
    `web_search_tool_result`, ...) pair up inside one assistant message."""

    items_key = "messages"
    fixed_keys = ("system", "tools")
    text_part_type = "text"
    image_part_types = frozenset({"image", "document"})
    max_output_keys = ("max_tokens",)
    gap_notice = True  # the API merges the head's user message and the first kept prompt

    def long_context(self, anthropic_beta: str | None) -> bool:
        # Claude's 1M window: `anthropic-beta: context-1m-2025-08-07`
        return any(b.strip().startswith(LONG_CONTEXT_BETA) for b in (anthropic_beta or "").split(","))

    def problem(self, item: Any) -> str | None:
        if problem := super().problem(item):
            return problem
        return id_problem(item.get("content"), "id", "tool_use_id")

    def calls(self, item: dict) -> Iterator[str]:
        # tool_use, server_tool_use, mcp_tool_use: all answered by a block naming their id
        content = item.get("content")
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and str(block.get("type", "")).endswith("tool_use") and "id" in block:
                yield block["id"]

    def results(self, item: dict) -> Iterator[str]:
        return ids(item.get("content"), "tool_use_id")

    def shrink(self, item: dict, kind: str) -> dict | None:
        content = item.get("content")
        if not isinstance(content, list):
            return None
        role = item.get("role")
        blocks, changed = [], False
        for block in content:
            new = None
            if isinstance(block, dict):
                new = self._shrink_block(block, kind, role)
            blocks.append(block if new is None else new)
            changed = changed or new is not None
        return {**item, "content": blocks} if changed else None

    def _shrink_block(self, block: dict, kind: str, role: Any) -> dict | None:
        kind_of_block = block.get("type")
        if kind == RESULTS and kind_of_block == "tool_result":
            inner = block.get("content")
            if size(inner) >= SHRINK_MIN_CHARS:
                return {**block, "content": placeholder("tool result", size(inner))}
        elif kind == ARGUMENTS and kind_of_block == "tool_use" and role == "assistant":
            args = block.get("input")
            if size(args) >= SHRINK_MIN_CHARS:
                return {**block, "input": {"ttft_relay": placeholder("arguments", size(args))}}
        elif kind == IMAGES and role == "user":
            if self._is_image(block):
                return self._image_placeholder(block)
            if kind_of_block == "tool_result" and (inner := self._without_images(block.get("content"))):
                return {**block, "content": inner}
        return None

    def _image_placeholder(self, part: dict) -> dict:
        text = super()._image_placeholder(part)
        return {**text, "cache_control": part["cache_control"]} if "cache_control" in part else text


WINDOWS: dict[str, int] = dict.fromkeys((
    "claude-opus-4-6", "claude-opus-4-5", "claude-opus-4-5-20251101", "claude-opus-4-1", "claude-opus-4-1-20250805",
    "claude-opus-4-0", "claude-opus-4-20250514", "claude-sonnet-4-5", "claude-sonnet-4-5-20250929",
    "claude-sonnet-4-0", "claude-sonnet-4-20250514", "claude-haiku-4-5", "claude-haiku-4-5-20251001",
    "claude-3-7-sonnet-latest", "claude-3-7-sonnet-20250219", "claude-3-5-haiku-latest", "claude-3-5-haiku-20241022",
), 200_000)  # fmt: skip
"""Claude's context windows by exact model id (docs.anthropic.com's models overview). A
model not named here is unknown: Claude Code's newest model is learned, not assumed."""

LONG_CONTEXT: dict[str, int] = dict.fromkeys((
    "claude-opus-4-6", "claude-sonnet-4-5", "claude-sonnet-4-5-20250929", "claude-sonnet-4-0", "claude-sonnet-4-20250514",
), 1_000_000)  # fmt: skip
"""The models the `context-1m-…` beta header opens a 1M window for."""

_TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
_WITH_OUTPUT = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)\b")
REFUSAL_TYPE = "invalid_request_error"


def too_long(status: int, body: bytes) -> TooLong | None:
    """Anthropic's 400 `invalid_request_error` whose message is, whole, "prompt is too long:
    219898 tokens > 200000 maximum", or, for prompt and answer together, begins "input length
    and `max_tokens` exceed context limit: 188240 + 21333 > 200000". The message must be the
    provider's own sentence from its first character: a validator that quotes a field of the
    request back in its error (the client's own text) is not Anthropic saying so."""
    if status != 400 or error_field(body, "type") != REFUSAL_TYPE:
        return None
    message = error_field(body, "message") or ""
    if m := _TOO_LONG.fullmatch(message):
        return TooLong(max_input=int(m.group(2)), window=None, prompt_tokens=int(m.group(1)), output_tokens=None,
                       kind=REFUSAL_TYPE)
    if m := _WITH_OUTPUT.match(message):
        return TooLong(max_input=None, window=int(m.group(3)), prompt_tokens=int(m.group(1)),
                       output_tokens=int(m.group(2)), kind=REFUSAL_TYPE)
    return None


class MessagesProbe(Probe):
    def auth_headers(self, key: str | None) -> list[tuple[str, str]]:
        return ([("x-api-key", key)] if key else []) + [("anthropic-version", "2023-06-01")]


def prefill_traits(body: Any) -> str:
    """Extended thinking's `budget_tokens` (or its adaptive `effort`) and the tools' size."""
    body = as_dict(body)
    thinking = as_dict(body.get("thinking"))
    on = thinking.get("type") in ("enabled", "adaptive")
    return traits(effort=as_dict(body.get("output_config")).get("effort"),
                  budget=thinking.get("budget_tokens") if on else None, tools=body.get("tools"))


API = Api(
    name=NAME,
    scope=r"/messages/?(?:\?|$)",
    matches=matches,
    model_and_stream=model_and_stream_from_body,
    prefill_traits=prefill_traits,
    client_headers=("anthropic-version",),
    key_headers=("x-api-key", "authorization"),  # authorization: a Bearer token (ANTHROPIC_AUTH_TOKEN)
    key_params=(),
    websocket_turns=None,
    trim_shape=MessagesShape(),
    windows=Windows(known=WINDOWS, max_input={}, long_context=LONG_CONTEXT, too_long=too_long),
    reader=MessagesReader(),
    errors=AnthropicErrors(),
    semconv=("chat", "anthropic"),
    probe=MessagesProbe(
        NAME, "/v1/messages", "ANTHROPIC_API_KEY", "https://api.anthropic.com", "claude-3-5-haiku-latest", "max_tokens"
    ),
)
