"""Big WebSocket messages framed for their way on in a worker thread, not on the event loop.

Framing a message of megabytes is pure work on bytes (a text's UTF-8 checked, a client's
frame masked), and on the event loop it stalled every other stream for its length (issue 36:
~100-250 ms per 23 MiB message). From `OFF_LOOP_BYTES` on, this addon's `websocket_message`
hook (after trim's, which may change the message; mitmproxy awaits every hook before it passes
the message on) frames it in a thread of its own, one message at a time, a `websocket_frames.PIECE` at a time,
letting go of the GIL after each piece (`time.sleep(0)`), and hands the frame to the speed patch that sends it (`patches/speed/websocket_frames.py`
says which messages take that way; the others are framed by wsproto as before).

One thread, not asyncio's pool: the GIL is handed to a waiting thread only every switch
interval (5 ms), and with several threads framing at once (ten sockets' messages) the event
loop waited behind each of them in turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from mitmproxy import http
from mitmproxy.websocket import WebSocketMessage

from ..patches import pins
from ..patches.speed import websocket_frames

logger = logging.getLogger(__name__)

OFF_LOOP_BYTES = 1024 * 1024
"""Messages from this size on are framed in a worker thread (below it, the thread's hand-off
costs about what framing does)."""


class WebSocketFrames:
    """Big WebSocket messages framed off the event loop (a speed patch: `relay_speed_patches`)."""

    def __init__(self) -> None:
        self.kept: weakref.WeakKeyDictionary[WebSocketMessage, websocket_frames.Framed] = weakref.WeakKeyDictionary()
        """Each framed message's frame, until it is sent (or the message is gone)."""
        self.framing: ThreadPoolExecutor | None = None
        """The one thread that frames, from the first big message on."""

    def configure(self, updated: set[str]) -> None:
        if pins.SPEED_OPTION in updated:
            if pins.on(websocket_frames):
                websocket_frames.install()
            else:
                websocket_frames.uninstall()

    def done(self) -> None:
        websocket_frames.uninstall()
        if self.framing is not None:
            self.framing.shutdown(wait=False, cancel_futures=True)
            self.framing = None

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        if not websocket_frames.installed() or flow.websocket is None or flow.response is None:
            return
        message = flow.websocket.messages[-1] if flow.websocket.messages else None
        if message is None or message.dropped or len(message.content) < OFF_LOOP_BYTES:
            return
        if flow.response.headers.get("sec-websocket-extensions", "").strip():
            return  # permessage-deflate: each frame compressed with a context wsproto keeps
        content = message.content
        # A client's message goes to the upstream: as the client of that side, the relay masks it.
        if self.framing is None:
            self.framing = ThreadPoolExecutor(1, thread_name_prefix="ttft-relay-frames")
        try:
            wire = await asyncio.get_running_loop().run_in_executor(
                self.framing, websocket_frames.frame, content, message.is_text, message.from_client, _let_go)
        except UnicodeDecodeError:
            return  # not UTF-8: mitmproxy passes it on with its bad bytes replaced
        if not message.dropped and message.content is content:
            self.kept[message] = websocket_frames.hand_over(content, message.is_text, message.from_client, wire)


def _let_go() -> None:
    """The GIL handed to the event loop if it waits for it (a sleep of 0 lets go of it)."""
    time.sleep(0)
