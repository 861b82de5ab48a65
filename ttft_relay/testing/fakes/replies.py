"""What the fake upstream answers to each API request, before any knob shapes the delivery.

The bodies come from `ttft_relay/testing/sse_samples.py`, so the fake and the parser tests
agree on the wire format; the request's model is echoed back. A streamed reply is
a list of SSE events (the fake writes one per HTTP chunk); a non-streamed reply is
one JSON body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ttft_relay.testing import sse_samples

OPENAI_CHAT = "openai.chat"
OPENAI_RESPONSES = "openai.responses"
ANTHROPIC_MESSAGES = "anthropic.messages"
GEMINI = "gemini"
"""API shape names, spelled as `ttft_relay/apis/` spells them (the fakes do not import the relay)."""

THINKING_PIECES = ("Pondering", " the greeting.")
"""The thinking block's pieces, for requests that ask for thinking (see `_thinking_pieces`)."""

_GEMINI_PATH = re.compile(r"/models/([^/:]+):(streamGenerateContent|generateContent)$")


def answer_pieces(count: int) -> list[str]:
    """The text pieces the fake streams: "Hello", " t1", " t2", ... (`count` of them).

    The first piece is unique in every body so the fake can find the first event
    that carries answer text (where the prefill delay goes).
    """
    return ["Hello"][:count] + [f" t{i}" for i in range(1, count)]


def answer_text(count: int) -> str:
    """The full answer text a client should assemble from a reply of `count` pieces."""
    return "".join(answer_pieces(count))


@dataclass(frozen=True)
class Reply:
    """A response to send: status, content type and the body in the chunks it is written in."""

    status: int
    content_type: str
    chunks: list[bytes]
    streamed: bool
    first_token_chunk: int = 0
    """Index of the first chunk carrying answer text or thinking (the prefill delay goes before it); 0 if none does."""


@dataclass(frozen=True)
class _Endpoint:
    api: str
    stream_body: Callable[..., list[bytes]]
    json_body: Callable[..., dict]


_ENDPOINTS = {
    "/chat/completions": _Endpoint(OPENAI_CHAT, sse_samples.openai_chat_stream, sse_samples.openai_chat_completion),
    "/responses": _Endpoint(OPENAI_RESPONSES, sse_samples.responses_stream, sse_samples.responses_response),
    "/messages": _Endpoint(ANTHROPIC_MESSAGES, sse_samples.anthropic_stream, sse_samples.anthropic_message),
}
"""By the path's last segments, under any prefix: /v1/..., as providers also serve them
(/openai/deployments/<d>/chat/completions, /backend-api/codex/responses, /anthropic/v1/messages)."""
BODILESS_STATUSES = (204, 304)


def _endpoint(path: str) -> _Endpoint | None:
    return next((e for suffix, e in _ENDPOINTS.items() if path.endswith(suffix)), None)
_GEMINI_ENDPOINT = _Endpoint(GEMINI, sse_samples.gemini_stream, sse_samples.gemini_response)

_MODELS_LIST = {
    "object": "list",
    "data": [
        {"id": model, "object": "model", "created": sse_samples.CREATED, "owned_by": "fake-upstream"}
        for model in (sse_samples.OPENAI_MODEL, sse_samples.ANTHROPIC_MODEL, sse_samples.GEMINI_MODEL)
    ],
}


def json_reply(status: int, body: Any) -> Reply:
    """A non-streamed `application/json` reply."""
    return Reply(status, "application/json", [json.dumps(body).encode()], streamed=False)


CHARS_PER_TOKEN = 4
"""The usual rough estimate; good enough to make prefill and usage grow with the prompt's size."""


def prompt_tokens(body: bytes, cached: int = 0) -> tuple[int, int]:
    """(all, cached) prompt tokens of a request body, as the fake's usage reports them."""
    tokens = max(1, round(len(body) / CHARS_PER_TOKEN))
    return tokens, min(cached, tokens)


@dataclass(frozen=True)
class ToolLoop:
    """An agent loop: while a request carries fewer than `rounds` tool results, the answer is a
    call of the tool `name` with the JSON `arguments` (`{n}` in them replaced by the round, 0,
    1, ...); then the text answer. Each answer has its own ids, which number the rounds: a
    request whose older rounds a relay left out is still in the round after its newest call."""

    name: str
    arguments: str
    rounds: int

    @classmethod
    def parse(cls, call: str | None, rounds: int) -> ToolLoop | None:
        """From the knobs: `call` is the name, a space, the arguments ("Read {"file_path": "f{n}"}")."""
        if not call or rounds <= 0:
            return None
        name, _, arguments = call.partition(" ")
        return cls(name, arguments or "{}", rounds)


_LOOP_CALL_ID = re.compile(rb"(?:toolu|call)_fake(\d{1,9})")
"""The ids of the loop's calls (`toolu_fake3`, `call_fake3`), numbered by round."""


def loop_round(body: bytes, request: dict, api: str = OPENAI_RESPONSES) -> int:
    """The agent loop's round a request is in: the one after its newest call (a request whose
    older rounds were left out is still there), else its count of tool results."""
    return max((int(m) + 1 for m in _LOOP_CALL_ID.findall(body)), default=tool_results(api, request))


def tool_results(api: str, request: dict) -> int:
    """How many tool results the request's conversation carries."""
    if api == ANTHROPIC_MESSAGES:
        messages = request.get("messages") or []
        return sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                   for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result")
    if api == OPENAI_RESPONSES:
        items = request.get("input")
        return sum(1 for i in items if isinstance(i, dict) and str(i.get("type", "")).endswith("_call_output")) \
            if isinstance(items, list) else 0
    if api == OPENAI_CHAT:
        return sum(1 for m in request.get("messages") or [] if isinstance(m, dict) and m.get("role") == "tool")
    return 0


def build_reply(method: str, target: str, body: bytes, pieces: Sequence[str], status: int, error_body: str | None,
                cached_tokens: int = 0, window: int | None = None, loop: ToolLoop | None = None) -> Reply:
    """The reply to one request. `status` >= 400 answers with an error body in the API's own format
    (`error_body` verbatim when given); other statuses send the normal body with that status. Its
    usage reports the body's size as prompt tokens (`prompt_tokens`), `cached_tokens` of them cached.
    A request over `window` tokens (body bytes / 4) is refused as too long, in the API's words.
    With a `loop`, the answer is its tool call until the request carries its rounds of results."""
    split = urlsplit(target)
    gemini = _GEMINI_PATH.search(split.path)
    if method == "GET" and split.path == "/v1/models":
        return json_reply(200, _MODELS_LIST)
    if method == "POST" and split.path.endswith("/messages/count_tokens"):  # Claude Code asks it of big tool results
        return json_reply(200, {"input_tokens": len(body) // CHARS_PER_TOKEN})
    endpoint = _GEMINI_ENDPOINT if gemini else _endpoint(split.path)
    if method == "HEAD" and endpoint is not None:  # a head like a stream's, and (as for any HEAD) no body
        return Reply(200, "text/event-stream; charset=utf-8", [], streamed=False)
    if method != "POST" or endpoint is None:
        return json_reply(404, sse_samples.error_body(OPENAI_CHAT, f"No fake route for {method} {split.path}", 404))
    if status in BODILESS_STATUSES:
        return Reply(status, "application/json", [], streamed=False)
    if window is not None and len(body) // CHARS_PER_TOKEN > window:
        return json_reply(400, sse_samples.too_long_body(endpoint.api, len(body) // CHARS_PER_TOKEN, window))
    if status >= 400:
        error = error_body.encode() if error_body is not None else json.dumps(_error(endpoint.api, status)).encode()
        return Reply(status, "application/json", [error], streamed=False)
    try:
        request = json.loads(body)
    except ValueError:
        return json_reply(400, sse_samples.error_body(endpoint.api, "The request body is not valid JSON.", 400))
    if not isinstance(request, dict):
        return json_reply(400, sse_samples.error_body(endpoint.api, "The request body must be a JSON object.", 400))

    if gemini:
        model, streamed = gemini.group(1), gemini.group(2) == "streamGenerateContent"
        # Gemini streams SSE only with ?alt=sse; without it, it sends a JSON array, which this fake does not.
        if streamed and parse_qs(split.query).get("alt") != ["sse"]:
            return json_reply(400, sse_samples.error_body(GEMINI, "This fake streams only with ?alt=sse.", 400))
    else:
        model, streamed = request.get("model"), request.get("stream") is True
    model_kw: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    model_kw |= usage_kw(endpoint.api, *prompt_tokens(body, cached_tokens))
    if loop is not None and not gemini:
        n = loop_round(body, request, endpoint.api)
        if endpoint.api != OPENAI_CHAT:  # each answer its own id (Claude Code merges the blocks of one id)
            model_kw["id"] = f"msg_fake{n}" if endpoint.api == ANTHROPIC_MESSAGES else f"resp_fake{n}"
        if n < loop.rounds:
            pieces = []
            model_kw["tool_call"] = (loop.name, [loop.arguments.replace("{n}", str(n))])
            model_kw["tool_id"] = f"toolu_fake{n}" if endpoint.api == ANTHROPIC_MESSAGES else f"call_fake{n}"

    if not streamed:
        return Reply(status, "application/json", [json.dumps(endpoint.json_body(pieces, **model_kw)).encode()],
                     streamed=False)
    thinking = _thinking_pieces(endpoint.api, request)
    events = endpoint.stream_body(pieces, **model_kw, **({"thinking": thinking} if thinking else {}))
    return Reply(status, "text/event-stream; charset=utf-8", events, streamed=True,
                 first_token_chunk=_first_chunk_with(events, thinking or pieces))


def usage_kw(api: str, tokens: int, cached: int) -> dict[str, int]:
    """The sample bodies' usage arguments: Anthropic counts the cached part apart from its
    `input_tokens`, the others within it."""
    if api == ANTHROPIC_MESSAGES:
        return {"input_tokens": tokens - cached, "cache_read_tokens": cached}
    return {"input_tokens": tokens, "cached_tokens": cached}


def _thinking_pieces(api: str, request: dict) -> list[str]:
    """A streamed Anthropic request with extended thinking on (Claude Code asks for `adaptive`) is
    answered with a thinking block before the text, as the API does; its first piece is the first token."""
    thinking = request.get("thinking")
    if api == ANTHROPIC_MESSAGES and isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"):
        return list(THINKING_PIECES)
    return []


def _error(api: str, status: int) -> dict:
    message = "Rate limit reached for requests (fake)." if status == 429 else f"Fake upstream error {status}."
    return sse_samples.error_body(api, message, status)


def _first_chunk_with(chunks: list[bytes], pieces: Sequence[str]) -> int:
    if not pieces:
        return 0
    marker = json.dumps(pieces[0], ensure_ascii=False)[1:-1].encode()
    return next((i for i, chunk in enumerate(chunks) if marker in chunk), 0)
