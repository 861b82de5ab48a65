"""OpenAI Responses (`…/responses`), over HTTP with SSE and over a WebSocket (Codex
CLI's transport: one `response.create` message per turn, answered by the events an SSE
stream would carry)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

from .reader import (
    Event, Reader, Transcript, Watcher, as_int, as_str, counts, dig, event_type, loads, reported_error, type_of)
from .shape import ARGUMENTS, RESULTS, SHRINK_MIN_CHARS, Shape, json_placeholder, placeholder, size
from .api import Api, Probe, Turns, as_dict, traits, error_code, model_and_stream_from_body
from .openai_chat import OPENAI_WINDOWS, OpenAIErrors

NAME = "openai.responses"

RELAY_RESPONSE_ID = "resp_ttft_relay_error"
"""The id of a failed response whose own id the relay never saw."""


class ResponsesErrors(OpenAIErrors):
    """OpenAI's error object; a stream that broke ends with `response.failed` — the
    terminal event clients act on (Codex reads a bare `error` event as a stream that
    closed before `response.completed`, and retries)."""

    sse_event = "response.failed"

    def stream_error(self, status: int, message: str, response_id: str | None) -> dict[str, Any]:
        return {
            "type": "response.failed",
            "response": {
                "id": response_id or RELAY_RESPONSE_ID,
                "object": "response",
                "status": "failed",
                "error": {"code": error_code(status), "message": message},
                "incomplete_details": None,
                "output": [],
            },
        }


_RESPONSE_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"]{1,200})"')


class ResponsesReader(Reader):
    """`/v1/responses`: typed events (`event:` = data's "type"), ending in response.completed/failed/incomplete."""

    TOKEN_TYPES = frozenset(
        {
            "response.output_text.delta",
            "response.refusal.delta",
            "response.reasoning_text.delta",
            "response.reasoning_summary_text.delta",
            "response.function_call_arguments.delta",
            "response.custom_tool_call_input.delta",
        }
    )
    TERMINAL_TYPES = frozenset({"response.completed", "response.failed", "response.incomplete"})
    _EMPTY_DELTA = re.compile(rb'"delta"\s*:\s*""')

    def is_token(self, event: Event) -> bool:
        if type_of(event) not in self.TOKEN_TYPES:
            return False
        delta = dig(loads(event.data), "delta")
        return isinstance(delta, str) and delta != ""

    def looks_like_token(self, event: Event) -> bool:
        return type_of(event) in self.TOKEN_TYPES and self._EMPTY_DELTA.search(event.data) is None

    def recognizes(self, event: Event) -> bool:
        return type_of(event).startswith("response.")

    def observe(self, event: Event, watcher: Watcher) -> None:
        kind = type_of(event)
        if kind == "response.created" and watcher.response_id is None:
            m = _RESPONSE_ID.search(event.data)
            watcher.response_id = m.group(1).decode("utf-8", "replace") if m else None
        elif kind in self.TERMINAL_TYPES:
            watcher.done = True
            watcher.keep_usage("final", event.data)
            if kind == "response.failed":
                watcher.set_error(dig(loads(event.data), "response", "error") or "response.failed")
        elif kind == "error":
            watcher.set_error(reported_error(event))

    def usage(self, source: str, obj: Any) -> dict | None:
        return dig(obj, "response", "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        return counts(
            input_tokens=as_int(raw.get("input_tokens")),
            output_tokens=as_int(raw.get("output_tokens")),
            cached_tokens=as_int(dig(raw, "input_tokens_details", "cached_tokens")),
            reasoning_tokens=as_int(dig(raw, "output_tokens_details", "reasoning_tokens")),
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        delta = obj.get("delta")
        if event_type in ("response.output_text.delta", "response.refusal.delta"):
            out.add(out.text_parts, delta)
        elif event_type in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            out.add(out.reasoning_parts, delta)
        elif event_type == "response.output_item.added":
            if dig(obj, "item", "type") in ("function_call", "custom_tool_call"):
                call = out.call(as_str(dig(obj, "item", "id")))
                call.name, call.id = as_str(dig(obj, "item", "name")), as_str(dig(obj, "item", "call_id"))
        elif event_type in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            out.call(as_str(obj.get("item_id"))).arguments += as_str(delta)


class ResponsesShape(Shape):
    """Input items: messages (typed or not), `*_call` / `*_call_output` pairs joined by
    `call_id`, reasoning and other items that belong to the turn they appear in."""

    items_key = "input"
    fixed_keys = ("instructions", "tools")
    text_part_type = "input_text"
    image_part_types = frozenset({"input_image", "input_file"})
    max_output_keys = ("max_output_tokens",)

    _SHRUNK_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output", "local_shell_call_output"})
    """Outputs whose `output` is text (or content parts) the model read; others (e.g. a
    computer call's screenshot object) keep the structure their API requires."""

    def problem(self, item: Any) -> str | None:
        if problem := super().problem(item):
            return problem
        if not isinstance(item.get("type", "message"), str):
            return "input item type is not a string"
        if "call_id" in item and not isinstance(item["call_id"], str):
            return "call_id is not a string"
        return None

    def items(self, body: dict) -> Any:
        items = body.get(self.items_key)
        # `input` as one string: a single user message
        return [{"role": "user", "content": items}] if isinstance(items, str) else items

    def role(self, item: dict) -> str | None:
        return super().role(item) if item.get("type", "message") == "message" else None

    def from_model(self, item: dict) -> bool:
        # an assistant message, reasoning, or a call (function, custom, web search, ...)
        kind = item.get("type", "message")
        return super().from_model(item) if kind == "message" else kind == "reasoning" or kind.endswith("_call")

    def calls(self, item: dict) -> Iterator[str]:
        if item.get("type", "").endswith("_call") and "call_id" in item:
            yield item["call_id"]

    def results(self, item: dict) -> Iterator[str]:
        if item.get("type", "").endswith("_call_output") and "call_id" in item:
            yield item["call_id"]

    def with_notice_after(self, item: dict, notice: str) -> dict | None:
        output = item.get("output")
        if item.get("type") in self._SHRUNK_OUTPUTS and isinstance(output, str):
            return {**item, "output": f"{output}\n\n{notice}"}
        return super().with_notice_after(item, notice)

    def shrink(self, item: dict, kind: str) -> dict | None:
        kind_of_item = item.get("type")
        if kind == RESULTS and kind_of_item in self._SHRUNK_OUTPUTS:
            output = item.get("output")
            if size(output) >= SHRINK_MIN_CHARS:
                return {**item, "output": placeholder("tool result", size(output))}
        elif kind == ARGUMENTS and kind_of_item == "function_call":
            args = item.get("arguments")
            if isinstance(args, str) and len(args) >= SHRINK_MIN_CHARS:
                return {**item, "arguments": json_placeholder("arguments", len(args))}
        elif kind == ARGUMENTS and kind_of_item == "custom_tool_call":
            text = item.get("input")
            if isinstance(text, str) and len(text) >= SHRINK_MIN_CHARS:
                return {**item, "input": placeholder("input", len(text))}
        return super().shrink(item, kind)


class ResponsesProbe(Probe):
    def body(self, prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
        return self.streamed({"model": model, "input": prompt, self.max_tokens_field: max_tokens})


TURN_START = b'"response.create"'
TYPE_SCAN = 256
"""A turn's type is its message's first key: only this many bytes are searched for it."""


def parse_turn_request(content: bytes) -> dict[str, Any] | None:
    """The client message's JSON if it starts a turn (`response.create`), else None."""
    if TURN_START not in content[:TYPE_SCAN]:
        return None
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) and body.get("type") == "response.create" else None


def turn_model(body: dict[str, Any]) -> str | None:
    """The model a `response.create` names: at the top (Responses) or in `response` (Realtime)."""
    model = body.get("model")
    if model is None and isinstance(body.get("response"), dict):
        model = body["response"].get("model")
    return model if isinstance(model, str) else None


def turn_message(body: dict[str, Any]) -> bytes:
    """The turn asking what the HTTP body `body` asks, as Codex sends it: `response.create`
    with the body's fields (the socket is the stream, so no `stream` flags)."""
    fields = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return orjson.dumps({"type": "response.create", **fields})


def turn_continues(body: dict[str, Any]) -> str | None:
    """`previous_response_id`: the turn's `input` only adds to that response's conversation
    (Codex sends each turn so, after a prewarm that carried the whole input)."""
    previous = body.get("previous_response_id")
    return previous if isinstance(previous, str) else None


def turn_completed(content: bytes) -> tuple[str, list] | None:
    """`response.completed`: the response's id and its output items (what the next turn continues)."""
    if event_type(content) != "response.completed":
        return None
    response = dig(loads(content), "response")
    if not isinstance(response, dict) or not isinstance(response.get("id"), str):
        return None
    output = response.get("output")
    return response["id"], output if isinstance(output, list) else []


def turn_refusal(content: bytes) -> tuple[int, bytes] | None:
    """A turn's `error` event (`{"type": "error", "status": 400, "error": {...}}`) or
    `response.failed` (its `response.error`): the status and `{"error": ...}`, the body an
    HTTP request's refusal would have had."""
    kind = event_type(content)
    if kind not in ("error", "response.failed"):
        return None
    obj = loads(content)
    error = dig(obj, "error") if kind == "error" else dig(obj, "response", "error")
    if not isinstance(error, dict):
        return None
    status = dig(obj, "status") if kind == "error" else None
    return (status if isinstance(status, int) else 400), orjson.dumps({"error": error})


TURNS = Turns(
    request=parse_turn_request,
    model=turn_model,
    prewarm=lambda body: body.get("generate") is False,
    # The Realtime API starts turns of its own (voice activity): from their first event.
    server_started=lambda content: event_type(content) == "response.created",
    start=turn_message,
    continues=turn_continues,
    completed=turn_completed,
    refusal=turn_refusal,
)
"""A turn per `response.create`, as Codex sends them (the Realtime API's turns too)."""


def prefill_traits(body: Any) -> str:
    """`reasoning.effort` and the tools' size."""
    body = as_dict(body)
    return traits(effort=as_dict(body.get("reasoning")).get("effort"), tools=body.get("tools"))


API = Api(
    name=NAME,
    scope=r"/responses/?(?:\?|$)",
    matches=lambda path: path.endswith("/responses"),
    model_and_stream=model_and_stream_from_body,
    prefill_traits=prefill_traits,
    client_headers=(),
    key_headers=("authorization", "api-key"),  # api-key: Azure OpenAI
    key_params=(),
    websocket_turns=TURNS,
    trim_shape=ResponsesShape(),
    windows=OPENAI_WINDOWS,
    reader=ResponsesReader(),
    errors=ResponsesErrors(),
    semconv=("chat", "openai"),
    probe=ResponsesProbe(
        NAME, "/v1/responses", "OPENAI_API_KEY", "https://api.openai.com", "gpt-4o-mini", "max_output_tokens"
    ),
)
