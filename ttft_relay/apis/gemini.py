"""Google Gemini's native API (`…/models/<model>:generateContent` and
`:streamGenerateContent`): the model and the stream are in the path."""

from __future__ import annotations

import re
from typing import Any

from .api import Api, ErrorFormat

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


API = Api(
    name=NAME,
    scope=r":(?:stream)?[gG]enerateContent",
    matches=lambda path: _METHOD.search(path) is not None,
    model_and_stream=model_and_stream,
    client_headers=("x-goog-api-key",),
    websocket_turns=False,
    errors=GeminiErrors(),
    semconv=("generate_content", "gcp.gemini"),
)
