"""End to end: Codex's WebSocket turns (the Responses API's `response.create`) trimmed and
learned like its HTTP requests, through a real mitmdump with the relay, against the fake
upstream's WebSocket: a long turn trimmed (and the turn that continues it, put together
from the socket's conversation), a short one passed byte for byte, and a refusal as too
long sent again once inside the same socket, so the client sees one answer."""

from __future__ import annotations

import json

import orjson
import pytest

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing import shaped
from ttft_relay.testing.fakes.ws_client import WebSocketClient

pytestmark = pytest.mark.shared_fake
WAIT = 30
MODEL = "acme-codex-1"
"""A model of no family the relay knows: a refusal naming a small window is then the provider's word
(for gpt-5.1-codex, a 30k window is below its family's smallest and taught nothing: docs/trimming.md)."""
HEADERS = {"authorization": f"Bearer {FAKE_OPENAI_KEY}", "openai-beta": "responses_websockets=2026-02-06"}
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")


def ws_url(relay) -> str:
    return relay.url().replace("http://", "ws://") + "/v1/responses"


def turn(client: WebSocketClient, text: str) -> list[dict]:
    """Send one message; the events up to its terminal one."""
    client.send_text(text)
    events = []
    while (msg := client.receive(WAIT)) is not None:
        events.append(json.loads(msg.text))
        if events[-1]["type"] in TERMINAL:
            break
    return events


def codex_create(turns: int, **fields: object) -> dict:
    """A `response.create` as Codex sends it: a long session's whole input, no `stream`."""
    body = shaped.Session(shaped.RESPONSES, turns=turns).last()
    body.pop("stream")
    return {"type": "response.create", **body, "model": MODEL, **fields}


def tokens_of(message: dict) -> int:
    return len(orjson.dumps(message)) // 4  # the fake's count


def test_a_long_turn_is_trimmed_and_the_turn_continuing_it_too(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), relay_trim_max_tokens=12_000)
    relay.wait_for_output(r"tokenizer")
    prewarm = codex_create(12, generate=False)
    assert tokens_of(prewarm) > 40_000
    with WebSocketClient(ws_url(relay), headers={**HEADERS, "x-request-id": rid}) as client:
        events = turn(client, json.dumps(prewarm))
        assert events[-1]["type"] == "response.completed"
        # Codex's next turn continues the prewarm (its fields again, no input of its own): the
        # relay puts the conversation together and sends it whole, trimmed, instead of the
        # continuation the upstream would grow.
        continuation = {k: v for k, v in prewarm.items() if k != "generate"}
        continuation.update(previous_response_id=events[-1]["response"]["id"], input=[])
        events = turn(client, json.dumps(continuation))
        assert events[-1]["type"] == "response.completed"
    (session,) = fake.sockets
    first, second = session.response_creates
    assert first["generate"] is False and len(first["input"]) < len(prewarm["input"])
    assert first["input"][:4] == prewarm["input"][:4]  # the developer message, AGENTS.md, context, first prompt
    assert first["instructions"] == prewarm["instructions"] and first["tools"] == prewarm["tools"]
    assert "previous_response_id" not in second and second["input"] == first["input"]  # the same cut
    records = sorted((r for r in relay.log.of(rid, 3) if r["turn"]), key=lambda r: r["turn"])
    assert [r["trim"]["trimmed"] for r in records] == [True, True]
    assert [r["trim"]["plan"] for r in records] == ["new", "kept"]
    assert all(r["prompt_tokens"] == r["trim"]["tokens_after"] <= 12_000 for r in records)


def test_a_turn_that_fits_passes_byte_for_byte(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), relay_trim_max_tokens=12_000)
    # Spacing and key order orjson would not write: any re-encoding shows.
    text = ('{ "type" : "response.create",  "model": "%s", "input": [ {"role": "user", '
            '"content": "Say  hello"} ], "store":false }' % MODEL)
    with WebSocketClient(ws_url(relay), headers={**HEADERS, "x-request-id": rid}) as client:
        assert turn(client, text)[-1]["type"] == "response.completed"
    (session,) = fake.sockets
    assert session.texts == [text]
    (rec,) = [r for r in relay.log.of(rid, 2) if r["turn"]]
    assert rec["trim"]["reason"] == "fits" and not rec["trim"]["trimmed"]


def test_a_refusal_naming_the_window_is_learned_and_the_turn_sent_again_in_the_socket(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    relay.wait_for_output(r"tokenizer")
    create = codex_create(12)
    # A conversation of its own: the module's relays keep their plans in one file (one log directory).
    create["instructions"] = "Refused once. " + create["instructions"]
    window = 30_000
    assert tokens_of(create) > window
    knobs = {"x-fake-window": str(window), "x-fake-window-named": "1"}
    with WebSocketClient(ws_url(relay), headers={**HEADERS, **knobs, "x-request-id": rid}) as client:
        events = turn(client, json.dumps(create))
        assert [e["type"] for e in events if e["type"] in TERMINAL] == ["response.completed"]  # one answer
    (session,) = fake.sockets
    refused, resent = session.turns
    assert refused.outcome == "error" and resent.outcome == "complete"
    assert refused.request["input"] == create["input"]
    assert tokens_of(resent.request) <= window and resent.request["input"][:4] == create["input"][:4]
    (rec,) = [r for r in relay.log.of(rid, 2) if r["turn"]]
    assert rec["error"] is None and rec["trim"]["trimmed"]
    assert rec["trim"]["refused"]["resent"] and rec["trim"]["refused"]["window"] == window
    assert rec["trim"]["target"] == rec["trim"]["budget"]  # at the limit the refusal named, no deeper


def test_a_refusal_without_its_limit_reaches_the_client(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake))
    create = codex_create(4)
    knobs = {"x-fake-window": str(tokens_of(create) // 2)}  # the Responses API's words: no number
    with WebSocketClient(ws_url(relay), headers={**HEADERS, **knobs, "x-request-id": rid}) as client:
        events = turn(client, json.dumps(create))
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "context_length_exceeded"
    (session,) = fake.sockets
    assert len(session.turns) == 1
    (rec,) = [r for r in relay.log.of(rid, 2) if r["turn"]]
    assert rec["trim"]["refused"]["resent"] is False and rec["error"]
