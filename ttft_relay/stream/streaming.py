"""Streaming: every chunk of a response stream reaches the client as it arrives.

Bare mitmproxy reads a whole response before sending it on, so the first token
of a streamed completion arrives with the last. This addon turns streaming on in
`responseheaders` (later is too late) for every response that is a stream — an
event stream, a body of unknown length, or the answer to a request that asked for
a stream — whether or not the relay knows its API: the relay must never be the
reason a stream is buffered. For the relay's own flows (in scope) each chunk is
also shown to the flow's `sse.StreamWatcher` for timing, and a bounded copy is
kept so mitmweb can still show the body; other streams pass exactly as a bare
streaming mitmproxy passes them.

Responses that are not a body at all are never touched: a `101 Switching
Protocols` (the WebSocket upgrade: after it come frames, not a body, and any
framing header added here would corrupt them) and any other 1xx, a `204`, a `304`,
the answer to a `HEAD` or a `CONNECT`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Iterable
from typing import Protocol

from mitmproxy import ctx, http
from mitmproxy.utils import human

from .. import state
from ..flows import carries_body
from ..patches import connections, pins
from ..patches.fixes import interim_answers
from ..patches.speed import splice
from . import sse

logger = logging.getLogger(__name__)

TRUNCATED_NOTE = b"\n: [ttft-relay: body view truncated at relay_stream_view_max]\n\n"
ARRIVALS_MAX = 8192
"""Chunks of the body view whose arrival time is kept (for the event-stream view): 128 KiB at most."""


def should_stream(response_headers: http.Headers, client_asked_stream: bool) -> bool:
    """Whether a response is a stream: an event stream, a body of unknown length
    (chunked or HTTP/2 without Content-Length), or the answer to a request that asked
    for one. Error replies to a streaming request qualify too; streaming a short
    body costs nothing."""
    content_type = response_headers.get("content-type", "").lower()
    return (
        content_type.startswith("text/event-stream")
        or "content-length" not in response_headers
        or client_asked_stream
    )


class _Decompressor(Protocol):
    def decompress(self, data: bytes) -> bytes: ...


DECODED_MAX = 64 * 1024 * 1024
"""The most a compressed response stream is decoded to (as `scope.MAX_DECODED_BODY` bounds a
request body): an upstream's 2.5 MB gzip bomb was decoded to 1000 MB for its client."""


class ExpandsTooFar(ValueError):
    """A compressed stream whose decoded bytes pass the decoder's bound."""


def incremental_decoder(encoding: str, max_bytes: int = 0) -> _Decompressor | None:
    """A decoder that turns each compressed chunk into the bytes it completes,
    without waiting for the end of the body; None for an encoding we cannot
    stream-decode (the body then passes through still compressed). With `max_bytes`, it
    decodes no further than that in all: past it, ExpandsTooFar."""
    encoding = encoding.strip().lower()
    if encoding in ("gzip", "x-gzip"):
        return _Bounded(zlib.decompressobj(16 + zlib.MAX_WBITS), max_bytes)
    if encoding == "deflate":
        return _Bounded(zlib.decompressobj(), max_bytes)  # zlib-wrapped, as RFC 9110 says deflate is
    if encoding == "br":
        import brotli  # mitmproxy depends on it

        return _Bounded(_BrotliDecoder(brotli.Decompressor()), max_bytes)
    if encoding == "zstd":
        # As mitmproxy chooses (net/encoding.py): the standard library's from 3.14 on.
        if sys.version_info >= (3, 14):
            from compression import zstd
        else:
            from backports import zstd
        return _Bounded(zstd.ZstdDecompressor(), max_bytes)
    return None


class _BrotliDecoder:
    """brotli's Decompressor as zlib's: `decompress(data, max_length)`."""

    __slots__ = ("decompressor",)

    def __init__(self, decompressor) -> None:
        self.decompressor = decompressor

    def decompress(self, data: bytes, max_length: int = 0) -> bytes:
        if max_length:
            return self.decompressor.process(data, output_buffer_limit=max_length)
        return self.decompressor.process(data)


class _Bounded:
    """A decoder taking zlib's `max_length` (zlib, zstd, brotli through `_BrotliDecoder`) that
    decodes no more than `max_bytes` in all (0: no bound), never more than one byte past it."""

    __slots__ = ("decoder", "room", "max_bytes")

    def __init__(self, decoder, max_bytes: int) -> None:
        self.decoder = decoder
        self.room = max_bytes or -1
        self.max_bytes = max_bytes

    def decompress(self, data: bytes) -> bytes:
        if self.room < 0:
            return self.decoder.decompress(data)
        out = self.decoder.decompress(data, self.room + 1)
        self.room -= len(out)
        if self.room < 0:
            mib, rest = divmod(self.max_bytes, 1024 * 1024)
            bound = f"{mib} MiB" if not rest else f"{self.max_bytes} bytes"
            raise ExpandsTooFar(f"the upstream's compressed stream expands beyond {bound} when decoded")
        return out


class StreamTap:
    """The stream callable for one response: passes chunks on, feeds the watcher,
    keeps up to `view_max` bytes for the flow's stored body, and when the first
    ARRIVALS_MAX chunks of it arrived (`arrivals`: view length after the chunk,
    Unix time; flat pairs).

    It never returns `b""` for a non-empty chunk: an empty chunk on an HTTP/1
    chunked response is read by the client as end of body. `on_first_token`, if
    set, is called once, right after the chunk that held the first token.
    """

    __slots__ = ("watcher", "decoder", "view", "view_max", "truncated", "arrivals", "on_first_token", "on_too_far",
                 "failed")

    def __init__(
        self,
        watcher: sse.StreamWatcher,
        decoder: _Decompressor | None,
        view_max: int,
    ) -> None:
        self.watcher = watcher
        self.decoder = decoder
        self.view = bytearray()
        self.view_max = view_max
        self.truncated = False
        self.arrivals = array("d")
        self.on_first_token: Callable[[], None] | None = None
        self.on_too_far: Callable[[str], None] | None = None
        """Called once if the decoder's bound is passed (`ExpandsTooFar`): the rest is dropped."""
        self.failed = False

    def __call__(self, chunk: bytes) -> bytes | Iterable[bytes]:
        if self.failed:
            return []
        if self.decoder is not None and chunk:
            try:
                chunk = self.decoder.decompress(chunk)
            except ExpandsTooFar as e:
                self.failed = True
                if self.on_too_far is not None:
                    self.on_too_far(str(e))
                return []
            except Exception as e:  # zlib.error, brotli.error, ZstdError: no common base
                # An exception here would take mitmproxy's connection handler down
                # with it; pass the rest through as received and say so.
                logger.warning("upstream sent a corrupt compressed stream (%s); passing it on undecoded", e)
                self.decoder = None
            if not chunk:
                return []  # the decoder needs more input before it can emit anything
        if chunk:
            now = time.time()
            self.watcher.feed(chunk, now)
            if self.on_first_token is not None and self.watcher.first_token is not None:
                self.on_first_token()
                self.on_first_token = None
            if not self.truncated:
                room = self.view_max - len(self.view)
                if len(chunk) <= room:
                    self.view += chunk
                else:
                    self.view += chunk[: max(room, 0)]
                    self.truncated = True
                if len(self.arrivals) < 2 * ARRIVALS_MAX:
                    self.arrivals.append(len(self.view))
                    self.arrivals.append(now)
        return chunk

    def stored_body(self) -> bytes:
        return bytes(self.view) + (TRUNCATED_NOTE if self.truncated else b"")


def _end_expanding(flow: http.HTTPFlow, st: state.FlowState, message: str) -> None:
    """A compressed stream that passed `DECODED_MAX`: the flow fails (the client gets the API's
    error event where one can end the body, else a cut), its upstream connection closed
    once the read being passed on is done."""
    logger.warning("%s: %s; ending the stream", flow.request.host, message)
    st.record_error(message, status=502)
    asyncio.get_running_loop().call_soon(connections.close, flow.client_conn, flow.server_conn)


class Streaming:
    """Turns response streaming on for every response stream, watches the relay's
    own, and keeps proxies in front of the relay from buffering them again."""

    def __init__(self) -> None:
        self.enabled = True
        self.view_max = 256 * 1024

    def load(self, loader) -> None:
        # An interim 1xx from the upstream must not take the real answer's place.
        if pins.on(interim_answers):
            interim_answers.install()
        loader.add_option(
            "relay_stream",
            bool,
            True,
            "Stream responses that are streams (event streams, bodies of unknown length, "
            "answers to streamed requests) chunk by chunk instead of buffering them.",
        )
        loader.add_option(
            "relay_stream_view_max",
            str,
            "256k",
            "How much of each streamed body to keep for viewing in mitmweb "
            "(e.g. 256k, 1m; 0 keeps nothing). Bounds the relay's memory per flow.",
        )
        loader.add_option(
            "relay_stream_splice",
            bool,
            True,
            "Pass the chunks of a streamed HTTP/1 response from upstream to client in one step "
            "(ttft_relay/patches/speed/splice.py) instead of through mitmproxy's per-chunk event routing; "
            "the bytes are the same, the CPU per chunk lower.",
        )
        loader.add_option(
            "relay_stream_direct_reads",
            bool,
            True,
            "With relay_stream_splice: once a spliced body is chunked (over plain TCP or TLS on "
            "either side), read it from the upstream's socket straight into the client's, below "
            "mitmproxy's event loop task and layers; the bytes are the same, the CPU per read lower.",
        )

    def done(self) -> None:
        interim_answers.uninstall()
        splice.uninstall()

    def configure(self, updated) -> None:
        if "relay_stream" in updated:
            self.enabled = ctx.options.relay_stream
        if updated & {"relay_stream_splice", "relay_stream_direct_reads", pins.SPEED_OPTION}:
            if ctx.options.relay_stream_splice and pins.on(splice):
                splice.install(direct=ctx.options.relay_stream_direct_reads)
            else:
                splice.uninstall()
        if "relay_stream_view_max" in updated:
            self.view_max = human.parse_size(ctx.options.relay_stream_view_max) or 0

    def request(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is not None and st.stream and self.enabled:
            # A compressing upstream may hold bytes back until a compression block
            # fills up; identity keeps every event moving the moment it exists.
            flow.request.headers["accept-encoding"] = "identity"

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if not self.enabled or flow.response is None or not carries_body(flow.request, flow.response):
            return
        st = state.get(flow)
        headers = flow.response.headers
        if not should_stream(headers, st is not None and st.stream):
            return
        if st is None:
            # No API the relay knows: streamed, and otherwise exactly as mitmproxy passes it.
            flow.response.stream = True
            return
        decoder = None
        if encoding := headers.get("content-encoding"):
            decoder = incremental_decoder(encoding, DECODED_MAX)
            if decoder is not None:
                del headers["content-encoding"]
                headers.pop("content-length", None)
        if (
            flow.request.http_version == "HTTP/1.1"
            and "content-length" not in headers
            and "transfer-encoding" not in headers
        ):
            # An HTTP/2 upstream sends no length; without chunked framing an HTTP/1.1
            # client could only read to connection close.
            headers["transfer-encoding"] = "chunked"
        headers["x-accel-buffering"] = "no"
        headers.setdefault("cache-control", "no-cache")
        watcher = st.watcher = sse.StreamWatcher(st.api)
        tap = flow.response.stream = StreamTap(watcher, decoder, self.view_max)
        if decoder is not None:
            tap.on_too_far = lambda message: _end_expanding(flow, st, message)

    def response(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is not None and isinstance(response.stream, StreamTap) and response.raw_content is None:
            # Give mitmweb and saved flows the (bounded) body that went through.
            response.raw_content = response.stream.stored_body()
