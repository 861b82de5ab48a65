"""The APIs the relay understands: one module each, everything it knows about that API.

Each module ends in an `API` record (`api.Api`): its path match and part of the default
scope, where its model and stream flag are, where its clients put their key, its stream
reader, its trim shape, its WebSocket turns, its error format, its metric names and its
diagnose probe. The parts' base classes are here too (`api.py`, `reader.py`, `shape.py`):
this package imports nothing else of the relay's.

This registry is asked only where an API is chosen: scope resolves each request's API
once, by its path, and puts the `Api` on the flow's state, where the SSE watcher finds
its reader, the trimmer its shape, websocket its turns, faults its error format, timing
and the metrics its name; the guard asks it whose error format a refusal before scope
takes and where keys travel, the event-stream view what a flow scope never saw speaks,
diagnose what it probes. Adding an API is adding a module and listing it in `ALL`
(`tests/test_apis.py` fails for a module that is not listed or lacks a part).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from . import anthropic_messages, gemini, openai_chat, openai_realtime, openai_responses, other
from .api import Api
from .reader import Event

ALL: tuple[Api, ...] = (
    openai_responses.API,
    anthropic_messages.API,
    openai_chat.API,
    openai_realtime.API,
    gemini.API,
)
"""The APIs a path can match (their paths exclude each other). The order is the one
streams are recognised in (`for_events`): typed events first, since the marks of a
Chat Completions chunk (`"choices"`) can appear in a Responses event's echo of the
request; the default scope lists their endpoints in this order too."""

OTHER_API = other.API
"""In scope, no API it matches: streamed and timed, never trimmed."""

OPENAI_CHAT = openai_chat.NAME
OPENAI_RESPONSES = openai_responses.NAME
OPENAI_REALTIME = openai_realtime.NAME
ANTHROPIC_MESSAGES = anthropic_messages.NAME
GEMINI = gemini.NAME
OTHER = other.NAME

NAMES = (*(api.name for api in ALL), OTHER)
"""Every value a record's `api` can have."""

_BY_NAME = {api.name: api for api in (*ALL, OTHER_API)}


def get(name: str) -> Api:
    """The API of this name; `OTHER_API` for a name the relay does not know."""
    return _BY_NAME.get(name, OTHER_API)


def for_path(path: str) -> Api:
    """The API a request path (query string allowed) speaks, by the endpoint it ends
    in, whatever prefix the provider puts in front of it."""
    path = path.split("?", 1)[0].rstrip("/")
    return next((api for api in ALL if api.matches(path)), OTHER_API)


def for_events(events: Iterable[Event]) -> Api:
    """The API a stream speaks, guessed from its events when its request is unknown: the
    first API whose reader recognizes an event (in `ALL`'s order); `OTHER_API` if none does."""
    for event in events:
        for api in ALL:
            if api.reader.recognizes(event):
                return api
    return OTHER_API


KEY_HEADERS = tuple(dict.fromkeys(h for api in ALL for h in api.key_headers))
"""Every request header some API's clients put their key in."""
KEY_PARAMS = tuple(dict.fromkeys(p for api in ALL for p in api.key_params))
"""Every query parameter some API's clients put their key in."""


def for_refusal(path: str, headers: Mapping[str, str]) -> Api:
    """Whose error format a client expects, from the request alone (its path, or headers
    only that API's clients send), for paths outside the scope too; OpenAI's when
    nothing says otherwise: most SDKs speak it."""
    by_path = for_path(path)
    for api in ALL:
        if api.client_headers and (api is by_path or any(h in headers for h in api.client_headers)):
            return api
    return openai_chat.API
