"""Any other API in scope (e.g. `/v1/embeddings`): no shape the relay understands, so
it is streamed and timed, never trimmed, and answered in OpenAI's error format."""

from __future__ import annotations

from .reader import Reader
from .api import Api, model_and_stream_from_body, no_traits
from .openai_chat import OpenAIErrors

NAME = "other"

API = Api(
    name=NAME,
    scope=None,
    matches=lambda path: False,
    model_and_stream=model_and_stream_from_body,
    prefill_traits=no_traits,
    client_headers=(),
    key_headers=(),
    key_params=(),
    websocket_turns=None,
    trim_shape=None,
    windows=None,
    reader=Reader(),  # never a token (content cannot be told from metadata), but [DONE] and errors
    errors=OpenAIErrors(),
    semconv=("other", "other"),
    probe=None,
)
