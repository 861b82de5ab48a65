"""Realistic wire bodies of the LLM APIs the relay reads, built from text pieces.

The fake upstreams send these and the parser tests read them, so both agree on
the wire format. Shapes follow what the real services send (field order, ids,
the usage-only final chunk of OpenAI chat, Anthropic's `ping`, Gemini's CRLF
line ends). Everything is deterministic: the same arguments give the same bytes.

Stream builders return `list[bytes]`, one complete SSE event per element, so a
fake upstream can pace them (prefill delay, gaps, stalls) event by event.
Non-stream builders return the parsed JSON body as a `dict` (serialise it with
`json.dumps`/`orjson.dumps`).

Token accounting in the built usage: one output token per text piece, reasoning
piece and tool-argument piece; `reasoning_tokens` is the number of reasoning pieces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

OPENAI_MODEL = "gpt-4o-mini-2024-07-18"
ANTHROPIC_MODEL = "claude-sonnet-4-20250514"
GEMINI_MODEL = "gemini-2.0-flash"
CREATED = 1735689600
"""A fixed `created` timestamp (2025-01-01T00:00:00Z) so bodies are reproducible."""

ToolCall = tuple[str, Sequence[str]]
"""A tool call as (function name, argument JSON split into the pieces streamed)."""


def _json(obj: Any, *, spaced: bool = False) -> str:
    # OpenAI and Anthropic send compact JSON; Gemini sends ", " / ": " separators.
    return json.dumps(obj, separators=(", ", ": ") if spaced else (",", ":"), ensure_ascii=False)


def sse_event(data: Any, event: str | None = None, *, newline: str = "\n") -> bytes:
    """One SSE event: `event:` line if given, one `data:` line, a blank line.

    `data` that is not `str`/`bytes` is serialised as compact JSON.
    """
    if isinstance(data, bytes):
        data = data.decode()
    elif not isinstance(data, str):
        data = _json(data)
    lines = [f"event: {event}"] if event else []
    lines.append(f"data: {data}")
    return (newline.join(lines) + newline + newline).encode()


def _usage_counts(pieces: Sequence[str], reasoning: Sequence[str], tool_call: ToolCall | None) -> int:
    return len(pieces) + len(reasoning) + (len(tool_call[1]) if tool_call else 0)


# --- OpenAI chat completions -------------------------------------------------


def _openai_chat_usage(output_tokens: int, input_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    return {
        "prompt_tokens": input_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def openai_chat_stream(
    pieces: Sequence[str],
    *,
    model: str = OPENAI_MODEL,
    usage: bool = True,
    input_tokens: int = 12,
    cached_tokens: int = 0,
    reasoning: Sequence[str] = (),
    tool_call: ToolCall | None = None,
    tool_id: str = "call_sample0",
    done: bool = True,
    id: str = "chatcmpl-AbC123sample",
) -> list[bytes]:
    """A `/v1/chat/completions` stream: role chunk, reasoning, content, tool call, finish, usage, `[DONE]`.

    `usage=True` adds the usage-only final chunk that `stream_options: {"include_usage": true}`
    asks for (and `"usage": null` on the other chunks, as OpenAI does then).
    `reasoning` pieces go out as `delta.reasoning_content` (DeepSeek / vLLM style).
    """

    def chunk(delta: dict | None, finish: str | None = None, usage_obj: dict | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": id,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "system_fingerprint": "fp_0123456789",
            "choices": []
            if delta is None
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if usage:
            body["usage"] = usage_obj
        return sse_event(body)

    events = [chunk({"role": "assistant", "content": "", "refusal": None})]
    events += [chunk({"reasoning_content": r}) for r in reasoning]
    events += [chunk({"content": p}) for p in pieces]
    if tool_call:
        name, args = tool_call
        events.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": tool_id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
        )
        events += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}) for a in args]
    events.append(chunk({}, "tool_calls" if tool_call else "stop"))
    if usage:
        out = _usage_counts(pieces, reasoning, tool_call)
        events.append(chunk(None, usage_obj=_openai_chat_usage(out, input_tokens, cached_tokens, len(reasoning))))
    if done:
        events.append(sse_event("[DONE]"))
    return events


def openai_chat_completion(
    pieces: Sequence[str],
    *,
    model: str = OPENAI_MODEL,
    input_tokens: int = 12,
    cached_tokens: int = 0,
    tool_call: ToolCall | None = None,
    tool_id: str = "call_sample0",
    id: str = "chatcmpl-AbC123sample",
) -> dict:
    """The non-streamed `/v1/chat/completions` response body for the same answer."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(pieces) or None, "refusal": None}
    if tool_call:
        name, args = tool_call
        message["tool_calls"] = [
            {"id": tool_id, "type": "function", "function": {"name": name, "arguments": "".join(args)}}
        ]
    return {
        "id": id,
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if tool_call else "stop",
            }
        ],
        "usage": _openai_chat_usage(_usage_counts(pieces, (), tool_call), input_tokens, cached_tokens, 0),
        "system_fingerprint": "fp_0123456789",
    }


# --- OpenAI Responses --------------------------------------------------------


def _responses_usage(output_tokens: int, input_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def _responses_object(model: str, id: str, status: str, output: list, usage: dict | None) -> dict:
    return {
        "id": id,
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "usage": usage,
    }


def _responses_output(pieces: Sequence[str], reasoning: Sequence[str], tool_call: ToolCall | None,
                      tool_id: str = "call_sample0") -> list[dict]:
    output: list[dict] = []
    if reasoning:
        output.append(
            {
                "id": "rs_sample0",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "".join(reasoning)}],
            }
        )
    if pieces:
        output.append(
            {
                "id": "msg_sample0",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "".join(pieces)}],
            }
        )
    if tool_call:
        output.append(
            {
                "id": "fc_" + tool_id.removeprefix("call_"),
                "type": "function_call",
                "status": "completed",
                "call_id": tool_id,
                "name": tool_call[0],
                "arguments": "".join(tool_call[1]),
            }
        )
    return output


def responses_stream(
    pieces: Sequence[str],
    *,
    model: str = OPENAI_MODEL,
    input_tokens: int = 12,
    cached_tokens: int = 0,
    reasoning: Sequence[str] = (),
    tool_call: ToolCall | None = None,
    tool_id: str = "call_sample0",
    id: str = "resp_sample0",
) -> list[bytes]:
    """A `/v1/responses` stream: created, in_progress, reasoning summary, output text, function call, completed.

    Every event carries `event:` and a `type` plus `sequence_number` in its data, as OpenAI sends.
    `tool_id`: the function call's `call_id`.
    """
    events: list[bytes] = []

    def emit(type_: str, **fields: Any) -> None:
        events.append(sse_event({"type": type_, "sequence_number": len(events), **fields}, type_))

    emit("response.created", response=_responses_object(model, id, "in_progress", [], None))
    emit("response.in_progress", response=_responses_object(model, id, "in_progress", [], None))
    output = _responses_output(pieces, reasoning, tool_call, tool_id)
    for index, item in enumerate(output):
        if item["type"] == "reasoning":
            emit("response.output_item.added", output_index=index, item={**item, "summary": []})
            part = {"type": "summary_text", "text": ""}
            emit("response.reasoning_summary_part.added", item_id=item["id"], output_index=index, summary_index=0, part=part)
            for r in reasoning:
                emit("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index, summary_index=0, delta=r)
            text = "".join(reasoning)
            emit("response.reasoning_summary_text.done", item_id=item["id"], output_index=index, summary_index=0, text=text)
            emit("response.reasoning_summary_part.done", item_id=item["id"], output_index=index, summary_index=0, part={**part, "text": text})
        elif item["type"] == "message":
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
            for p in pieces:
                emit("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=p, logprobs=[])
            text = "".join(pieces)
            emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text, logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part={**part, "text": text})
        else:
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            assert tool_call  # a function_call item exists only for a tool call
            for a in tool_call[1]:
                emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=a)
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    usage = _responses_usage(_usage_counts(pieces, reasoning, tool_call), input_tokens, cached_tokens, len(reasoning))
    emit("response.completed", response=_responses_object(model, id, "completed", output, usage))
    return events


def responses_response(
    pieces: Sequence[str],
    *,
    model: str = OPENAI_MODEL,
    input_tokens: int = 12,
    cached_tokens: int = 0,
    reasoning: Sequence[str] = (),
    tool_call: ToolCall | None = None,
    tool_id: str = "call_sample0",
    id: str = "resp_sample0",
) -> dict:
    """The non-streamed `/v1/responses` body for the same answer."""
    usage = _responses_usage(_usage_counts(pieces, reasoning, tool_call), input_tokens, cached_tokens, len(reasoning))
    return _responses_object(model, id, "completed", _responses_output(pieces, reasoning, tool_call, tool_id), usage)


# --- Anthropic Messages ------------------------------------------------------


def anthropic_stream(
    pieces: Sequence[str],
    *,
    model: str = ANTHROPIC_MODEL,
    input_tokens: int = 25,
    cache_read_tokens: int = 0,
    cache_creation_tokens: int = 0,
    thinking: Sequence[str] = (),
    tool_call: ToolCall | None = None,
    tool_id: str = "toolu_01Sample",
    ping: bool = True,
    id: str = "msg_01SampleXyz",
) -> list[bytes]:
    """A `/v1/messages` stream: message_start, ping, thinking / text / tool_use blocks, message_delta, message_stop.

    A thinking block ends with a `signature_delta`, as the real API sends. `tool_id`: the tool_use block's id.
    """
    events: list[bytes] = []

    def emit(type_: str, **fields: Any) -> None:
        events.append(sse_event({"type": type_, **fields}, type_))

    start_usage = {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": cache_creation_tokens,
        "cache_read_input_tokens": cache_read_tokens,
        "output_tokens": 1,
    }
    message = {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }
    emit("message_start", message=message)
    index = 0
    if thinking:
        emit("content_block_start", index=index, content_block={"type": "thinking", "thinking": "", "signature": ""})
        for t in thinking:
            emit("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": t})
        emit("content_block_delta", index=index, delta={"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"})
        emit("content_block_stop", index=index)
        index += 1
    if pieces:
        emit("content_block_start", index=index, content_block={"type": "text", "text": ""})
        if ping:
            emit("ping")
        for p in pieces:
            emit("content_block_delta", index=index, delta={"type": "text_delta", "text": p})
        emit("content_block_stop", index=index)
        index += 1
    if tool_call:
        block = {"type": "tool_use", "id": tool_id, "name": tool_call[0], "input": {}}
        emit("content_block_start", index=index, content_block=block)
        for a in tool_call[1]:
            emit("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": a})
        emit("content_block_stop", index=index)
    stop_reason = "tool_use" if tool_call else "end_turn"
    emit(
        "message_delta",
        delta={"stop_reason": stop_reason, "stop_sequence": None},
        usage={"output_tokens": _usage_counts(pieces, thinking, tool_call)},
    )
    emit("message_stop")
    return events


def anthropic_message(
    pieces: Sequence[str],
    *,
    model: str = ANTHROPIC_MODEL,
    input_tokens: int = 25,
    cache_read_tokens: int = 0,
    cache_creation_tokens: int = 0,
    tool_call: ToolCall | None = None,
    tool_id: str = "toolu_01Sample",
    id: str = "msg_01SampleXyz",
) -> dict:
    """The non-streamed `/v1/messages` body for the same answer."""
    content: list[dict] = [{"type": "text", "text": "".join(pieces)}] if pieces else []
    if tool_call:
        content.append(
            {"type": "tool_use", "id": tool_id, "name": tool_call[0], "input": json.loads("".join(tool_call[1]))}
        )
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if tool_call else "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": cache_creation_tokens,
            "cache_read_input_tokens": cache_read_tokens,
            "output_tokens": _usage_counts(pieces, (), tool_call),
        },
    }


# --- Gemini --------------------------------------------------------------------


def _gemini_usage(output_tokens: int, input_tokens: int, cached_tokens: int) -> dict:
    usage = {
        "promptTokenCount": input_tokens,
        "candidatesTokenCount": output_tokens,
        "totalTokenCount": input_tokens + output_tokens,
    }
    if cached_tokens:
        usage["cachedContentTokenCount"] = cached_tokens
    return usage


def gemini_stream(
    pieces: Sequence[str],
    *,
    model: str = GEMINI_MODEL,
    input_tokens: int = 8,
    cached_tokens: int = 0,
) -> list[bytes]:
    """A `:streamGenerateContent?alt=sse` stream: one candidate chunk per piece, CRLF line ends.

    Each chunk carries the running `usageMetadata`; the last one has `finishReason`.
    """
    events = []
    for n, piece in enumerate(pieces, 1):
        candidate: dict[str, Any] = {"content": {"parts": [{"text": piece}], "role": "model"}, "index": 0}
        if n == len(pieces):
            candidate["finishReason"] = "STOP"
        body = {
            "candidates": [candidate],
            "usageMetadata": _gemini_usage(n, input_tokens, cached_tokens),
            "modelVersion": model,
        }
        events.append(sse_event(_json(body, spaced=True), newline="\r\n"))
    return events


def gemini_response(pieces: Sequence[str], *, model: str = GEMINI_MODEL, input_tokens: int = 8, cached_tokens: int = 0) -> dict:
    """The non-streamed `:generateContent` body for the same answer."""
    return {
        "candidates": [
            {"content": {"parts": [{"text": "".join(pieces)}], "role": "model"}, "finishReason": "STOP", "index": 0}
        ],
        "usageMetadata": _gemini_usage(len(pieces), input_tokens, cached_tokens),
        "modelVersion": model,
    }


# --- Errors ----------------------------------------------------------------------


def error_event(api: str, message: str = "The server had an error while processing your request.") -> bytes:
    """One in-stream error event as `api` (a `scope` API shape) reports it mid-stream."""
    if api == "anthropic.messages":
        return sse_event({"type": "error", "error": {"type": "overloaded_error", "message": message}}, "error")
    if api == "openai.responses":
        return sse_event(
            {"type": "error", "code": "server_error", "message": message, "param": None, "sequence_number": 99}, "error"
        )
    if api == "gemini":
        return sse_event({"error": {"code": 503, "message": message, "status": "UNAVAILABLE"}}, newline="\r\n")
    return sse_event({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


def error_body(api: str, message: str = "Rate limit reached.", status: int = 429) -> dict:
    """The JSON body of an HTTP error response (4xx/5xx) as `api` sends it."""
    if api == "anthropic.messages":
        kind = {429: "rate_limit_error", 529: "overloaded_error", 400: "invalid_request_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api == "gemini":
        return {"error": {"code": status, "message": message, "status": "RESOURCE_EXHAUSTED" if status == 429 else "INTERNAL"}}
    kind = {429: "rate_limit_exceeded", 400: "invalid_request_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


def too_long_body(api: str, prompt_tokens: int, window: int) -> dict:
    """The JSON body of a 400 refusing a prompt over the model's window, word for word as
    each API sends it (OpenAI Chat Completions names the window, the Responses API does not)."""
    if api == "anthropic.messages":
        return {"type": "error", "error": {"type": "invalid_request_error",
                                           "message": f"prompt is too long: {prompt_tokens} tokens > {window} maximum"},
                "request_id": "req_011CVjxiYzEFcAQC4Fk87zw2"}  # fmt: skip
    if api == "gemini":
        return {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message":
                          f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens allowed ({window})."}}
    if api == "openai.responses":
        message = "Your input exceeds the context window of this model. Please adjust your input and try again."
        return {"error": {"message": message, "type": "invalid_request_error", "param": "input",
                          "code": "context_length_exceeded"}}
    message = (f"This model's maximum context length is {window} tokens. However, your messages resulted in "
               f"{prompt_tokens} tokens. Please reduce the length of the messages.")
    return {"error": {"message": message, "type": "invalid_request_error", "param": "messages",
                      "code": "context_length_exceeded"}}
