"""Which LLM API a request speaks, and what it asks for.

The relay only touches flows whose path matches its scope; within scope the path
decides the API shape, which in turn decides how the body is trimmed and how the
response stream is read. The functions are pure; the `Scope` addon at the end
applies them to flows and attaches the per-flow state the other addons share.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from mitmproxy import ctx, exceptions, http

from . import state

OPENAI_CHAT = "openai.chat"
OPENAI_RESPONSES = "openai.responses"
ANTHROPIC_MESSAGES = "anthropic.messages"
GEMINI = "gemini"
OTHER = "other"
"""In scope (e.g. /v1/embeddings) but no shape the relay understands: streamed and timed, never trimmed."""

API_SHAPES = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC_MESSAGES, GEMINI, OTHER)

DEFAULT_SCOPE = r"^/v1/|:streamGenerateContent"

_GEMINI_PATH = re.compile(r"/models/([^/:?]+):(stream)?[gG]enerateContent")


def api_shape(path: str) -> str:
    """The API shape of a request path (query string allowed)."""
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return OPENAI_CHAT
    if path.endswith("/responses"):
        return OPENAI_RESPONSES
    if path.endswith("/messages"):
        return ANTHROPIC_MESSAGES
    if _GEMINI_PATH.search(path):
        return GEMINI
    return OTHER


def model_and_stream(api: str, path: str, body: Any) -> tuple[str | None, bool]:
    """The model a request names and whether it asks for a streamed answer.

    `body` is the parsed JSON body, or anything else when it did not parse; a
    malformed body yields `(None, False)` rather than an error: the relay forwards
    what it does not understand.
    """
    if api == GEMINI:
        m = _GEMINI_PATH.search(path)
        return (m.group(1), bool(m.group(2))) if m else (None, False)
    if not isinstance(body, dict):
        return None, False
    model = body.get("model")
    return (model if isinstance(model, str) else None), body.get("stream") is True


class Scope:
    """Decides which flows are the relay's: attaches a `FlowState` to each request
    whose path matches `relay_scope`, and reads the model and stream flag from its
    body. Flows out of scope get no state, and every other relay addon leaves them
    alone."""

    def __init__(self) -> None:
        self.pattern = re.compile(DEFAULT_SCOPE)

    def load(self, loader) -> None:
        loader.add_option(
            "relay_scope",
            str,
            DEFAULT_SCOPE,
            "Regular expression over the request path (with query) that selects "
            "the flows the relay streams, times and trims.",
        )

    def configure(self, updated) -> None:
        if "relay_scope" in updated:
            try:
                self.pattern = re.compile(ctx.options.relay_scope)
            except re.error as e:
                raise exceptions.OptionsError(f"relay_scope is not a valid regex: {e}") from e

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        path = flow.request.path
        if self.pattern.search(path):
            state.attach(flow, state.FlowState(api=api_shape(path)))

    def request(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or flow.response is not None:
            # Already answered by the relay (e.g. refused): no body work for it.
            return
        st.request_json = parse_json_body(flow.request)
        st.model, st.stream = model_and_stream(st.api, flow.request.path, st.request_json)


def parse_json_body(request: http.Request) -> Any:
    """The request body as parsed JSON, or None when it is absent, undecodable or
    not JSON: the relay then forwards it untouched."""
    if request.raw_content is None:  # streamed request body: not ours to read
        return None
    try:
        body = request.get_content(strict=True)
        return orjson.loads(body) if body else None
    except ValueError:  # bad Content-Encoding or bad JSON (orjson.JSONDecodeError)
        return None
