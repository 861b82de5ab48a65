"""What one API module tells the relay (pure): the `Api` record and the parts it is made of.

Every field of `Api` is a part the relay asks every API for, none with a default, so a
module that forgets one fails when it is imported (None says, where allowed, that a part
does not apply: not trimmed, not probed); `tests/test_apis.py` checks that every module
in this package is registered and gives each part its proper type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .reader import Reader
from .shape import Shape


def error_code(status: int) -> str:
    """The relay's code for an error of this status: OpenAI-style `code`, and the
    `X-Relay-Error` header of every reply the relay makes itself."""
    return {401: "invalid_api_key", 413: "request_too_large", 504: "upstream_timeout"}.get(status, "upstream_error")


class ErrorFormat:
    """How an API reports an error, so that its SDKs raise their usual exceptions
    (authentication, rate limit, server error) for the replies the relay makes itself.

    Subclasses give `body`; a stream that breaks ends with `stream_error`, framed as
    an SSE event named `sse_event` ("" for a data-only event).
    """

    sse_event = ""

    def body(self, status: int, message: str) -> dict[str, Any]:
        """The error JSON for `status`, as the API's own servers send it."""
        raise NotImplementedError

    def stream_error(self, status: int, message: str, response_id: str | None) -> dict[str, Any]:
        """The event that ends a response which broke mid-stream, as the API ends one."""
        return self.body(status, message)

    def event(self, status: int, message: str, response_id: str | None) -> bytes:
        """The last SSE event of a stream that broke: the API's in-stream error."""
        head = f"event: {self.sse_event}\n".encode() if self.sse_event else b""
        return head + b"data: " + orjson.dumps(self.stream_error(status, message, response_id)) + b"\n\n"


def model_and_stream_from_body(path: str, body: Any) -> tuple[str | None, bool]:
    """The body's `model` and `stream: true`, where most APIs put them."""
    if not isinstance(body, dict):
        return None, False
    model = body.get("model")
    return (model if isinstance(model, str) else None), body.get("stream") is True


def traits(*, effort: Any = None, budget: Any = None, tools: Any = None) -> str:
    """A request's prefill traits as words: a reasoning effort as named (a short word), a
    thinking budget and the tools' JSON size each as a size class (powers of 4), so that
    requests that take about as long share a first-token line."""
    words = []
    if isinstance(effort, str) and effort:
        words.append(f"effort {effort[:16]}")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        words.append(f"thinking ≤{_size_class(budget)} tokens")
    if isinstance(tools, list) and tools:
        try:
            size = len(orjson.dumps(tools))
        except TypeError:
            size = 0
        words.append(f"tools ≤{_size_class(max(1, size // 1024))} kB")
    return " · ".join(words)


def _size_class(n: int) -> int:
    """The power of 4 at or above `n` (at least 1): a class a few more bytes or tokens do not change."""
    bucket = 1
    while bucket < n:
        bucket *= 4
    return bucket


def as_dict(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one: nested fields read without checks."""
    return value if isinstance(value, dict) else {}


def no_traits(body: Any) -> str:
    """`Api.prefill_traits` of an API whose requests carry none the relay reads."""
    return ""


@dataclass(frozen=True, slots=True)
class Turns:
    """How the turns of the API's WebSocket start; a turn's events are read by the API's
    reader and its terminal event ends it."""

    request: Callable[[bytes], dict[str, Any] | None]
    """A client message → its JSON if it starts a turn, else None (never raises)."""
    model: Callable[[dict[str, Any]], str | None]
    """The model a turn's request names."""
    prewarm: Callable[[dict[str, Any]], bool]
    """The request only warms the session up: no output is asked for."""
    server_started: Callable[[bytes], bool]
    """A server message that opens a turn the server started on its own."""
    start: Callable[[dict[str, Any]], bytes]
    """The client message that starts a turn asking what an HTTP request's JSON body asks
    (`ttft-relay diagnose --transport websocket`, and a trimmed turn)."""
    continues: Callable[[dict[str, Any]], str | None] = lambda body: None
    """The id of the response a turn's request continues (its history is that response's
    input and output, kept by the upstream), or None: the request carries all of it."""
    completed: Callable[[bytes], tuple[str, list] | None] = lambda content: None
    """A server message completing a response → its id and output items, else None."""
    refusal: Callable[[bytes], tuple[int, bytes] | None] = lambda content: None
    """A server message failing a turn → its status and error as the HTTP error body
    (for `Windows.too_long`), else None."""


@dataclass(frozen=True)
class Probe:
    """How `ttft-relay diagnose` calls the API: endpoint, key, defaults, and the body of
    a streamed call with a handful of output tokens. Subclasses change what differs."""

    name: str
    """The API's name (`Api.name`)."""
    path: str
    key_env: str
    """Environment variable holding the upstream key."""
    default_upstream: str
    default_model: str
    max_tokens_field: str

    def auth_headers(self, key: str | None) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {key}")] if key else []

    def body(self, prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], self.max_tokens_field: max_tokens}
        return self.streamed(body)

    def streamed(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with streaming switched on."""
        return {**body, "stream": True}


@dataclass(frozen=True, slots=True)
class TooLong:
    """An upstream's refusal of a prompt longer than the model takes, read from its error.
    Each number is what the provider's message says (None: it does not say)."""

    max_input: int | None
    """The most prompt tokens the model takes (Anthropic's and Gemini's "maximum")."""
    window: int | None
    """The most tokens of prompt and answer together (OpenAI's "maximum context length")."""
    prompt_tokens: int | None
    """The provider's own count of the refused prompt."""
    output_tokens: int | None
    """The answer tokens the request asked for, as the provider counted them."""
    kind: str
    """The provider's own structured word for the error (`error.code`, `error.type` or
    `error.status`), which said it was this refusal: for the record of what was learned."""

    @property
    def limit_given(self) -> bool:
        """The error says how long a prompt may be: the relay can trim to it."""
        return self.max_input is not None or self.window is not None


_SNAPSHOT = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")
"""A dated snapshot of a model (`gpt-4o-2024-08-06`, `claude-sonnet-4-5-20250929`): the same model."""


def model_id(model: str | None) -> str:
    """Lower-case model name without a routing prefix ("openai/gpt-4o" -> "gpt-4o")."""
    return (model or "").rsplit("/", 1)[-1].lower()


@dataclass(frozen=True)
class Windows:
    """What the relay knows for certain of a provider's context windows, and how the
    provider says that a prompt is too long.

    Only exact model ids (and their dated snapshots) are known: a family prefix is not
    certainty, a new model of a known family is unknown (its window is learned from the
    provider's refusal, `TooLong`, or set by the user).
    """

    known: Mapping[str, int]
    """Exact model id → context window (prompt and answer together), from the provider's model pages."""
    max_input: Mapping[str, int]
    """Exact model id → most prompt tokens, where the API takes fewer than window minus output."""
    long_context: Mapping[str, int]
    """Exact model id → window when the request opens the long context (`Shape.long_context`)."""
    too_long: Callable[[int, bytes], TooLong | None]
    """(status, error body) → the refusal, if the upstream refused the prompt as too long; never raises."""

    def lookup(self, table: Mapping[str, int], model: str | None) -> int | None:
        name = model_id(model)
        found = table.get(name)
        return found if found is not None else table.get(_SNAPSHOT.sub("", name))

    def window(self, model: str | None, *, long_context: bool = False) -> int | None:
        """The model's window if the relay knows it, else None."""
        long = self.lookup(self.long_context, model) if long_context else None
        return long if long is not None else self.lookup(self.known, model)


def error_object(body: bytes) -> dict[str, Any] | None:
    """The `error` object of an error body as OpenAI, Anthropic and Google send it (None if not one)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(obj, list) and obj:  # Google's REST errors sometimes come as a one-element array
        obj = obj[0]
    error = obj.get("error") if isinstance(obj, dict) else None
    return error if isinstance(error, dict) else None


def error_field(body: bytes, name: str) -> str | None:
    """A string field of the body's `error` object (`message`, `code`, `type`, `status`)."""
    value = (error_object(body) or {}).get(name)
    return value if isinstance(value, str) else None


def error_message(body: bytes) -> str | None:
    """`error.message` of an error body as OpenAI, Anthropic and Google send it (None if not one)."""
    return error_field(body, "message")


def number(match: re.Match[str] | None, group: int = 1) -> int | None:
    return int(match.group(group)) if match is not None else None


@dataclass(frozen=True, slots=True)
class Api:
    """Everything the relay knows about one API shape."""

    name: str
    """The shape's name in records and metrics (`api`): "openai.chat"."""
    scope: str | None
    """Regular expression (over the path with its query) of the API's endpoint under any
    prefix, one alternative of the default `relay_scope`; None: found by the version
    segment alone."""
    matches: Callable[[str], bool]
    """Whether a request path (query and trailing slash removed) speaks this API."""
    model_and_stream: Callable[[str, Any], tuple[str | None, bool]]
    """(path with query, parsed JSON body or anything else) → the model the request
    names and whether it asks for a streamed answer; never raises."""
    prefill_traits: Callable[[Any], str]
    """Parsed JSON body (or anything else) → what of the request changes how long the
    model takes to its first token beyond the prompt's tokens (reasoning effort or
    thinking budget, the tools' schema size: `traits`), as words for the first-token
    line's key; "" for none. Never raises."""
    client_headers: tuple[str, ...]
    """Request headers only this API's clients send: before scope has read a path, the
    guard answers a refusal in this API's error format when one is present."""
    key_headers: tuple[str, ...]
    """Request headers its clients put their API key in (`authorization` as a Bearer
    token, the others bare): where the guard looks for a relay key and puts the upstream's."""
    key_params: tuple[str, ...]
    """Query parameters its clients may put their API key in instead."""
    websocket_turns: Turns | None
    """How its WebSocket's turns start, each timed like a request; None: its sockets only pass."""
    trim_shape: Shape | None
    """How its requests lay out a conversation, for trimming; None: never trimmed."""
    windows: Windows | None
    """Its models' context windows the relay knows, and how its refusals of a too long
    prompt read; None: no model of it is trimmed by a window."""
    reader: Reader
    """What its stream's events mean: first and last token, usage, errors, the end."""
    errors: ErrorFormat
    semconv: tuple[str, str]
    """(gen_ai.operation.name, gen_ai.provider.name) of the OpenTelemetry GenAI
    conventions, for the metrics' labels."""
    probe: Probe | None
    """How `ttft-relay diagnose` calls it; None: not probed."""
