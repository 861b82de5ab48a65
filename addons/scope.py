"""Which LLM API a request speaks, and what it asks for (pure).

The relay only touches flows whose path matches its scope; within scope the path
decides the API shape, which in turn decides how the body is trimmed and how the
response stream is read.
"""

from __future__ import annotations

import re
from typing import Any

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
