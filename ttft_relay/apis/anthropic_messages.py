"""Anthropic Messages (`…/messages`, under Anthropic-compatible base URLs too)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..stream.reader import Event, Reader, Transcript, as_int, as_str, counts, dig, loads, reported_error, type_of
from .api import Api, ErrorFormat, model_and_stream_from_body

if TYPE_CHECKING:
    from ..stream.sse import StreamWatcher

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

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
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


API = Api(
    name=NAME,
    scope=r"/messages/?(?:\?|$)",
    matches=matches,
    model_and_stream=model_and_stream_from_body,
    client_headers=("anthropic-version",),
    websocket_turns=False,
    reader=MessagesReader(),
    errors=AnthropicErrors(),
    semconv=("chat", "anthropic"),
)
