"""OpenAI Chat Completions (`…/chat/completions`), and the error format most
OpenAI-compatible servers copy for every endpoint."""

from __future__ import annotations

from typing import Any

from .api import Api, ErrorFormat, error_code, model_and_stream_from_body

NAME = "openai.chat"


class OpenAIErrors(ErrorFormat):
    """`{"error": {"message", "type", "param", "code"}}`; in a stream, a data-only event
    whose object is that error."""

    def body(self, status: int, message: str) -> dict[str, Any]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": error_code(status)}}


API = Api(
    name=NAME,
    scope=r"/chat/completions/?(?:\?|$)",
    matches=lambda path: path.endswith("/chat/completions"),
    model_and_stream=model_and_stream_from_body,
    client_headers=(),
    websocket_turns=False,
    errors=OpenAIErrors(),
    semconv=("chat", "openai"),
)
