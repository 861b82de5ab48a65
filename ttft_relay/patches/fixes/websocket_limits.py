"""WebSocket messages bounded as they are read: their size once inflated, their fragments,
and the control frames around them.

mitmproxy's `WebsocketLayer` reads each side of a socket through a wsproto connection of
its own (`WebsocketConnection`), and wsproto has no bound: it inflates a permessage-deflate
frame in one call whatever it expands to (a 972 KB frame became 1 GB in memory, every other
stream stalled while it did, and the whole GB was then forwarded), the layer gathers a
message of any size and any number of fragments before its hook, and every ping is logged
and passed on (100k of them stalled the relay for seconds). The wrap of
`WebsocketConnection.__init__` gives each side's wsproto connection two extensions:

- `BoundedDeflate`, wsproto's `PerMessageDeflate` with the parameters the handshake
  negotiated, inflates no more than the message may still grow (zlib's `max_length`):
  a bomb costs at most the bound's worth of memory and inflating, never the whole of it;
- `MessageLimits`, an extension that takes no reserved bit and so is always on (and never
  offered), counts each message's bytes after inflating and its frames, refuses an
  uncompressed frame that would pass the bound from its header (before its payload is
  read), and takes one token of a bucket per control frame (ping, pong, close).

Besides each message's bound, the messages clients are sending have one bound together
(`Budget`, `Bounds.total_bytes`): bytes of messages read and not yet complete, across the
relay (50 sockets each 23 MiB into a message held 1.9 GB, and the loop spent seconds on them
while other clients' streams waited). A client whose message takes the total past it is
paused: its socket is not read (asyncio's `pause_reading` on its transport, through
`connections`) until the messages ahead of it complete, and it waits in its own kernel
buffers, not the relay's memory. The oldest message being read is never paused, so one always
completes and frees its share: the relay holds at most the budget, plus one message, plus
what each paused socket had read already (its reader's buffer).

And each message is gathered in linear time: the layer appends each piece wsproto hands it
to the message's last frame with `frame_buf[-1] += data`, which for `bytes` copies the whole
frame so far each time (a 20 MiB frame read 64 KiB at a time: 3 GB copied, the event loop
late by up to 2.5 s for every other stream while 8 of them came in). While installed,
`WebsocketConnection.frame_buf` is a property that keeps the pieces as bytearrays
(`GrowingFrames`), which `+=` extends in place; `b"".join` and `len` read them as before.

A client refused for its message gets its close frame: the layer writes the close and
closes the connection at once, while the client is still sending the message (a 30 MiB one
is not done in a moment); closing a socket with unread bytes sends a reset, and the
client's kernel drops the close frame it had not read yet. The wrap of
`ConnectionHandler.close_connection` closes such a client's connection lingering: a FIN
after the close frame, its further bytes read and dropped (the layer is done with them), and
the socket closed once the client closes its side, or after `LINGER_S`.

Past a bound it raises wsproto's `ParseFailed`, which wsproto turns into the close event it
makes for any protocol error; the layer then sends that close to both sides and ends the
flow (`flow.websocket.close_code`, `close_reason`: where the turn's record finds it):
1009 (message too big) for the size, 1008 (policy violation) for fragments and control
frames; the reason starts with `REASON_PREFIX`. Each such close is one warning in the log.

wsproto's `PerMessageDeflate` keeps its state in private attributes (`_decompressor`,
`_inbound_compressed`, `_inbound_is_compressible`, `_enabled`); the pin test pins wsproto's
version and the code that sets and reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection
from mitmproxy.proxy import server
from mitmproxy.proxy.layers.websocket import WebsocketConnection, WebsocketLayer
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.extensions import Extension, PerMessageDeflate
from wsproto.frame_protocol import CloseReason, FrameDecoder, FrameProtocol, Opcode, ParseFailed, RsvBits
from wsproto.utilities import split_comma_header

logger = logging.getLogger(__name__)

REASON_PREFIX = "ttft-relay: "
"""The close reason of a socket a bound closed starts with this."""


@dataclass(frozen=True, slots=True)
class Bounds:
    message_bytes: int = 24 * 1024 * 1024
    """A message's size, after inflating; 0: none."""
    fragments: int = 4096
    """Frames of one message."""
    control_burst: int = 100
    """Control frames (ping, pong) a side may send at once ..."""
    control_per_s: float = 10.0
    """... and per second after that."""
    total_bytes: int = 64 * 1024 * 1024
    """The messages being read from clients, together (`Budget`); 0: no bound."""


class Budget:
    """Bytes of client messages being read across the relay, bounded: a client whose message
    takes the total past `limit` is paused (its socket not read) until there is room again
    (sans-IO: `pause` and `resume` act on a side, given its `MessageLimits`)."""

    def __init__(self, limit: int, pause: Callable[[Any], bool], resume: Callable[[Any], None]) -> None:
        self.limit, self.pause, self.resume = limit, pause, resume
        self.used = 0
        self.reading: OrderedDict[MessageLimits, None] = OrderedDict()
        """The sides with a message being read, the oldest first: it is never paused."""
        self.paused: OrderedDict[MessageLimits, None] = OrderedDict()
        self.pauses = 0
        """Clients paused so far (for tests and the benchmark)."""

    def grow(self, side: MessageLimits, n: int) -> None:
        if side not in self.reading:
            self.reading[side] = None
        self.used += n
        if side in self.paused:
            self.pause(side)  # again: bytes came, so something resumed its reading (asyncio's own flow control)
        elif (self.limit and self.used > self.limit and next(iter(self.reading)) is not side
              and self.pause(side)):
            if not self.paused:
                logger.info("WebSocket messages in flight from clients past %s (relay_websocket_inflight_max): "
                            "pausing the clients that send more until there is room", _size(self.limit))
            self.paused[side] = None
            self.pauses += 1

    def release(self, side: MessageLimits) -> None:
        """`side`'s message is complete (or its socket gone): its bytes are free."""
        if side in self.reading:
            del self.reading[side]
            self.used -= side.size
        if side in self.paused:
            del self.paused[side]
            self.resume(side)
        if self.reading and (oldest := next(iter(self.reading))) in self.paused:
            del self.paused[oldest]  # the oldest message must go on, or none completes
            self.resume(oldest)
        while self.paused and (not self.limit or self.used < self.limit):
            first, _ = self.paused.popitem(last=False)
            self.resume(first)


_ORIGINAL_INIT = WebsocketConnection.__init__
_ORIGINAL_CLOSE = server.ConnectionHandler.close_connection
ORIGINALS = {(WebsocketConnection, "__init__"): _ORIGINAL_INIT,
             (server.ConnectionHandler, "close_connection"): _ORIGINAL_CLOSE}
LINGER_S = 5.0
"""How long a refused client may go on sending after its close frame before its socket closes."""
PINS = {
    # a full close cancels the connection's task (which closes the socket); a half close writes a FIN
    # and leaves the task reading
    "ConnectionHandler.close_connection": (_ORIGINAL_CLOSE, "c0d10cc05dd65b80"),
    # each side's wsproto connection is made here, with the extensions the wrap bounds
    "WebsocketConnection.__init__": (_ORIGINAL_INIT, "f77a8c21ac12e55f"),
    # ... from PerMessageDeflate objects the 101's header negotiated, one per side
    "WebsocketLayer.start": (WebsocketLayer.start, "8445ad1cfb2fcca5"),
    # a close event (wsproto's for a ParseFailed) goes to both sides, its code and reason onto the flow
    "WebsocketLayer.relay_messages": (WebsocketLayer.relay_messages, "2d451252c7287da0"),
    # wsproto's state BoundedDeflate reads (_inbound_compressed, _inbound_is_compressible, _decompressor, _enabled)
    "PerMessageDeflate.__init__": (PerMessageDeflate.__init__, "e892804c68998e20"),
    "PerMessageDeflate.frame_inbound_header": (PerMessageDeflate.frame_inbound_header, "5451a091b37fe47d"),
    "PerMessageDeflate.frame_inbound_payload_data": (PerMessageDeflate.frame_inbound_payload_data, "93bc8692346aa787"),
    "PerMessageDeflate.frame_inbound_complete": (PerMessageDeflate.frame_inbound_complete, "15ecc689b99856b3"),
    # the order of the extension calls: headers, then each payload piece, then the frame's end
    "FrameDecoder.process_buffer": (FrameDecoder.process_buffer, "f19287e506f3178b"),
    "FrameDecoder.extension_processing": (FrameDecoder.extension_processing, "2b4d39daae0088c8"),
    "FrameProtocol.__init__": (FrameProtocol.__init__, "037e847db237d081"),
    # a ParseFailed raised by an extension becomes a close event with its code and reason
    "Connection.events": (Connection.events, "e4d77be0bfef1af2"),
}
_bounds = Bounds()
_budget: Budget | None = None


def install(bounds: Bounds, pause: Callable[[Any], bool] | None = None,
            resume: Callable[[Any], None] | None = None) -> None:
    """Sockets opened from now on are bounded by `bounds`; with `pause` and `resume` (which
    stop and start reading a client's connection, and say whether they could), the messages
    clients send have `bounds.total_bytes` together."""
    global _bounds, _budget
    _bounds = bounds
    _budget = Budget(bounds.total_bytes, pause, resume) if pause is not None and resume is not None else None
    WebsocketConnection.__init__ = _bounded_init  # type: ignore[method-assign, assignment]  # the patch itself
    WebsocketConnection.frame_buf = _FRAME_BUF  # type: ignore[assignment]  # the patch itself
    server.ConnectionHandler.close_connection = _lingering_close  # type: ignore[method-assign, assignment]  # the patch itself


def uninstall() -> None:
    global _bounds, _budget
    _bounds, _budget = Bounds(), None
    WebsocketConnection.__init__ = _ORIGINAL_INIT  # type: ignore[method-assign]  # the patch itself
    server.ConnectionHandler.close_connection = _ORIGINAL_CLOSE  # type: ignore[method-assign]  # the patch itself
    if vars(WebsocketConnection).get("frame_buf") is _FRAME_BUF:
        del WebsocketConnection.frame_buf


def _lingering_close(self: server.ConnectionHandler, conn: connection.Connection, half_close: bool = False) -> None:
    if half_close or _refused.get(conn) != "client" or conn in _lingering:
        _ORIGINAL_CLOSE(self, conn, half_close)
        return
    _lingering.add(conn)
    _ORIGINAL_CLOSE(self, conn, half_close=True)  # the close frame, then a FIN; the client's bytes still read
    try:
        asyncio.get_running_loop().call_later(LINGER_S, _close_if_open, self, conn)
    except RuntimeError:  # no loop (a layer test): closed now
        _ORIGINAL_CLOSE(self, conn)


def _close_if_open(handler: server.ConnectionHandler, conn: connection.Connection) -> None:
    if conn.state is not connection.ConnectionState.CLOSED and conn in handler.transports:
        _ORIGINAL_CLOSE(handler, conn)


_lingering: weakref.WeakSet[object] = weakref.WeakSet()
"""Refused clients' connections closed lingering (a second close closes them for good)."""


class GrowingFrames(list):
    """A message's frames as the layer gathers them, each a bytearray: `frames[-1] += data`
    extends it in place (for `bytes` it copied the whole frame each time)."""

    def __init__(self, frames: Any = ()) -> None:
        super().__init__(bytearray(f) for f in frames)

    def append(self, frame: Any) -> None:
        super().append(bytearray(frame))


def _get_frames(self: WebsocketConnection) -> GrowingFrames:
    return self.__dict__["_ttft_frames"]


def _set_frames(self: WebsocketConnection, frames: list[bytes]) -> None:
    self.__dict__["_ttft_frames"] = GrowingFrames(frames)


_FRAME_BUF = property(_get_frames, _set_frames)


def budget() -> Budget | None:
    return _budget


def ended(*conns: object) -> None:
    """A socket ended (its connections given): whatever it was reading frees its share."""
    for conn in conns:
        if _budget is not None and (side := _sides.get(conn)) is not None:
            _budget.release(side)


def _bounded_init(self: WebsocketConnection, connection_type: ConnectionType, extensions=None, *args, conn, **kwargs):
    # mitmproxy's SERVER side reads the client's frames, its CLIENT side the upstream's.
    peer = "client" if connection_type is ConnectionType.SERVER else "upstream"
    limits = MessageLimits(_bounds, peer, conn, _budget if peer == "client" else None)
    if limits.budget is not None:
        _sides[conn] = limits
    bounded = [BoundedDeflate(e, limits) if type(e) is PerMessageDeflate else e for e in extensions or ()]
    _ORIGINAL_INIT(self, connection_type, [*bounded, limits], *args, conn=conn, **kwargs)


_sides: weakref.WeakKeyDictionary[object, MessageLimits] = weakref.WeakKeyDictionary()
"""Each client connection's reading side, where a budget counts it."""
_refused: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()
"""The connections whose messages a bound refused, with the side that sent them."""


def refused_by(*conns: object) -> str | None:
    """Which side's message a bound refused ("client" or "upstream") on a socket, given its
    connections; None if no bound closed it (a close reason alone could be forged)."""
    return next((_refused[c] for c in conns if c in _refused), None)


class MessageLimits(Extension):
    """Counts what one side sends and ends its socket past a bound (the module docstring).
    Comes last among the extensions: wsproto hands it each payload after inflating."""

    name = "ttft-relay-limits"

    def __init__(self, bounds: Bounds, peer: str, conn: object = None, budget: Budget | None = None) -> None:
        self.bounds, self.peer, self.conn, self.budget = bounds, peer, conn, budget
        self.size = 0
        """Bytes of the message being read, after inflating."""
        self.fragments = 0
        self.compressed = False
        self.control = False
        """Whether the frame being read is a control frame (they may come between fragments)."""
        self.tokens = float(bounds.control_burst)
        self.refilled = time.monotonic()

    def enabled(self) -> bool:
        return True

    def offer(self) -> bool:
        return False

    def room(self) -> int:
        """Bytes the message being read may still grow by (-1: no bound)."""
        return self.bounds.message_bytes - self.size if self.bounds.message_bytes else -1

    def frame_inbound_header(self, proto: FrameDecoder | FrameProtocol, opcode: Opcode, rsv: RsvBits,
                             payload_length: int) -> RsvBits:
        self.control = opcode.iscontrol()
        if self.control:
            self._control_frame()
            return RsvBits(False, False, False)
        if opcode is not Opcode.CONTINUATION:
            self._complete()
            self.size, self.fragments, self.compressed = 0, 0, rsv.rsv1
        self.fragments += 1
        if self.fragments > self.bounds.fragments:
            self._refuse(f"message in more than {self.bounds.fragments} fragments", CloseReason.POLICY_VIOLATION)
        if not self.compressed and 0 <= self.room() < payload_length:
            self._too_big()
        return RsvBits(False, False, False)

    def frame_inbound_payload_data(self, proto: FrameDecoder | FrameProtocol, data: bytes) -> bytes:
        if not self.control:
            self.count(len(data))
        return data

    def frame_inbound_complete(self, proto: FrameDecoder | FrameProtocol, fin: bool) -> None:
        if fin and not self.control:
            self._complete()
        return None

    def _complete(self) -> None:
        if self.budget is not None:
            self.budget.release(self)
        self.size = self.fragments = 0

    def count(self, n: int) -> None:
        self.size += n
        if self.budget is not None:
            self.budget.grow(self, n)
        if self.room() < 0 and self.bounds.message_bytes:
            self._too_big()

    def _control_frame(self) -> None:
        now = time.monotonic()
        b = self.bounds
        self.tokens = min(float(b.control_burst), self.tokens + (now - self.refilled) * b.control_per_s)
        self.refilled = now
        if self.tokens < 1:
            self._refuse(f"more than {b.control_burst} control frames at once, or {b.control_per_s:g}/s",
                         CloseReason.POLICY_VIOLATION)
        self.tokens -= 1

    def _too_big(self) -> None:
        self._refuse(f"message over {_size(self.bounds.message_bytes)} (relay_websocket_message_max)",
                     CloseReason.MESSAGE_TOO_BIG)

    def _refuse(self, what: str, code: CloseReason) -> None:
        reason = f"{REASON_PREFIX}{what} from the {self.peer}"
        if self.conn is not None:
            _refused[self.conn] = self.peer
        if self.budget is not None:
            self.budget.release(self)
        logger.warning("WebSocket %s: %s; closing the socket (%d)", getattr(self.conn, "peername", None) or "", reason,
                       code)
        raise ParseFailed(reason, code)


class BoundedDeflate(PerMessageDeflate):
    """wsproto's permessage-deflate, as negotiated, inflating no more than `limits` leaves room for."""

    def __init__(self, negotiated: PerMessageDeflate, limits: MessageLimits) -> None:
        super().__init__(negotiated.client_no_context_takeover, negotiated.client_max_window_bits,
                         negotiated.server_no_context_takeover, negotiated.server_max_window_bits)
        self._enabled = negotiated.enabled()
        self.limits = limits

    def frame_inbound_payload_data(self, proto: FrameDecoder | FrameProtocol, data: bytes) -> bytes | CloseReason:
        room = self.limits.room()
        if room < 0 or not self._inbound_compressed or not self._inbound_is_compressible:
            return super().frame_inbound_payload_data(proto, data)
        assert self._decompressor is not None
        try:
            out = self._decompressor.decompress(bytes(data), room + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        if len(out) > room:
            self.limits.count(len(out))  # raises: the message passed its bound
        return out

    def frame_inbound_complete(self, proto: FrameDecoder | FrameProtocol, fin: bool) -> bytes | CloseReason | None:
        # What the end of the message flushes out comes after the payloads the limits counted.
        # Every payload was inflated whole within the bound, so this is a few bytes at most.
        out = super().frame_inbound_complete(proto, fin)
        if isinstance(out, bytes) and out and self.limits.room() >= 0:
            self.limits.count(len(out))
        return out


def valid_extensions(header: str) -> str:
    """A 101's `Sec-WebSocket-Extensions` without the permessage-deflate offers mitmproxy's
    `WebsocketLayer.start` would fail on: it finalizes each with wsproto, which raises on a
    parameter out of range or without its value (an exception there took the connection's
    handler down)."""
    kept = []
    for ext in split_comma_header(header.encode("ascii", "replace")):
        if ext.split(";", 1)[0].strip() == PerMessageDeflate.name:
            try:
                PerMessageDeflate().finalize(ext)
            except (ValueError, IndexError):
                continue
        kept.append(ext)
    return header if len(kept) == len(split_comma_header(header.encode("ascii", "replace"))) else ", ".join(kept)


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n % (1024 * 1024) == 0 else f"{n} bytes"
