"""Anthropic Messages (`…/messages`, under Anthropic-compatible base URLs too)."""

from __future__ import annotations

from typing import Any

from .api import Api, ErrorFormat, model_and_stream_from_body

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


API = Api(
    name=NAME,
    scope=r"/messages/?(?:\?|$)",
    matches=matches,
    model_and_stream=model_and_stream_from_body,
    client_headers=("anthropic-version",),
    websocket_turns=False,
    errors=AnthropicErrors(),
    semconv=("chat", "anthropic"),
)
