"""Google Gemini's native API (`…/models/<model>:generateContent` and
`:streamGenerateContent`): the model and the stream are in the path."""

from __future__ import annotations

import re
from typing import Any

import orjson

from .reader import Event, Reader, Transcript, Watcher, as_int, as_str, counts, dig, loads
from .api import Api, ErrorFormat, TooLong, Windows, as_dict, error_field, number, traits

NAME = "gemini"

_METHOD = re.compile(r"/models/([^/:?]+):(stream)?[gG]enerateContent")


def model_and_stream(path: str, body: Any) -> tuple[str | None, bool]:
    m = _METHOD.search(path)
    return (m.group(1), bool(m.group(2))) if m else (None, False)


class GeminiErrors(ErrorFormat):
    """Google's `{"error": {"code", "message", "status"}}`, in a stream as a data-only event."""

    def body(self, status: int, message: str) -> dict[str, Any]:
        grpc = {401: "UNAUTHENTICATED", 504: "DEADLINE_EXCEEDED"}.get(status, "UNAVAILABLE")
        return {"error": {"code": status, "message": message, "status": grpc}}


class GeminiReader(Reader):
    """Gemini `:streamGenerateContent?alt=sse`: `data:` JSON chunks with candidates and running usageMetadata."""

    _TOKEN = re.compile(rb'"text"\s*:\s*"[^"]|"functionCall"')

    def is_token(self, event: Event) -> bool:
        return any(
            (isinstance(part.get("text"), str) and part["text"]) or part.get("functionCall")
            for part in _gemini_parts(loads(event.data))
        )

    def looks_like_token(self, event: Event) -> bool:
        return self._TOKEN.search(event.data) is not None

    def recognizes(self, event: Event) -> bool:
        return b'"candidates"' in event.data

    def observe(self, event: Event, watcher: Watcher) -> None:
        data = event.data
        # Every chunk may repeat the running totals: keep the latest, decode it once at the end.
        if b'"usageMetadata"' in data:
            watcher.keep_usage("final", data)
        if b'"finishReason"' in data:
            watcher.done = True
        self.observe_top_level_error(event, watcher)

    def usage(self, source: str, obj: Any) -> dict | None:
        return dig(obj, "usageMetadata")

    def body_usage(self, body: Any) -> dict | None:
        # streamGenerateContent without alt=sse answers a JSON array of chunks.
        if isinstance(body, list):
            return next((u for u in map(self.body_usage, reversed(body)) if u), None)
        return dig(body, "usageMetadata")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        # Gemini counts thoughts apart from candidates; the relay's output includes reasoning, as OpenAI's does.
        candidates = as_int(raw.get("candidatesTokenCount"))
        thoughts = as_int(raw.get("thoughtsTokenCount"))
        output = None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0)
        return counts(
            input_tokens=as_int(raw.get("promptTokenCount")),
            output_tokens=output,
            cached_tokens=as_int(raw.get("cachedContentTokenCount")),
            reasoning_tokens=thoughts,
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        for part in _gemini_parts(obj):
            if isinstance(part.get("text"), str):
                out.add(out.reasoning_parts if part.get("thought") else out.text_parts, part["text"])
            elif isinstance(part.get("functionCall"), dict):
                # Gemini sends a call whole, its args already parsed.
                call = out.call(len(out.calls))
                call.name = as_str(part["functionCall"].get("name"))
                call.arguments = orjson.dumps(part["functionCall"].get("args") or {}).decode()


def _gemini_parts(obj: Any) -> list[dict]:
    candidates = dig(obj, "candidates")
    if not isinstance(candidates, list):
        return []
    return [
        part
        for candidate in candidates
        if isinstance(parts := dig(candidate, "content", "parts"), list)
        for part in parts
        if isinstance(part, dict)
    ]


_TOO_LONG = re.compile(r"The input token count (?:\((\d+)\) )?exceeds the maximum number of tokens allowed \((\d+)\)")


REFUSAL_STATUS = "INVALID_ARGUMENT"


def too_long(status: int, body: bytes) -> TooLong | None:
    """Google's 400 `INVALID_ARGUMENT` whose message begins "The input token count (1200293)
    exceeds the maximum number of tokens allowed (1048576)." (the count is sometimes left out)."""
    if status != 400 or error_field(body, "status") != REFUSAL_STATUS:
        return None
    m = _TOO_LONG.match(error_field(body, "message") or "")
    if m is None:
        return None
    return TooLong(max_input=int(m.group(2)), window=None, prompt_tokens=number(m) if m.group(1) else None,
                   output_tokens=None, kind=REFUSAL_STATUS)


def prefill_traits(body: Any) -> str:
    """`generationConfig.thinkingConfig`'s budget or level, and the tools' size."""
    body = as_dict(body)
    thinking = as_dict(as_dict(body.get("generationConfig")).get("thinkingConfig"))
    return traits(effort=thinking.get("thinkingLevel"), budget=thinking.get("thinkingBudget"), tools=body.get("tools"))


API = Api(
    name=NAME,
    scope=r":(?:stream)?[gG]enerateContent",
    matches=lambda path: _METHOD.search(path) is not None,
    model_and_stream=model_and_stream,
    prefill_traits=prefill_traits,
    client_headers=("x-goog-api-key",),
    key_headers=("x-goog-api-key",),
    key_params=("key",),
    websocket_turns=None,
    trim_shape=None,
    # Not trimmed (no trim shape yet): its refusals are read for the record and the learned windows.
    windows=Windows(known={}, max_input={}, long_context={}, too_long=too_long),
    reader=GeminiReader(),
    errors=GeminiErrors(),
    semconv=("generate_content", "gcp.gemini"),
    probe=None,
)
