"""`FakeUpstream`: an OpenAI / Anthropic / Gemini look-alike HTTP/1.1 (and HTTP/2) server for tests and benchmarks.

It runs on its own event loop in a background thread, so synchronous tests can
use it, and speaks the real wire formats (bodies from `ttft_relay/testing/sse_samples.py`) well
enough for the official SDKs. Streamed replies go out one SSE event per HTTP
chunk, flushed each time, so a relay's buffering is observable.

Endpoints: POST /v1/chat/completions, /v1/responses, /v1/messages (stream or not,
per the body's `"stream": true`), /v1/messages/count_tokens (body bytes / 4), POST
/v1beta/models/{m}:streamGenerateContent?alt=sse and :generateContent; GET /v1/models;
anything else gets a 404 JSON error. A
WebSocket upgrade on GET /v1/responses serves the Responses API over WebSocket
(`ttft_relay/testing/fakes/websocket.py`; recorded in `sockets`).

Usage reports the request's size as its prompt tokens (body bytes / 4), `cached_tokens` of
them read from a cache. Behaviour knobs (`Behaviour`) are set as instance defaults (`fake.behaviour.gap_ms = 20`)
or per request with `x-fake-<knob>` headers, underscores as dashes
(`x-fake-prefill-ms: 300`), so a subprocess client can drive them too. An
unknown or unparsable `x-fake-*` header is answered with 400.

A *chunk* below is one written HTTP chunk of the body: one SSE event of a streamed
reply (chunk 0 is the first event), or the whole body of a non-streamed reply.
Timeline of one reply:

    request read -> [head_delay_ms] -> head (dribbled over slow_headers_ms)
    -> chunks before the first answer text, back to back (e.g. Anthropic message_start)
    -> [prefill_ms + prefill_ms_per_1k_tokens * uncached request tokens / 1000] -> first text chunk
    -> [gap_ms + midstream_pause_ms] -> next chunk -> [gap_ms] -> ... -> end of body

With `h2` (and `tls`) it offers HTTP/2 as well (ALPN h2, http/1.1), as the real APIs do:
a client that picks h2 is answered over HTTP/2, a streamed reply one SSE event per DATA
frame, shaped by the same knobs (prefill, gap, chunks, status, stall; the reset, gzip,
slow-head and interim knobs and the gates are HTTP/1's, `hold_until_reset` is HTTP/2's).
A knob the protocol has not is answered with 400.

Run as a program for benchmarks: `python -m ttft_relay.testing.fakes.upstream --port 0 [--tls [--h2]]
[--certs-dir DIR] [--prefill-ms 50 ...]` prints `listening <base_url>`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import http
import itertools
import os
import signal
import tempfile
import threading
import time
import types
import typing
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import urlsplit

from mitmproxy.net import encoding as mitmproxy_encoding

from ttft_relay.testing.fakes._loop import LoopThread
from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.h2_wire import ServerSide, Stream, serve_h2
from ttft_relay.testing.fakes.http_wire import (
    BadRequest,
    Inbound,
    RequestHead,
    find_header,
    header_has_token,
    read_request,
    reset_connection,
    sleep_ms,
)
from ttft_relay.testing.fakes.replies import Reply, ToolLoop, answer_pieces, build_reply, json_reply, prompt_tokens
from ttft_relay.testing.fakes.websocket import RESPONSES_SOCKET_PATH, ResponsesSocket, SocketSession, is_websocket_upgrade

KNOB_HEADER_PREFIX = "x-fake-"
LISTEN_BACKLOG = 1024  # the default 100 makes bursts of hundreds of connections wait for SYN retransmits
SLOW_HEADER_SLICES = 16


@dataclass
class Behaviour:
    """How the fake delivers its replies. Delays are in milliseconds; `*_chunks` count written chunks."""

    head_delay_ms: float = 0
    """Wait after reading the request, before sending the response head (queueing, "time to headers")."""
    prefill_ms: float = 0
    """Wait between the response head and the first chunk carrying answer text."""
    prefill_ms_per_1k_tokens: float = 0
    """Extra prefill per 1000 request tokens (request body bytes / 4): prefill that grows with the prompt."""
    gap_ms: float = 0
    """Wait before every chunk after the first, except the first text chunk (which waits the prefill)."""
    midstream_pause_ms: float = 0
    """Wait this much longer before the chunk after the first text chunk: a stall mid-stream."""
    chunks: int = 5
    """Number of answer text pieces ("Hello", " t1", ...); see `replies.answer_text`."""
    status: int = 200
    """Response status. >= 400 answers with a JSON error in the API's format instead of the answer."""
    error_body: str | None = None
    """Verbatim error body for `status` >= 400 (default: the API's own error format)."""
    reset_before_headers: bool = False
    """Read the request, then (after `head_delay_ms`) reset the TCP connection without answering."""
    reset_after_chunks: int | None = None
    """Reset the connection after this many chunks (0: right after the head)."""
    stall_after_chunks: int | None = None
    """After this many chunks, send nothing (connection open) until `release_stalls()` or `stop()`."""
    slow_headers_ms: float = 0
    """Dribble the response head out in small slices over this long."""
    gzip: bool = False
    """gzip the body if the request's Accept-Encoding allows it (streams: flushed per chunk)."""
    interim_status: int = 0
    """Send an interim (1xx) response, e.g. 103 Early Hints, before the real one; 0: none."""
    close_after_accept: int = 0
    """WebSocket: close the socket with this close code right after accepting the upgrade (an
    upstream that takes the upgrade, then refuses the session); 0: do not."""
    hold_until_reset: int | None = None
    """HTTP/2: before this chunk, send an SSE comment every 0.2 s (never idle) until a stream
    on the same connection is reset, then the rest."""
    cached_tokens: int = 0
    """Prompt tokens read from the provider's cache: reported in the usage (at most the whole
    prompt), and left out of `prefill_ms_per_1k_tokens`, as a cached prefix costs next to nothing."""
    prompt_cache: bool = False
    """Be a provider that caches prompt prefixes (HTTP/1): a request's `cached_tokens` are the
    longest prefix of its body that an earlier request's body (of the last PROMPT_CACHE_BODIES)
    began with, in whole PROMPT_CACHE_STEP tokens from PROMPT_CACHE_MIN on: a conversation
    continued here reads its history from the cache, one moved here from elsewhere pays it all."""
    queue_spike_ms: float = 0
    """HTTP/1: a provider queue that comes and goes: this much more before the head, for
    requests arriving in the first `queue_spike_s` of every `queue_spike_every_s` seconds since
    the fake started."""
    queue_spike_s: float = 0
    queue_spike_every_s: float = 0
    window: int | None = None
    """The model's context window in the fake's tokens (request body bytes / 4): a longer
    request is refused with a 400 in the API's own words (`sse_samples.too_long_body`); a
    longer WebSocket turn with the Responses API's `error` event carrying that error."""
    window_named: bool = False
    """WebSocket: the refusal names the window, in Chat Completions' words ("maximum context
    length is N tokens"), as OpenAI-compatible servers word it for every API."""
    tool_call: str | None = None
    """An agent loop (`replies.ToolLoop`, HTTP and WebSocket answers): the tool call to answer with, its
    name, a space and its JSON arguments, `{n}` in them the round (0, 1, ...) ..."""
    tool_rounds: int = 0
    """... while the request carries fewer than this many tool results; then the text answer."""
    keepalive_requests: int = 0
    """Answer this many requests on one connection; the next it reads is not answered: the
    connection closes as it arrives (a server closing a kept-alive connection just as a
    request comes, its idle timeout or a restart). 0: no limit."""

    def overridden_by(self, headers: Iterable[tuple[str, str]]) -> Behaviour:
        """A copy with the knobs named in `x-fake-*` headers replaced. Raises ValueError on a bad knob."""
        hints = typing.get_type_hints(Behaviour)
        changes: dict[str, Any] = {}
        for name, value in headers:
            if name.lower().startswith(KNOB_HEADER_PREFIX):
                knob = name.lower().removeprefix(KNOB_HEADER_PREFIX).replace("-", "_")
                if knob not in hints:
                    raise ValueError(f"unknown knob header {name!r}")
                changes[knob] = parse_knob(hints[knob], value)
        return dataclasses.replace(self, **changes)

    def prefill_for(self, request_body: bytes) -> float:
        tokens, cached = prompt_tokens(request_body, self.cached_tokens)
        return self.prefill_ms + self.prefill_ms_per_1k_tokens * (tokens - cached) / 1000

    def wait_before(self, index: int, reply: Reply, request_body: bytes) -> float:
        """Milliseconds before chunk `index` of `reply`: the prefill before the first text, the gap before later ones."""
        if index == reply.first_token_chunk:
            return self.prefill_for(request_body)
        pause = self.midstream_pause_ms if index == reply.first_token_chunk + 1 else 0
        return self.gap_ms + pause if index > 0 else 0


def _closes_instead(head: RequestHead, answered: int) -> bool:
    """The `keepalive_requests` knob of the request that arrived says its connection is done."""
    try:
        limit = Behaviour().overridden_by(head.headers).keepalive_requests
    except ValueError:
        return False  # a bad knob is answered with a 400
    return 0 < limit <= answered


KNOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Behaviour)}
H2_KNOBS = frozenset({"head_delay_ms", "prefill_ms", "prefill_ms_per_1k_tokens", "gap_ms", "chunks", "status",
                      "error_body", "stall_after_chunks", "hold_until_reset", "cached_tokens", "midstream_pause_ms",
                      "window", "tool_call", "tool_rounds"})
"""The knobs the fake's HTTP/2 answers have; the others are HTTP/1's (and hold_until_reset is HTTP/2's)."""
PROMPT_CACHE_BODIES = 512
PROMPT_CACHE_MIN = 1024
PROMPT_CACHE_STEP = 128
"""A cached prefix counts from 1024 tokens on, in steps of 128 (OpenAI's)."""


class PromptCache:
    """The prefixes a provider with `prompt_cache` holds: the bodies it read lately."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def read(self, body: bytes) -> int:
        """The cached tokens of `body` (then remembered for the next)."""
        longest = max((len(os.path.commonprefix([body, seen])) for seen in self.bodies), default=0)
        self.bodies = [*self.bodies, body][-PROMPT_CACHE_BODIES:]
        tokens = prompt_tokens(body[:longest])[0] if longest else 0
        return tokens // PROMPT_CACHE_STEP * PROMPT_CACHE_STEP if tokens >= PROMPT_CACHE_MIN else 0
KEEPALIVE = b": keep-alive\n\n"
"""An SSE comment: what a held stream sends meanwhile, so it is never idle."""
KEEPALIVE_EVERY_S = 0.2
assert H2_KNOBS <= KNOB_DEFAULTS.keys()


def decode_request_body(headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    """The request body without its content coding, as a real API server reads it."""
    coding = (find_header(headers, "content-encoding") or "identity").strip().lower()
    return body if coding == "identity" else mitmproxy_encoding.decode(body, coding)


def parse_knob(kind: Any, text: str) -> Any:
    """Parse a knob value given as text (header or CLI) into the field's type."""
    text = text.strip()
    if isinstance(kind, types.UnionType):  # `X | None`
        if text.lower() in ("", "none"):
            return None
        (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    return kind(text)


@dataclass(frozen=True)
class Received:
    """One request as the fake read it, in arrival order; `conn_id` numbers connections from 1."""

    method: str
    path: str
    """The request target as sent, query string included."""
    headers: tuple[tuple[str, str], ...]
    """In order, names as sent; `header(name)` looks one up case-insensitively."""
    body: bytes
    """De-chunked, not decompressed."""
    conn_id: int
    chunked: bool
    """The body came with chunked transfer coding."""
    at: float
    """`time.time()` when the request was fully read."""
    h2: bool = False
    """It came over HTTP/2."""

    def header(self, name: str) -> str | None:
        return find_header(self.headers, name)


@dataclass
class Sent:
    """What the fake sent for one request (same index as in `received`)."""

    request: Received
    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    """The body bytes written so far, de-chunked but still content-encoded (gzip)."""
    chunks_sent: int = 0
    outcome: str | None = None
    """None while in progress, then "complete", "reset" (a reset knob), "client_closed" or "stopped";
    a WebSocket also "protocol_error" (`SocketSession.protocol_error` says what)."""
    first_token_at: float | None = None
    """`time.time()` right after the chunk with the first answer text was written (None until then)."""
    reset: int | None = None
    """HTTP/2: the error code of the RST_STREAM the client ended the stream with."""

    def decoded_body(self) -> bytes:
        """`body` with any gzip content coding removed (a partial gzip stream decodes as far as it goes)."""
        if find_header(self.headers, "content-encoding") != "gzip":
            return self.body
        return zlib.decompressobj(wbits=31).decompress(self.body)


class Gate:
    """Holds a streamed reply before one chunk until the test calls `set()` (threading.Event-like)."""

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread
        self._flag = threading.Event()
        self._released = asyncio.Event()  # binds to the server loop on first wait

    def set(self) -> None:
        self._flag.set()
        self._loop_thread.call_soon(self._released.set)

    def is_set(self) -> bool:
        return self._flag.is_set()

    async def wait_released(self) -> None:
        await self._released.wait()


class StreamWatch:
    """Gates and observes one streamed reply: the next one the fake starts after the watch was armed.

    Lets a test prove causality without clocks: hold chunk k, wait until chunk k-1
    was sent, check the client already has it, release chunk k.
    """

    def __init__(self, loop_thread: LoopThread) -> None:
        self._loop_thread = loop_thread
        self._gates: dict[int, Gate] = {}
        self._changed = threading.Condition()
        self._sent = 0
        self._done = False

    def hold_before_chunk(self, index: int) -> Gate:
        """The gate the reply waits on before writing chunk `index` (0-based)."""
        with self._changed:
            return self._gates.setdefault(index, Gate(self._loop_thread))

    def wait_chunk_sent(self, index: int, timeout: float) -> bool:
        """Block until chunk `index` has been written and flushed; False on timeout or if the reply
        ended (reset, client gone) before it."""
        with self._changed:
            self._changed.wait_for(lambda: self._sent > index or self._done, timeout)
            return self._sent > index

    def wait_done(self, timeout: float) -> bool:
        """Block until the reply has ended, however it ended."""
        with self._changed:
            return self._changed.wait_for(lambda: self._done, timeout)

    # Server side, called on the fake's loop.

    async def pass_gate(self, index: int) -> None:
        with self._changed:
            gate = self._gates.get(index)
        if gate is not None:
            await gate.wait_released()

    def note_sent(self) -> None:
        with self._changed:
            self._sent += 1
            self._changed.notify_all()

    def note_done(self) -> None:
        with self._changed:
            self._done = True
            self._changed.notify_all()


class _ContentCoding:
    """Identity or gzip coding of a body written in chunks; gzip is sync-flushed per chunk so a
    streaming reader can decode each chunk as it arrives."""

    def __init__(self, gzip: bool) -> None:
        self._compressor = zlib.compressobj(wbits=31) if gzip else None

    @property
    def name(self) -> str | None:
        return "gzip" if self._compressor else None

    def encode(self, data: bytes) -> bytes:
        if self._compressor is None:
            return data
        return self._compressor.compress(data) + self._compressor.flush(zlib.Z_SYNC_FLUSH)

    def finish(self) -> bytes:
        return self._compressor.flush() if self._compressor else b""


class FakeUpstream:
    """The fake API server. Use as a context manager or call `start()` / `stop()` (once each).

    Binds `host` (127.0.0.1; `port` 0: any free port). With `tls` and no `certs`, it makes
    its own in a temporary directory (`fake.certs.ca_pem` is the CA to trust).
    """

    def __init__(
        self,
        tls: bool = False,
        certs: TestCerts | None = None,
        *,
        port: int = 0,
        behaviour: Behaviour | None = None,
        h2: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        self.tls = tls
        self.host = host
        self.h2 = h2
        self.certs = certs
        self.behaviour = behaviour or Behaviour()
        self.port = port
        self._requested_port = port
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        self._loop_thread = LoopThread("fake-upstream")
        self._server: asyncio.Server | None = None
        self._changed = threading.Condition()
        self._received: list[Received] = []
        self._sent: list[Sent] = []
        self._open_connections = 0
        self._busy_connections = 0
        self._open_ids: set[int] = set()
        """Connections inside an exchange (a request read, its answer not done) or HTTP/2 ones."""
        self._conn_ids = itertools.count(1)
        self._pending_watch: StreamWatch | None = None
        self._latest_watch: StreamWatch | None = None
        self._stall_release = asyncio.Event()
        self._sockets: list[SocketSession] = []
        self._known_responses: set[str] = set()
        self._response_ids = itertools.count(1)
        self._prompt_cache = PromptCache()
        self._started_at = time.monotonic()

    # --- lifecycle ---------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"https://localhost:{self.port}" if self.tls else f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeUpstream:
        if self.tls and self.certs is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="fake-upstream-certs-")
            self.certs = TestCerts.create(self._tempdir.name)
        self._loop_thread.start()
        self._server = self._loop_thread.run(self._listen())
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _listen(self) -> asyncio.Server:
        alpn = ("h2", "http/1.1") if self.h2 else ("http/1.1",)
        ssl_context = self.certs.server_context(alpn) if self.certs and self.tls else None
        return await asyncio.start_server(
            self._serve_connection, self.host, self._requested_port, ssl=ssl_context, backlog=LISTEN_BACKLOG
        )

    def stop(self) -> None:
        """Close the listener and every connection (stalled or gated ones too) and end the thread."""
        if self._server is not None:
            self._loop_thread.call_soon(self._server.close)
            self._server = None
        self._loop_thread.stop()
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def forget(self, timeout: float = 10) -> FakeUpstream:
        """Start afresh for the next test sharing this fake (and the relays forwarding to it):
        once no connection is in the middle of an exchange (idle kept-alive ones may stay: the
        relay's upstream pool keeps them), nothing received or sent is remembered, no watch is
        armed and the behaviour is the default. Fails if an exchange goes on past `timeout`
        (an earlier test left a request running)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._busy_connections == 0, timeout):
                raise AssertionError(f"{self._busy_connections} connections to the fake still busy from an earlier test")
        with self._changed:
            self._received, self._sent, self._sockets = [], [], []
            self._pending_watch = self._latest_watch = None
        self.behaviour = Behaviour()
        return self

    # --- records ---------------------------------------------------------------

    @property
    def received(self) -> list[Received]:
        """Every request read so far, in arrival order (a copy)."""
        with self._changed:
            return list(self._received)

    @property
    def sent(self) -> list[Sent]:
        """What was sent per request, same order as `received` (snapshot copies)."""
        with self._changed:
            return [dataclasses.replace(s, headers=list(s.headers)) for s in self._sent]

    @property
    def sent_bodies(self) -> list[bytes]:
        """The body bytes sent per request (de-chunked, content-encoded as sent)."""
        return [s.body for s in self.sent]

    @property
    def sockets(self) -> list[SocketSession]:
        """Every WebSocket upgrade the fake answered, in arrival order (snapshot copies)."""
        with self._changed:
            return [
                dataclasses.replace(s, messages=list(s.messages), turns=[dataclasses.replace(t) for t in s.turns])
                for s in self._sockets
            ]

    def wait_socket_turns(self, count: int, timeout: float = 10) -> bool:
        """Block until at least `count` WebSocket turns (response.create, any socket) have ended."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(t.outcome is not None for s in self._sockets for t in s.turns) >= count, timeout
            )

    @property
    def open_connections(self) -> int:
        with self._changed:
            return self._open_connections

    def wait_received(self, count: int, timeout: float = 10) -> bool:
        """Block until at least `count` requests have been read."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._received) >= count, timeout)

    def wait_finished(self, count: int, timeout: float = 10) -> bool:
        """Block until at least `count` replies have ended (any outcome)."""
        with self._changed:
            return self._changed.wait_for(lambda: sum(s.outcome is not None for s in self._sent) >= count, timeout)

    def wait_closed(self, conn_id: int, timeout: float = 10) -> bool:
        """Block until connection `conn_id` (a `Received.conn_id`) is closed."""
        with self._changed:
            return self._changed.wait_for(lambda: conn_id not in self._open_ids, timeout)

    def wait_connections(self, count: int, timeout: float = 10) -> bool:
        """Block until exactly `count` client connections are open (e.g. 0: the relay let go)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._open_connections == count, timeout)

    # --- gates and stalls -----------------------------------------------------

    def next_stream(self) -> StreamWatch:
        """The watch for the next streamed reply the fake starts (created on first call, then shared)."""
        with self._changed:
            if self._pending_watch is None:
                self._pending_watch = self._latest_watch = StreamWatch(self._loop_thread)
            return self._pending_watch

    def hold_before_chunk(self, index: int) -> Gate:
        """Hold the next streamed reply before chunk `index` until the returned gate is `set()`."""
        return self.next_stream().hold_before_chunk(index)

    def wait_chunk_sent(self, index: int, timeout: float = 10) -> bool:
        """Wait for chunk `index` of the latest streamed reply, or of the next one if a watch is armed
        (`next_stream()` / `hold_before_chunk()`); arm one first when the request is not sent yet."""
        with self._changed:
            watch = self._latest_watch
        return (watch or self.next_stream()).wait_chunk_sent(index, timeout)

    def release_stalls(self) -> None:
        """Let every reply stalled by `stall_after_chunks` carry on; later stalls stall again."""
        self._loop_thread.call_soon(self._release_stalls)

    def _release_stalls(self) -> None:
        self._stall_release.set()
        self._stall_release = asyncio.Event()

    def _claim_watch(self) -> StreamWatch:
        with self._changed:
            watch = self._pending_watch or StreamWatch(self._loop_thread)
            self._pending_watch, self._latest_watch = None, watch
        return watch

    # --- serving ---------------------------------------------------------------

    def _count_connection(self, delta: int, busy: int = 0, conn_id: int | None = None) -> None:
        with self._changed:
            if conn_id is not None:
                (self._open_ids.add if delta > 0 else self._open_ids.discard)(conn_id)
            self._open_connections += delta
            self._busy_connections += busy
            self._changed.notify_all()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = next(self._conn_ids)
        tls = writer.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() == "h2":
            self._count_connection(+1, busy=+1, conn_id=conn_id)
            try:
                await serve_h2(reader, writer, functools.partial(self._respond_h2, conn_id))
            finally:
                self._count_connection(-1, busy=-1, conn_id=conn_id)
            return
        inbound = Inbound(reader)
        self._count_connection(+1, conn_id=conn_id)
        try:
            keep_alive = True
            answered = 0
            while keep_alive:
                request = await read_request(inbound, writer)
                if request is None or _closes_instead(request[0], answered):
                    break
                answered += 1
                self._count_connection(0, busy=+1)
                try:
                    keep_alive = await self._exchange(conn_id, *request, inbound, writer)
                finally:
                    self._count_connection(0, busy=-1)
            writer.close()
        except BadRequest as exc:
            body = f"fake upstream: bad request: {exc}".encode()
            writer.write(_head(400, [("Content-Length", str(len(body))), ("Connection", "close")]) + body)
            writer.close()
        except ConnectionError:
            writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()  # stop(): a graceful close could wait forever on a client that does not read
            raise
        finally:
            inbound.close()
            self._count_connection(-1, conn_id=conn_id)

    async def _exchange(
        self, conn_id: int, head: RequestHead, body: bytes, chunked: bool, inbound: Inbound, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; True if the connection may carry another."""
        received = Received(head.method, head.target, head.headers, body, conn_id, chunked, time.time())
        sent = self._arrived(received)

        if is_websocket_upgrade(head) and urlsplit(head.target).path == RESPONSES_SOCKET_PATH:
            try:
                behaviour = self.behaviour.overridden_by(head.headers)
            except ValueError:
                behaviour = dataclasses.replace(Behaviour(), status=400)  # refuse the upgrade, as for HTTP
            await self._serve_socket(conn_id, head, behaviour, sent, inbound, writer)
            return False
        try:
            behaviour = self._as_provider(self.behaviour.overridden_by(head.headers),
                                          decode_request_body(head.headers, body))
            if behaviour.hold_until_reset is not None:
                raise ValueError("HTTP/2 only: hold_until_reset")
            reply = build_reply(head.method, head.target, decode_request_body(head.headers, body),
                                answer_pieces(behaviour.chunks), behaviour.status, behaviour.error_body,
                                behaviour.cached_tokens, behaviour.window,
                                ToolLoop.parse(behaviour.tool_call, behaviour.tool_rounds))
        except ValueError as exc:
            behaviour, reply = Behaviour(), json_reply(400, {"error": {"message": f"fake upstream: {exc}"}})
        watch = self._claim_watch() if reply.streamed else StreamWatch(self._loop_thread)
        keep_alive = head.wants_keep_alive()

        responding = asyncio.ensure_future(self._respond(head, body, reply, behaviour, keep_alive, sent, watch, writer))
        hangup = asyncio.ensure_future(inbound.wait_hangup())
        try:
            await asyncio.wait({responding, hangup}, return_when=asyncio.FIRST_COMPLETED)
            hangup.cancel()
            if not responding.done():
                responding.cancel()
                outcome = "client_closed"
            else:
                try:
                    outcome = responding.result()
                except ConnectionError:
                    outcome = "client_closed"
        except asyncio.CancelledError:
            responding.cancel()
            hangup.cancel()
            self._finish(sent, watch, "stopped")
            raise
        self._finish(sent, watch, outcome)
        return keep_alive and outcome == "complete"

    def _arrived(self, received: Received) -> Sent:
        """A request read: recorded, with the record of what is sent for it."""
        sent = Sent(received)
        with self._changed:
            self._received.append(received)
            self._sent.append(sent)
            self._changed.notify_all()
        return sent

    def _chunk_sent(self, sent: Sent, payload: bytes, first_token: bool) -> None:
        with self._changed:
            sent.body += payload
            sent.chunks_sent += 1
            if first_token:
                sent.first_token_at = time.time()
            self._changed.notify_all()

    async def _respond_h2(self, conn_id: int, side: ServerSide, sid: int, stream: Stream) -> None:
        """One HTTP/2 request, answered as `_respond` answers HTTP/1 where HTTP/2 has the knob
        (`H2_KNOBS`); a knob it has not is answered with 400, never ignored."""
        headers = tuple((name, value) for name, value in stream.headers.items() if not name.startswith(":"))
        body = bytes(stream.body)
        received = Received(stream.headers[":method"], stream.headers[":path"], headers, body, conn_id, False, time.time(),
                            h2=True)
        sent = self._arrived(received)
        try:
            behaviour = self.behaviour.overridden_by(headers)
            if http1_only := [k for k in KNOB_DEFAULTS if k not in H2_KNOBS
                              and getattr(behaviour, k) != KNOB_DEFAULTS[k]]:
                raise ValueError(f"HTTP/1 only: {', '.join(http1_only)}")
            reply = build_reply(received.method, received.path, decode_request_body(headers, body),
                                answer_pieces(behaviour.chunks), behaviour.status, behaviour.error_body,
                                behaviour.cached_tokens, behaviour.window,
                                ToolLoop.parse(behaviour.tool_call, behaviour.tool_rounds))
        except ValueError as exc:
            behaviour, reply = Behaviour(), json_reply(400, {"error": {"message": f"fake upstream: {exc}"}})
        outcome = "stopped"
        try:
            await sleep_ms(behaviour.head_delay_ms)
            side.send_headers(sid, [(":status", str(reply.status)), ("content-type", reply.content_type)])
            with self._changed:
                sent.status = reply.status
            for index, chunk in enumerate(reply.chunks):
                if index == behaviour.stall_after_chunks:
                    await self._stall_release.wait()
                while index == behaviour.hold_until_reset and not side.a_reset.is_set():
                    await side.send_data(sid, KEEPALIVE)
                    with self._changed:
                        sent.body += KEEPALIVE
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(side.a_reset.wait(), KEEPALIVE_EVERY_S)
                await sleep_ms(behaviour.wait_before(index, reply, body))
                await side.send_data(sid, chunk)
                self._chunk_sent(sent, chunk, index == reply.first_token_chunk)
            side.end_stream(sid)
            outcome = "complete"
        except asyncio.CancelledError:
            outcome = "client_closed"  # its stream reset, or the connection gone
            raise
        finally:
            with self._changed:
                sent.outcome, sent.reset = outcome, stream.reset
                self._changed.notify_all()

    async def _serve_socket(
        self, conn_id: int, head: RequestHead, behaviour: Behaviour, sent: Sent, inbound: Inbound,
        writer: asyncio.StreamWriter,
    ) -> None:
        session = SocketSession(conn_id, head.target, head.headers)
        with self._changed:
            self._sockets.append(session)
        server = ResponsesSocket(
            session, behaviour, self._changed, self._known_responses, self._new_response_id,
            lambda: self._stall_release.wait(),
        )
        outcome = "stopped"
        try:
            outcome = await server.serve(head, inbound, writer)
        finally:
            with self._changed:
                sent.status = session.status
                sent.outcome = outcome
                self._changed.notify_all()

    def _as_provider(self, behaviour: Behaviour, body: bytes) -> Behaviour:
        """`behaviour` with what a provider's state adds to this request: its cached prefix
        (`prompt_cache`), a queue spike (`queue_spike_ms`)."""
        changes: dict[str, Any] = {}
        if behaviour.prompt_cache:
            changes["cached_tokens"] = self._prompt_cache.read(body)
        if behaviour.queue_spike_ms and behaviour.queue_spike_every_s > 0 and \
                (time.monotonic() - self._started_at) % behaviour.queue_spike_every_s < behaviour.queue_spike_s:
            changes["head_delay_ms"] = behaviour.head_delay_ms + behaviour.queue_spike_ms
        return dataclasses.replace(behaviour, **changes) if changes else behaviour

    def _new_response_id(self) -> str:
        return f"resp_fake{next(self._response_ids)}"

    def _finish(self, sent: Sent, watch: StreamWatch, outcome: str) -> None:
        with self._changed:
            sent.outcome = outcome
            self._changed.notify_all()
        watch.note_done()

    async def _respond(
        self,
        head: RequestHead,
        body: bytes,
        reply: Reply,
        behaviour: Behaviour,
        keep_alive: bool,
        sent: Sent,
        watch: StreamWatch,
        writer: asyncio.StreamWriter,
    ) -> str:
        """Write the reply shaped by the knobs; returns the outcome ("complete" or "reset")."""
        await sleep_ms(behaviour.head_delay_ms)
        if behaviour.reset_before_headers:
            reset_connection(writer)
            return "reset"
        if behaviour.interim_status:
            writer.write(_head(behaviour.interim_status, [("Link", "</style.css>; rel=preload")]))

        gzip = behaviour.gzip and header_has_token(head.headers, "accept-encoding", "gzip")
        coding = _ContentCoding(gzip)
        wire_chunks = [coding.encode(chunk) for chunk in reply.chunks]
        tail = coding.finish()
        if not reply.streamed:  # one body with a known length
            wire_chunks, tail = [b"".join(wire_chunks) + tail], b""
        headers = _response_headers(reply, coding.name, keep_alive, len(wire_chunks[0]) if not reply.streamed else None)
        with self._changed:
            sent.status, sent.headers = reply.status, headers
        await _write_head(writer, _head(reply.status, headers), behaviour.slow_headers_ms)

        for index in range(len(wire_chunks) + 1):
            if index == behaviour.reset_after_chunks:
                reset_connection(writer)
                return "reset"
            if index == behaviour.stall_after_chunks:
                await self._stall_release.wait()
            if index == len(wire_chunks):
                break
            await sleep_ms(behaviour.wait_before(index, reply, body))
            await watch.pass_gate(index)
            payload = wire_chunks[index]
            writer.write(_chunk_frame(payload) if reply.streamed else payload)
            await writer.drain()
            self._chunk_sent(sent, payload, index == reply.first_token_chunk)
            watch.note_sent()

        if reply.streamed:
            writer.write((_chunk_frame(tail) if tail else b"") + b"0\r\n\r\n")
            await writer.drain()
            with self._changed:
                sent.body += tail
        return "complete"


def _response_headers(reply: Reply, coding: str | None, keep_alive: bool, length: int | None) -> list[tuple[str, str]]:
    headers = [("Date", formatdate(usegmt=True)), ("Content-Type", reply.content_type)]
    if coding:
        headers.append(("Content-Encoding", coding))
    if length is None:
        headers += [("Transfer-Encoding", "chunked"), ("Cache-Control", "no-cache")]
    else:
        headers.append(("Content-Length", str(length)))
    headers.append(("Connection", "keep-alive" if keep_alive else "close"))
    return headers


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunk_frame(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


async def _write_head(writer: asyncio.StreamWriter, head: bytes, spread_ms: float) -> None:
    if spread_ms <= 0:
        writer.write(head)
        await writer.drain()
        return
    size = -(-len(head) // SLOW_HEADER_SLICES)
    for start in range(0, len(head), size):
        if start:
            await sleep_ms(spread_ms / SLOW_HEADER_SLICES)
        writer.write(head[start : start + size])
        await writer.drain()


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM / SIGINT; print `listening <base_url>` once ready."""
    parser = argparse.ArgumentParser(prog="python -m ttft_relay.testing.fakes.upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tls", action="store_true", help="serve HTTPS with a test certificate")
    parser.add_argument("--h2", action="store_true", help="with --tls: offer HTTP/2 too (ALPN h2, http/1.1)")
    parser.add_argument(
        "--certs-dir", help="with --tls: write ca.pem/cert.pem/key.pem here, so clients can trust ca.pem"
    )
    hints = typing.get_type_hints(Behaviour)
    for knob in hints:
        parser.add_argument("--" + knob.replace("_", "-"), dest=knob, metavar="VALUE")
    args = parser.parse_args(argv)
    knobs = {knob: parse_knob(kind, getattr(args, knob)) for knob, kind in hints.items() if getattr(args, knob) is not None}
    certs = TestCerts.create(args.certs_dir) if args.tls and args.certs_dir else None

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with FakeUpstream(tls=args.tls, certs=certs, port=args.port, behaviour=Behaviour(**knobs), h2=args.h2) as fake:
        print(f"listening {fake.base_url}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
