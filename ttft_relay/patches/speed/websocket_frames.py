"""A big WebSocket message framed in a worker thread for its way on, not on the event loop.

mitmproxy's `WebsocketLayer` passes a message on by handing its content back to wsproto (a
`Fragmentizer` makes one wsproto event per frame it came in, a text message decoded to `str`
first), and wsproto frames it in the same step of the event loop: it copies the payload four
or five times, encodes a text message again and, towards the upstream (a client masks its
frames, RFC 6455 5.3), masks it with Python's byte slices. For a 23 MiB message that was
100-250 ms in which every other stream of the relay waited (issue 36: ten such messages at
once stalled another client's event stream 220 ms; py-spy put half of the loop's time in
wsproto's `_serialize_frame`).

`frame(content, text, mask)` builds the same frame wsproto would (one frame, FIN set, a fresh
random masking key when masked), masking a piece of `PIECE` bytes at a time, so that a thread
doing it gives the event loop the GIL between pieces. The relay's `stream.frames.WebSocketFrames`
runs it in a worker thread from its `websocket_message` hook (which mitmproxy awaits before it
passes the message on, the other streams served meanwhile) and hands the result over with
`hand_over(content, text, wire)`. While installed, the `Fragmentizer` of a message whose
content is that very object, and which came in one frame, yields one `Framed` event instead of
wsproto messages, and `WebsocketConnection.send2` sends a `Framed`'s bytes as they are. Anything
else, a message that came in fragments (mitmproxy keeps their sizes) or whose content an addon
replaced after the hook among them, takes wsproto's way as before. The hook frames nothing for a
socket that negotiated an extension (permessage-deflate compresses each frame with a context
kept across messages: wsproto's to keep).
"""

from __future__ import annotations

import codecs
import os
import struct
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import wsproto.events
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers import websocket
from wsproto.connection import ConnectionState
from wsproto.frame_protocol import FrameProtocol, Opcode, XorMaskerSimple

PIECE = 256 * 1024
"""Bytes masked in one step: what one holding of the GIL costs the event loop (well under a ms)."""

_ORIGINAL_FRAGMENTS = websocket.Fragmentizer.__call__
_ORIGINAL_SEND2 = websocket.WebsocketConnection.send2
ORIGINALS = {(websocket.Fragmentizer, "__call__"): _ORIGINAL_FRAGMENTS,
             (websocket.WebsocketConnection, "send2"): _ORIGINAL_SEND2}
PINS = {
    # a message is passed on as `for msg in fragmentizer(message.content): yield dst_ws.send2(msg)`,
    # right after its hook, with the fragment sizes it came in
    "WebsocketLayer.relay_messages": (websocket.WebsocketLayer.relay_messages, "2d451252c7287da0"),
    "Fragmentizer.__init__": (websocket.Fragmentizer.__init__, "cbb6e60c87171bb4"),
    "Fragmentizer.__call__": (_ORIGINAL_FRAGMENTS, "b4c8fd9dcb743f66"),
    "WebsocketConnection.send2": (_ORIGINAL_SEND2, "f33f2c236db2bec9"),
    # the frame `frame` builds: the header, the masking key after it, the payload masked
    "FrameProtocol._serialize_frame": (FrameProtocol._serialize_frame, "54db7d4e9bb11d8f"),
    "XorMaskerSimple.process": (XorMaskerSimple.process, "8d05071c048ce32e"),
}


class Framed(wsproto.events.Event):
    """A message's frame, built already: what `send2` sends as it is."""

    def __init__(self, content: bytes, text: bool, masked: bool, wire: bytes) -> None:
        self.content, self.text, self.masked, self.wire = content, text, masked, wire


def frame(content: bytes, text: bool, mask: bool, between: Callable[[], None] = lambda: None) -> bytes:
    """`content` as one final frame (TEXT or BINARY), masked with a fresh random key if `mask`
    (the frame a client sends): what wsproto's `FrameProtocol.send_data` makes of it without
    extensions, built a `PIECE` at a time, calling `between()` after each. Raises UnicodeDecodeError for a text that is not
    UTF-8 (mitmproxy would pass it on with its bad bytes replaced)."""
    n = len(content)
    view = memoryview(content)
    if text:
        decoder = codecs.getincrementaldecoder("utf-8")()
        for at in range(0, n, PIECE):
            decoder.decode(view[at:at + PIECE])
            between()
        decoder.decode(b"", final=True)
    head = bytearray([0x80 | (Opcode.TEXT if text else Opcode.BINARY)])
    mask_bit = 0x80 if mask else 0
    if n <= 125:
        head.append(mask_bit | n)
    elif n <= 0xFFFF:
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if not mask:
        return bytes(head) + content
    key = os.urandom(4)
    head += key
    out = bytearray(len(head) + n)
    out[:len(head)] = head
    masker = XorMaskerSimple(key)
    for at in range(0, n, PIECE):  # pieces of a multiple of 4 bytes: each starts at the key's first byte
        out[len(head) + at:len(head) + at + PIECE] = masker.process(view[at:at + PIECE])  # type: ignore[arg-type]  # wsproto copies it into a bytearray
        between()
    return bytes(out)


_handed: weakref.WeakValueDictionary[int, Framed] = weakref.WeakValueDictionary()
"""Framed messages by their content's id, until the layer passes them on; the message holds its
`Framed` (`hand_over`'s caller keeps it), so one never passed on goes with it."""


def hand_over(content: bytes, text: bool, masked: bool, wire: bytes) -> Framed:
    """`wire` is `content`'s frame (`frame`'s): the layer sends it instead of framing `content`
    itself. The caller keeps the `Framed` while the message may still be passed on."""
    framed = _handed[id(content)] = Framed(content, text, masked, wire)
    return framed


def install() -> None:
    websocket.Fragmentizer.__call__ = _fragments  # type: ignore[method-assign]  # the patch itself
    websocket.WebsocketConnection.send2 = _send2  # type: ignore[method-assign]  # the patch itself


def uninstall() -> None:
    websocket.Fragmentizer.__call__ = _ORIGINAL_FRAGMENTS  # type: ignore[method-assign]  # the patch itself
    websocket.WebsocketConnection.send2 = _ORIGINAL_SEND2  # type: ignore[method-assign]  # the patch itself
    _handed.clear()


def installed() -> bool:
    return websocket.Fragmentizer.__call__ is _fragments


def _fragments(self: websocket.Fragmentizer, content: bytes) -> Iterator[Any]:
    framed = _handed.pop(id(content), None)
    if (framed is not None and framed.content is content and framed.text == self.is_text
            and self.fragment_lengths == [len(content)]):
        yield framed
        return
    yield from _ORIGINAL_FRAGMENTS(self, content)


def _send2(self: websocket.WebsocketConnection, event: wsproto.events.Event) -> commands.SendData:
    if not isinstance(event, Framed):
        return _ORIGINAL_SEND2(self, event)
    wire, event.wire = event.wire, b""  # sent once; the message may be kept for viewing a while
    if event.masked != self._proto.client or any(
            e.enabled() for e in self._proto.extensions if e.name == "permessage-deflate"):
        # Not the frame this side sends after all: wsproto frames (and compresses) it.
        message = wsproto.events.TextMessage(event.content.decode()) if event.text \
            else wsproto.events.BytesMessage(event.content)
        return _ORIGINAL_SEND2(self, message)
    # As wsproto's `send`: a message to a socket no longer open sends nothing.
    return commands.SendData(self.conn, wire if self.state is ConnectionState.OPEN else b"")
