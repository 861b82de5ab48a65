"""The OpenAI Responses API over WebSocket, as the fake upstream serves it (`GET /v1/responses`, Upgrade).

Codex CLI's WebSocket transport (codex-rs `responses_websocket`): the client opens
one WebSocket per session (offering permessage-deflate), then sends one text
message per turn, `{"type": "response.create", ...}` with the same fields as the
HTTP request body (`model`, `input`, `tools`, `previous_response_id`, and
`"generate": false` for a prewarm that only creates a response to continue
from). The server answers each with the event stream's payloads, one JSON text
message per event: `response.created`, `response.in_progress`,
`response.output_item.added`, `response.output_text.delta`, ...,
`response.completed` (with usage). Codex may also send `response.processed`
after a turn; nothing answers that.

The knobs are `Behaviour`'s, read from the upgrade request's `x-fake-*` headers
(or the fake's defaults), one *chunk* being one server message:

- `status` >= 400 rejects the upgrade with that status and a JSON error body;
  `head_delay_ms` delays the `101`; `reset_before_headers` resets instead of answering;
  `close_after_accept` closes the socket with that code right after the `101`;
- per turn: `window` refuses a `response.create` over that many tokens (its bytes / 4)
  with the API's `error` event (`window_named`: naming the window); `tool_call` and
  `tool_rounds` answer with the agent loop's calls as over HTTP (a turn continuing a
  response counts the rounds of that response's calls too), the prefill before the first text delta (`prefill_ms`, and
  `prefill_ms_per_1k_tokens` of the message's uncached tokens, which its usage reports with
  `cached_tokens`), `gap_ms` between the other events (and `midstream_pause_ms` more after
  the first text delta), `chunks` text pieces,
  `reset_after_chunks` / `stall_after_chunks` as for HTTP (a reset ends the whole socket,
  as a crashed upstream would).

A `previous_response_id` the fake never created is answered with the API's
`previous_response_not_found` error event. Everything the client sent is
recorded in `SocketSession` (the fake's `sockets`), with when the fake wrote each
turn's first text delta.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wsproto import ConnectionState, ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from ttft_relay.testing import sse_samples
from ttft_relay.testing.fakes.http_wire import Inbound, RequestHead, find_header, header_has_token, reset_connection, sleep_ms
from ttft_relay.testing.fakes.replies import (
    CHARS_PER_TOKEN, OPENAI_CHAT, OPENAI_RESPONSES, ToolLoop, answer_pieces, loop_round, prompt_tokens)

if TYPE_CHECKING:
    from ttft_relay.testing.fakes.upstream import Behaviour

RESPONSES_SOCKET_PATH = "/v1/responses"
OPENAI_REQUEST_ID_HEADER = "x-request-id"


def is_websocket_upgrade(head: RequestHead) -> bool:
    """A `GET` asking to switch to the WebSocket protocol (RFC 6455 section 4.1)."""
    return (
        head.method == "GET"
        and header_has_token(head.headers, "upgrade", "websocket")
        and header_has_token(head.headers, "connection", "upgrade")
    )


@dataclass
class SocketTurn:
    """One `response.create` the fake read, and what it answered."""

    request: dict[str, Any]
    """The client's message as parsed JSON (its `type` is "response.create")."""
    at: float
    """`time.time()` when the message was fully read."""
    response_id: str
    prewarm: bool
    """`"generate": false`: a response with no output, to continue from."""
    events: list[str] = field(default_factory=list)
    """The `type` of every event sent for this turn, in order."""
    first_token_at: float | None = None
    """`time.time()` right after the first text delta was written."""
    outcome: str | None = None
    """None while in progress, then "complete", "error" (an error event), "reset" or "client_closed"."""
    output: list[dict[str, Any]] = field(default_factory=list)
    """The output items of the `response.completed` it sent (what a turn continuing this
    response has before its own input)."""


@dataclass
class SocketSession:
    """One WebSocket the fake accepted (or refused): the upgrade and every message after it."""

    conn_id: int
    path: str
    headers: tuple[tuple[str, str], ...]
    """The upgrade request's headers, in order."""
    status: int | None = None
    """101 once accepted; the rejection status otherwise."""
    extensions: str | None = None
    """The `Sec-WebSocket-Extensions` the fake agreed to (e.g. permessage-deflate), or None."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Every text message the client sent, parsed (`{"unparsable": text}` when not JSON)."""
    texts: list[str] = field(default_factory=list)
    """... and as it came."""
    turns: list[SocketTurn] = field(default_factory=list)
    close_code: int | None = None
    """The code of the client's close frame, if it sent one."""
    protocol_error: str | None = None
    """What was wrong with the client's frames, if the fake could not read them (the socket then ends)."""

    def header(self, name: str) -> str | None:
        return find_header(self.headers, name)

    @property
    def response_creates(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("type") == "response.create"]


class ResponsesSocket:
    """Serves one Responses WebSocket on a connection whose upgrade request has been read.

    `behaviour` shapes the answers; `changed` is the fake's
    condition, notified on every recorded change; `known_responses` the response
    ids this fake created (for `previous_response_id`); `stall_release` waits for
    the fake's `release_stalls()`.
    """

    def __init__(
        self,
        session: SocketSession,
        behaviour: Behaviour,
        changed: threading.Condition,
        known_responses: set[str],
        next_response_id: Callable[[], str],
        stall_release: Callable[[], Awaitable[object]],
    ) -> None:
        self.session = session
        self.behaviour = behaviour
        self._changed = changed
        self._known = known_responses
        self._next_id = next_response_id
        self._stall_release = stall_release
        self._ws = WSConnection(ConnectionType.SERVER)
        self._creates: asyncio.Queue[tuple[dict[str, Any], float]] = asyncio.Queue()

    async def serve(self, head: RequestHead, inbound: Inbound, writer: asyncio.StreamWriter) -> str:
        """Answer the upgrade and serve turns until either side closes; returns the outcome."""
        behaviour = self.behaviour
        if behaviour.reset_before_headers:
            reset_connection(writer)
            return "reset"
        if behaviour.head_delay_ms:
            hangup = asyncio.ensure_future(inbound.wait_hangup())
            delay = asyncio.ensure_future(sleep_ms(behaviour.head_delay_ms))
            await asyncio.wait({hangup, delay}, return_when=asyncio.FIRST_COMPLETED)
            hangup.cancel()
            delay.cancel()
            if hangup.done() and not hangup.cancelled():  # the client left while the head was held
                return "client_closed"
        self._ws.receive_data(_raw_head(head))
        request = next((e for e in self._ws.events() if isinstance(e, Request)), None)
        if request is None:
            raise ValueError("not a WebSocket upgrade")
        if behaviour.status >= 400:
            self._reject(behaviour.status, writer)
            return "complete"

        accept = self._ws.send(AcceptConnection(
            extensions=[PerMessageDeflate()],
            extra_headers=[(OPENAI_REQUEST_ID_HEADER.encode(), b"req_fake_ws_%d" % self.session.conn_id)],
        ))
        writer.write(accept)
        await writer.drain()
        with self._changed:
            self.session.status = 101
            self.session.extensions = _header_in(accept, "sec-websocket-extensions")
            self._changed.notify_all()
        if behaviour.close_after_accept:
            writer.write(self._ws.send(CloseConnection(code=behaviour.close_after_accept, reason="session refused")))
            await writer.drain()
            writer.close()
            return "complete"

        turns = asyncio.ensure_future(self._serve_turns(writer))
        try:
            outcome = await self._read_messages(inbound, writer)
        finally:
            turns.cancel()  # the socket is closed: a turn still answering has nobody to answer
        try:
            if await turns == "reset":
                return "reset"
        except asyncio.CancelledError:
            pass
        return outcome

    def _reject(self, status: int, writer: asyncio.StreamWriter) -> None:
        body = json.dumps(sse_samples.error_body(OPENAI_RESPONSES, f"Fake upstream refused the WebSocket ({status}).", status)).encode()
        writer.write(self._ws.send(RejectConnection(
            status_code=status, headers=[(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            has_body=True,
        )) + self._ws.send(RejectData(data=body)))
        with self._changed:
            self.session.status = status
            self._changed.notify_all()

    async def _read_messages(self, inbound: Inbound, writer: asyncio.StreamWriter) -> str:
        """Read frames until the client closes ("complete"), drops the connection ("client_closed") or
        sends what is not WebSocket ("protocol_error", e.g. frames a proxy mangled)."""
        text: list[str] = []
        while True:
            data = await inbound.read_some()
            if not data:
                return "client_closed"
            self._ws.receive_data(data)
            for event in self._ws.events():
                if isinstance(event, TextMessage):
                    text.append(event.data)
                    if event.message_finished:
                        self._note_message("".join(text))
                        text = []
                elif isinstance(event, BytesMessage):
                    self._note_message(bytes(event.data).decode("utf-8", "replace"))
                elif isinstance(event, Ping):
                    writer.write(self._ws.send(event.response()))
                elif isinstance(event, CloseConnection) and self._ws.state is ConnectionState.OPEN:
                    # wsproto reports frames it cannot parse as a close it made up, the state still open
                    with self._changed:
                        self.session.protocol_error = f"{event.code} {event.reason}"
                        self._changed.notify_all()
                    writer.write(self._ws.send(CloseConnection(code=event.code)))
                    return "protocol_error"
                elif isinstance(event, CloseConnection):
                    with self._changed:
                        self.session.close_code = event.code
                        self._changed.notify_all()
                    writer.write(self._ws.send(event.response()))
                    await writer.drain()
                    return "complete"

    def _note_message(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            message = {"unparsable": text}
        if not isinstance(message, dict):
            message = {"unparsable": text}
        with self._changed:
            self.session.messages.append(message)
            self.session.texts.append(text)
            self._changed.notify_all()
        if message.get("type") == "response.create":
            self._creates.put_nowait((message, time.time()))

    async def _serve_turns(self, writer: asyncio.StreamWriter) -> str:
        """Answer each response.create in turn, as the API does (one response in flight per socket)."""
        while True:
            message, at = await self._creates.get()
            if await self._answer(message, at, writer) == "reset":
                return "reset"

    async def _answer(self, message: dict[str, Any], at: float, writer: asyncio.StreamWriter) -> str:
        behaviour = self.behaviour
        turn = SocketTurn(message, at, self._next_id(), prewarm=message.get("generate") is False)
        with self._changed:
            self.session.turns.append(turn)
            self._changed.notify_all()
        previous = message.get("previous_response_id")
        size = len(json.dumps(message).encode()) // CHARS_PER_TOKEN
        if previous is not None and previous not in self._known:
            events = [_previous_response_not_found(previous)]
            first_token = None
        elif behaviour.window is not None and size > behaviour.window:
            words = OPENAI_CHAT if behaviour.window_named else OPENAI_RESPONSES
            error = sse_samples.too_long_body(words, size, behaviour.window)["error"]
            events = [json.dumps({"type": "error", "status": 400, "error": error})]
            first_token = None
        else:
            model = message.get("model") if isinstance(message.get("model"), str) else sse_samples.OPENAI_MODEL
            pieces = [] if turn.prewarm else answer_pieces(behaviour.chunks)
            tokens, cached = prompt_tokens(json.dumps(message).encode(), behaviour.cached_tokens)
            call: dict[str, Any] = {}
            loop = ToolLoop.parse(behaviour.tool_call, behaviour.tool_rounds)
            if loop is not None and not turn.prewarm and (n := loop_round(json.dumps(message).encode(), message)) < loop.rounds:
                pieces = []
                call = {"tool_call": (loop.name, [loop.arguments.replace("{n}", str(n))]), "tool_id": f"call_fake{n}"}
            events = [_sse_payload(e) for e in sse_samples.responses_stream(
                pieces, model=model, id=turn.response_id, input_tokens=tokens, cached_tokens=cached, **call)]
            first_token = next((i for i, e in enumerate(events) if '"response.output_text.delta"' in e), None)
        try:
            for index in range(len(events) + 1):
                if index == behaviour.reset_after_chunks:
                    reset_connection(writer)
                    return self._finish(turn, "reset")
                if index == behaviour.stall_after_chunks:
                    await self._stall_release()
                if index == len(events):
                    break
                if index == first_token:
                    await sleep_ms(behaviour.prefill_for(json.dumps(message).encode()))
                elif index > 0:
                    pause = behaviour.midstream_pause_ms if first_token is not None and index == first_token + 1 else 0
                    await sleep_ms(behaviour.gap_ms + pause)
                writer.write(self._ws.send(TextMessage(data=events[index])))
                await writer.drain()
                with self._changed:
                    event = json.loads(events[index])
                    turn.events.append(event["type"])
                    if event["type"] == "response.completed":
                        turn.output = event["response"].get("output") or []
                    if index == first_token:
                        turn.first_token_at = time.time()
                    self._changed.notify_all()
        except ConnectionError:
            return self._finish(turn, "client_closed")
        except asyncio.CancelledError:
            self._finish(turn, "client_closed")
            raise
        if turn.events[-1] == "error":
            return self._finish(turn, "error")
        with self._changed:
            self._known.add(turn.response_id)
        return self._finish(turn, "complete")

    def _finish(self, turn: SocketTurn, outcome: str) -> str:
        with self._changed:
            if turn.outcome is None:
                turn.outcome = outcome
            self._changed.notify_all()
        return outcome


def _raw_head(head: RequestHead) -> bytes:
    lines = [f"{head.method} {head.target} {head.version}"] + [f"{name}: {value}" for name, value in head.headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _header_in(head: bytes, name: str) -> str | None:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return find_header([tuple(part.strip() for part in line.split(":", 1)) for line in lines if ":" in line], name)


def _sse_payload(event: bytes) -> str:
    """The `data:` of one SSE event: what the WebSocket transport sends as a text message."""
    return next(line[len("data: "):] for line in event.decode().split("\n") if line.startswith("data: "))


def _previous_response_not_found(response_id: str) -> str:
    return json.dumps({
        "type": "error",
        "status": 400,
        "error": {
            "type": "invalid_request_error",
            "code": "previous_response_not_found",
            "message": f"Previous response with id '{response_id}' not found.",
            "param": "previous_response_id",
        },
    })


