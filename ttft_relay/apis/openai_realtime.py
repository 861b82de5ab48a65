"""OpenAI Realtime (`…/realtime`): a WebSocket only, its turns timed like Responses
WebSocket turns, each ending in `response.done`."""

from __future__ import annotations

from typing import Any

from .api import Api, error_code, model_and_stream_from_body
from .openai_chat import OpenAIErrors

NAME = "openai.realtime"


class RealtimeErrors(OpenAIErrors):
    """OpenAI's error object; a turn that broke ends with an `error` server event."""

    def stream_error(self, status: int, message: str, response_id: str | None) -> dict[str, Any]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"type": "error", "error": {"type": kind, "code": error_code(status), "message": message}}


API = Api(
    name=NAME,
    scope=r"/realtime/?(?:\?|$)",
    matches=lambda path: path.endswith("/realtime"),
    model_and_stream=model_and_stream_from_body,
    client_headers=(),
    websocket_turns=True,
    errors=RealtimeErrors(),
    semconv=("chat", "openai"),
)
