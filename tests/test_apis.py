"""The API registry: every module in ttft_relay/apis/ is listed and gives every part."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re

import orjson
import pytest

from ttft_relay import apis
from ttft_relay.apis.api import Api, ErrorFormat, Probe, Turns, Windows
from ttft_relay.stream import sse
from ttft_relay.apis.reader import Reader
from ttft_relay.apis.shape import Shape

SUPPORT_MODULES = {"api", "reader", "shape"}
"""Modules of the package that are not an API: the parts every API module is made of."""

API_MODULES = sorted(m.name for m in pkgutil.iter_modules(apis.__path__) if m.name not in SUPPORT_MODULES)
REGISTERED = (*apis.ALL, apis.OTHER_API)


def _regex(value) -> bool:
    re.compile(value)
    return True


PART_CHECKS = {
    "name": lambda v: isinstance(v, str) and v != "",
    "scope": lambda v: v is None or isinstance(v, str) and _regex(v),
    "matches": callable,
    "model_and_stream": callable,
    "prefill_traits": callable,
    "client_headers": lambda v: isinstance(v, tuple) and all(isinstance(h, str) and h == h.lower() for h in v),
    "key_headers": lambda v: isinstance(v, tuple) and all(isinstance(h, str) and h == h.lower() for h in v),
    "key_params": lambda v: isinstance(v, tuple) and all(isinstance(p, str) for p in v),
    "websocket_turns": lambda v: v is None or isinstance(v, Turns) and all(
        callable(getattr(v, f.name)) for f in dataclasses.fields(Turns)
    ),
    "trim_shape": lambda v: v is None or isinstance(v, Shape) and all(
        isinstance(getattr(v, key, None), kind)
        for key, kind in (("items_key", str), ("fixed_keys", tuple), ("text_part_type", str), ("image_part_types", frozenset))
    ) and type(v).calls is not Shape.calls and type(v).results is not Shape.results,
    "windows": lambda v: v is None or isinstance(v, Windows) and callable(v.too_long) and all(
        isinstance(w, int) and w > 0 for table in (v.known, v.max_input, v.long_context) for w in table.values()
    ),
    "reader": lambda v: isinstance(v, Reader),
    "errors": lambda v: isinstance(v, ErrorFormat) and type(v).body is not ErrorFormat.body,
    "probe": lambda v: v is None or isinstance(v, Probe),
    "semconv": lambda v: isinstance(v, tuple) and len(v) == 2 and all(isinstance(s, str) and s for s in v),
}
"""What each part of an `Api` must be."""


def test_every_part_has_a_check():
    assert set(PART_CHECKS) == {f.name for f in dataclasses.fields(Api)}


def test_api_modules_are_found():
    assert len(API_MODULES) >= 6, API_MODULES


@pytest.mark.parametrize("module_name", API_MODULES)
def test_every_api_module_is_registered(module_name):
    module = importlib.import_module(f"ttft_relay.apis.{module_name}")
    assert isinstance(module.API, Api)
    assert module.API.name == module.NAME
    assert any(module.API is api for api in REGISTERED), f"{module_name}.API is not in apis.ALL"
    assert apis.get(module.NAME) is module.API


@pytest.mark.parametrize("api", REGISTERED, ids=lambda api: api.name)
@pytest.mark.parametrize("part", sorted(PART_CHECKS))
def test_every_api_gives_every_part(api, part):
    assert PART_CHECKS[part](getattr(api, part)), f"{api.name}.{part} = {getattr(api, part)!r}"


def test_names_are_unique_and_other_is_last():
    assert len(set(apis.NAMES)) == len(apis.NAMES) == len(REGISTERED)
    assert apis.NAMES[-1] == apis.OTHER
    assert apis.get("no.such.api") is apis.OTHER_API


@pytest.mark.parametrize("api", REGISTERED, ids=lambda api: api.name)
def test_every_error_format_says_the_message(api):
    for status in (401, 413, 502, 504):
        body = api.errors.body(status, "the message")
        assert b"the message" in orjson.dumps(body)
        assert b"the message" in orjson.dumps(api.errors.stream_error(status, "the message", None))
        event = api.errors.event(status, "the message", "resp_1")
        assert event.endswith(b"\n\n") and b"the message" in event


@pytest.mark.parametrize("api", apis.ALL, ids=lambda api: api.name)
def test_every_matched_api_reads_its_own_stream(api):
    """A reader that kept the base class's answers would see no token in any stream."""
    for method in ("is_token", "looks_like_token", "observe", "usage", "normalize", "assemble", "recognizes"):
        assert getattr(type(api.reader), method) is not getattr(Reader, method), f"{api.name} reader lacks {method}"


@pytest.mark.parametrize("api", [api for api in REGISTERED if api.probe], ids=lambda api: api.name)
def test_a_probe_calls_its_own_api(api):
    probe = api.probe
    assert probe.name == api.name
    assert apis.for_path(probe.path) is api
    body = probe.body("hi", "m", 16)
    assert api.model_and_stream(probe.path, body) == ("m", True)
    assert body[probe.max_tokens_field] == 16
    assert "sk-probe-1" in str(probe.auth_headers("sk-probe-1")) and "sk-probe" not in str(probe.auth_headers(None))


def test_typed_events_are_recognised_before_chat_chunks():
    """A Responses stream echoes the request's tools, whose schema may name a "choices"
    parameter: Chat Completions' mark. apis.ALL's order lets the typed reading win."""
    created = orjson.dumps({"type": "response.created", "response": {"id": "resp_1", "tools": [
        {"type": "function", "name": "pick", "parameters": {"properties": {"choices": {"type": "array"}}}}]}})
    assert apis.for_events([sse.Event("response.created", created)]).name == apis.OPENAI_RESPONSES
    chunk = orjson.dumps({"object": "chat.completion.chunk", "choices": [{"delta": {"content": "hi"}}]})
    assert apis.for_events([sse.Event("", chunk)]).name == apis.OPENAI_CHAT


def test_the_places_of_api_keys_come_from_every_api():
    # Where the guard looks for a relay key and swaps in the upstream's (keys.presented_credentials).
    assert set(apis.KEY_HEADERS) == {"authorization", "x-api-key", "api-key", "x-goog-api-key"}
    assert apis.KEY_PARAMS == ("key",)  # Gemini's ?key=
    assert apis.get(apis.ANTHROPIC_MESSAGES).key_headers == ("x-api-key", "authorization")
