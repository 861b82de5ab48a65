"""Errors in each API's own format (pure), for the replies the relay makes itself.

SDKs turn a JSON error in their API's shape into their usual exception classes
(authentication, rate limit, server error); anything else becomes a decode error
the user cannot act on. Used by the guard (refused keys) and by faults (upstream
failures before and after the response head).
"""

from __future__ import annotations

from typing import Any

import orjson
from mitmproxy import http

from .. import scope


def error_code(status: int) -> str:
    """OpenAI-style `code` for a relay error of this status."""
    return {401: "invalid_api_key", 413: "request_too_large", 504: "upstream_timeout"}.get(status, "upstream_error")


def error_object(api: str, status: int, message: str) -> dict[str, Any]:
    """The API's error JSON for `status` (what its own servers send)."""
    if api == scope.ANTHROPIC_MESSAGES:
        kind = {401: "authentication_error", 413: "request_too_large", 504: "timeout_error"}.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api == scope.GEMINI:
        grpc = {401: "UNAUTHENTICATED", 504: "DEADLINE_EXCEEDED"}.get(status, "UNAVAILABLE")
        return {"error": {"code": status, "message": message, "status": grpc}}
    # OpenAI, and the shape most OpenAI-compatible servers copy for everything else.
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": error_code(status)}}


def error_response(api: str, status: int, message: str, headers: dict[str, str] | None = None) -> http.Response:
    """A complete JSON error response in the API's format."""
    return http.Response.make(
        status,
        orjson.dumps(error_object(api, status, message)),
        {"content-type": "application/json", **(headers or {})},
    )


RELAY_RESPONSE_ID = "resp_ttft_relay_error"
"""The id of a failed response whose own id the relay never saw."""


def stream_error(api: str, status: int, message: str, response_id: str | None = None) -> dict[str, Any]:
    """The event that ends a response which broke mid-stream, as the API itself ends one.

    Responses: `response.failed` with the error object — the terminal event clients act
    on (Codex reads a bare `error` event as a stream that closed before
    `response.completed`, and retries); Realtime: an `error` event.
    """
    if api == scope.OPENAI_RESPONSES:
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
    if api == scope.OPENAI_REALTIME:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"type": "error", "error": {"type": kind, "code": error_code(status), "message": message}}
    return error_object(api, status, message)


def error_event(api: str, status: int, message: str, response_id: str | None = None) -> bytes:
    """The last SSE event of a stream that broke: the API's in-stream error."""
    data = orjson.dumps(stream_error(api, status, message, response_id))
    if api == scope.ANTHROPIC_MESSAGES:
        return b"event: error\ndata: " + data + b"\n\n"
    if api == scope.OPENAI_RESPONSES:
        return b"event: response.failed\ndata: " + data + b"\n\n"
    # Chat Completions and Gemini: a data-only event whose object is the error.
    return b"data: " + data + b"\n\n"
