"""OpenAI Responses (`…/responses`), over HTTP with SSE and over a WebSocket (Codex
CLI's transport: one `response.create` message per turn, answered by the events an SSE
stream would carry)."""

from __future__ import annotations

from typing import Any

from .api import Api, error_code, model_and_stream_from_body
from .openai_chat import OpenAIErrors

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


API = Api(
    name=NAME,
    scope=r"/responses/?(?:\?|$)",
    matches=lambda path: path.endswith("/responses"),
    model_and_stream=model_and_stream_from_body,
    client_headers=(),
    websocket_turns=True,
    errors=ResponsesErrors(),
    semconv=("chat", "openai"),
)
