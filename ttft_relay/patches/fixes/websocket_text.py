"""A WebSocket text message an addon changed goes on with its characters whole.

mitmproxy passes a message on through a `Fragmentizer`: the sizes of the frames it came in
if its content kept its length, else pieces of `FRAGMENT_SIZE` (4,000) bytes — and it makes
each piece of a text message a wsproto event by decoding that piece alone with
`errors="replace"` (`Fragmentizer.msg`). A character of more than one byte that falls across
two pieces goes on as two or three U+FFFD. Every WebSocket turn the relay trims is such a
changed message (`trim.Trim` re-encodes Codex's `response.create`, and sends a turn refused as
too long again with `inject.websocket`, which takes the same way): a conversation with Chinese
in it reached the upstream with characters replaced at every 4,000th byte, a different text
than the client's (the model read it so, and the provider's prompt cache missed from there).

While installed, `Fragmentizer.msg` decodes a text message's pieces with one incremental UTF-8
decoder per message, kept on the `Fragmentizer` (mitmproxy makes one per message): a
character split between two pieces goes in the second piece's frame, whole. Bytes that are not
UTF-8 are still replaced, as mitmproxy does. Binary messages are untouched.
"""

from __future__ import annotations

import codecs
import weakref

import wsproto.events
from mitmproxy.proxy.layers import websocket

_ORIGINAL_MSG = websocket.Fragmentizer.msg
ORIGINALS = {(websocket.Fragmentizer, "msg"): _ORIGINAL_MSG}
PINS = {
    "Fragmentizer.msg": (_ORIGINAL_MSG, "32bf334c0b5e9936"),
    # one Fragmentizer per message (relay_messages, an injected message); its __call__ calls
    # msg for each piece in order, the last with message_finished
    "Fragmentizer.__init__": (websocket.Fragmentizer.__init__, "cbb6e60c87171bb4"),
    "Fragmentizer.__call__": (websocket.Fragmentizer.__call__, "b4c8fd9dcb743f66"),
    "WebsocketLayer.relay_messages": (websocket.WebsocketLayer.relay_messages, "2d451252c7287da0"),
}
WITHOUT = ("a WebSocket text message the relay changed (a trimmed turn) goes on with U+FFFD in place of a "
           "character that mitmproxy's re-framing split between two frames")

_decoders: weakref.WeakKeyDictionary[websocket.Fragmentizer, codecs.IncrementalDecoder] = weakref.WeakKeyDictionary()


def install() -> None:
    websocket.Fragmentizer.msg = _msg  # type: ignore[method-assign]  # the patch itself


def uninstall() -> None:
    websocket.Fragmentizer.msg = _ORIGINAL_MSG  # type: ignore[method-assign]  # the patch itself
    _decoders.clear()


def installed() -> bool:
    return websocket.Fragmentizer.msg is _msg


def _msg(self: websocket.Fragmentizer, data: bytes, message_finished: bool) -> wsproto.events.Message:
    if not self.is_text:
        return _ORIGINAL_MSG(self, data, message_finished)
    decoder = _decoders.get(self)
    if decoder is None:
        decoder = _decoders[self] = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(data, final=message_finished)
    if message_finished:
        del _decoders[self]
    return wsproto.events.TextMessage(text, message_finished=message_finished)
