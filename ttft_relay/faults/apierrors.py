"""Errors in each API's own format, for the replies the relay makes itself.

SDKs turn a JSON error in their API's shape into their usual exception classes
(authentication, rate limit, server error); anything else becomes a decode error
the user cannot act on. Each format is its API module's (`ttft_relay/apis/`); these
functions take the flow's `Api` (`FlowState.api`, or the guard's choice for a refusal). Used by scope (bodies too large), the guard
(refused keys) and faults (upstream failures before and after the response head).
"""

from __future__ import annotations

from typing import Any

import orjson
from mitmproxy import http

from ..apis.api import Api, error_code

__all__ = ["error_code", "error_object", "error_response", "stream_error", "error_event"]


def error_object(api: Api, status: int, message: str) -> dict[str, Any]:
    """The API's error JSON for `status` (what its own servers send)."""
    return api.errors.body(status, message)


def error_response(api: Api, status: int, message: str, headers: dict[str, str] | None = None) -> http.Response:
    """A complete JSON error response in the API's format."""
    return http.Response.make(
        status,
        orjson.dumps(error_object(api, status, message)),
        {"content-type": "application/json", **(headers or {})},
    )


def stream_error(api: Api, status: int, message: str, response_id: str | None = None) -> dict[str, Any]:
    """The event that ends a response which broke mid-stream, as the API itself ends one
    (Responses: `response.failed`; Realtime: an `error` event)."""
    return api.errors.stream_error(status, message, response_id)


def error_event(api: Api, status: int, message: str, response_id: str | None = None) -> bytes:
    """The last SSE event of a stream that broke: the API's in-stream error."""
    return api.errors.event(status, message, response_id)
