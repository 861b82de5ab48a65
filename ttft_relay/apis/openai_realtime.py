"""OpenAI Realtime (`…/realtime`): a WebSocket only, its turns timed like Responses
WebSocket turns, each ending in `response.done`."""

from __future__ import annotations

from typing import Any

from .reader import Event, Watcher, as_int, counts, dig, loads, reported_error, type_of
from .api import Api, error_code, no_traits, model_and_stream_from_body
from .openai_chat import OpenAIErrors
from .openai_responses import TURNS, ResponsesReader

NAME = "openai.realtime"


class RealtimeErrors(OpenAIErrors):
    """OpenAI's error object; a turn that broke ends with an `error` server event."""

    def stream_error(self, status: int, message: str, response_id: str | None) -> dict[str, Any]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"type": "error", "error": {"type": kind, "code": error_code(status), "message": message}}


class RealtimeReader(ResponsesReader):
    """The Realtime API's WebSocket (`/v1/realtime`): a turn's server events end in
    `response.done`; output is text, audio or an audio transcript, in the GA names
    and the beta's."""

    TOKEN_TYPES = frozenset(
        {
            "response.output_text.delta",
            "response.output_audio.delta",
            "response.output_audio_transcript.delta",
            "response.text.delta",
            "response.audio.delta",
            "response.audio_transcript.delta",
            "response.function_call_arguments.delta",
        }
    )
    TERMINAL_TYPES = frozenset({"response.done"})

    def observe(self, event: Event, watcher: Watcher) -> None:
        kind = type_of(event)
        if kind in self.TERMINAL_TYPES:
            watcher.done = True
            watcher.keep_usage("final", event.data)
            if dig(loads(event.data), "response", "status") == "failed":
                watcher.set_error(dig(loads(event.data), "response", "status_details", "error") or "response failed")
        elif kind == "error":
            watcher.set_error(reported_error(event))

    def normalize(self, raw: dict) -> dict[str, int] | None:
        return counts(
            input_tokens=as_int(raw.get("input_tokens")),
            output_tokens=as_int(raw.get("output_tokens")),
            cached_tokens=as_int(dig(raw, "input_token_details", "cached_tokens")),
        )


API = Api(
    name=NAME,
    scope=r"/realtime/?(?:\?|$)",
    matches=lambda path: path.endswith("/realtime"),
    model_and_stream=model_and_stream_from_body,
    prefill_traits=no_traits,
    client_headers=(),
    key_headers=("authorization", "api-key"),  # api-key: Azure OpenAI
    key_params=(),
    websocket_turns=TURNS,
    trim_shape=None,
    windows=None,
    reader=RealtimeReader(),
    errors=RealtimeErrors(),
    semconv=("chat", "openai"),
    probe=None,
)
