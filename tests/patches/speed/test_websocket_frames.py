"""Pin test of ttft_relay/patches/speed/websocket_frames.py: the frame it builds is wsproto's, a
handed-over frame is what the layer sends, anything else goes wsproto's way; the relay's hook
(ttft_relay/stream/frames.py) frames a big message in a worker thread, not on the event loop; end to
end, big messages reach the upstream byte for byte."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

import pytest
import wsproto.events
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers import websocket
from mitmproxy.test import tflow
from mitmproxy.websocket import WebSocketData, WebSocketMessage
from wsproto import Connection, ConnectionType
from wsproto.frame_protocol import Opcode

from ttft_relay.patches.speed import websocket_frames
from ttft_relay.stream import frames
from ttft_relay.testing.fakes import hostile
from ttft_relay.testing.fakes.hostile import BINARY, CLOSE, TEXT, HostileUpstream, RawClient, frame
from tests.patches.pins import assert_unchanged, source

MIB = 1024 * 1024


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(websocket_frames.PINS, websocket_frames)


def test_the_lines_it_depends_on():
    # A message goes on right after its hook, each piece the fragmentizer makes through send2.
    relay_messages = source(websocket.WebsocketLayer.relay_messages)
    assert "yield WebsocketMessageHook(self.flow)" in relay_messages
    assert "for msg in fragmentizer(message.content):\n                            yield dst_ws.send2(msg)" \
        in relay_messages


@pytest.fixture
def installed():
    websocket_frames.install()
    yield
    websocket_frames.uninstall()


@pytest.mark.parametrize("text", [False, True], ids=["binary", "text"])
@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, websocket_frames.PIECE * 3 + 5])
def test_the_frame_is_the_one_wsproto_makes(text, size):
    content = ("é" * (size // 2)).encode() if text else os.urandom(size)
    event = wsproto.events.TextMessage(content.decode()) if text else wsproto.events.BytesMessage(content)
    # Towards a client: unmasked, byte for byte wsproto's.
    assert websocket_frames.frame(content, text, mask=False) == Connection(ConnectionType.SERVER).send(event)
    # Towards an upstream: masked with a key of its own, which the upstream's wsproto reads back.
    upstream = Connection(ConnectionType.SERVER)
    upstream.receive_data(websocket_frames.frame(content, text, mask=True))
    got = list(upstream.events())
    assert b"".join(e.data.encode() if text else e.data for e in got) == content and got[-1].message_finished
    assert websocket_frames.frame(content, text, mask=True) != websocket_frames.frame(content, text, mask=True) \
        or size == 0  # a fresh masking key for each frame


def test_a_text_that_is_not_utf8_is_left_to_mitmproxy():
    with pytest.raises(UnicodeDecodeError):
        websocket_frames.frame(b"ok" * websocket_frames.PIECE + b"\xff", True, mask=True)


def _side(role: ConnectionType) -> websocket.WebsocketConnection:
    return websocket.WebsocketConnection(role, conn=tflow.tclient_conn())


def test_a_handed_over_frame_is_what_the_layer_sends(installed):
    content = os.urandom(1000)
    framed = websocket_frames.hand_over(content, False, True, b"the frame")
    pieces = list(websocket.Fragmentizer([content], False)(content))
    assert pieces == [framed]
    sent = _side(ConnectionType.CLIENT).send2(pieces[0])
    assert isinstance(sent, commands.SendData) and sent.data == b"the frame"
    assert framed.wire == b""  # not held once sent


@pytest.mark.parametrize("case", ["fragmented", "content replaced", "other side", "not handed over"])
def test_anything_else_goes_wsprotos_way(installed, case):
    content = os.urandom(1000)
    if case != "not handed over":
        framed = websocket_frames.hand_over(content, False, True, b"the frame")  # a client's: masked
    fragments = [content[:400], content[400:]] if case == "fragmented" else [content]
    # An equal content, not the very object the hook framed: an addon replaced it after.
    passed = bytearray(content) if case == "content replaced" else content
    pieces = list(websocket.Fragmentizer(fragments, False)(passed))
    if case == "other side":  # the handed frame was a client's (masked); the layer sends to the client
        assert pieces == [framed]
        sent = _side(ConnectionType.SERVER).send2(pieces[0])
        assert sent.data == Connection(ConnectionType.SERVER).send(wsproto.events.BytesMessage(content))
        return
    assert all(isinstance(p, wsproto.events.BytesMessage) for p in pieces)
    assert b"".join(p.data for p in pieces) == content


def _flow(content: bytes, text: bool = False, from_client: bool = True, extensions: str = ""):
    flow = tflow.twebsocketflow()
    if extensions:
        flow.response.headers["sec-websocket-extensions"] = extensions
    else:
        flow.response.headers.pop("sec-websocket-extensions", None)
    flow.websocket = WebSocketData()
    flow.websocket.messages.append(WebSocketMessage(Opcode.TEXT if text else Opcode.BINARY, from_client, content))
    return flow


def test_the_hook_frames_a_big_message_in_a_worker_thread(installed, monkeypatch):
    threads = []
    original = websocket_frames.frame

    def recording(*args):
        threads.append(threading.get_ident())
        return original(*args)

    monkeypatch.setattr(websocket_frames, "frame", recording)
    addon = frames.WebSocketFrames()
    big = _flow(b"a" * frames.OFF_LOOP_BYTES)

    async def hook() -> int:
        await addon.websocket_message(big)
        await addon.websocket_message(_flow(b"a" * (frames.OFF_LOOP_BYTES - 1)))  # small: on the loop, as before
        await addon.websocket_message(_flow(b"a" * frames.OFF_LOOP_BYTES, extensions="permessage-deflate"))
        return threading.get_ident()

    loop_thread = asyncio.run(hook())
    assert len(threads) == 1 and threads[0] != loop_thread
    message = big.websocket.messages[-1]
    framed = addon.kept[message]
    assert list(websocket.Fragmentizer([message.content], False)(message.content)) == [framed]
    upstream = Connection(ConnectionType.SERVER)
    upstream.receive_data(framed.wire)
    assert b"".join(e.data for e in upstream.events()) == message.content
    addon.done()  # its thread ends; the patch is out
    assert not websocket_frames.installed()


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream():
    with HostileUpstream({}) as u:
        yield u


@pytest.mark.parametrize("speed", ["true", "false"])
def test_big_messages_reach_the_upstream_byte_for_byte(upstream, shared_relay, speed):
    relay = shared_relay(f"reverse:{upstream.base_url}@0", relay_speed_patches=speed)
    text = ("{\"type\": \"response.create\", \"input\": \"" + "é" * MIB + "\"}").encode()
    binary = os.urandom(3 * MIB)
    with RawClient(relay.port, deflate=False, timeout=60, headers={"x-request-id": f"frames-{speed}"}) as c:
        c.send(frame(TEXT, text, masked=True))
        c.send(frame(BINARY, binary, masked=True))
        c.send(frame(BINARY, b"small", masked=True))
        c.send(frame(CLOSE, b"\x03\xe8", masked=True))
        f = c.until_close(60)
    assert f is not None and hostile.close_code(f) == 1000
    session = next(s for s in upstream.wait_ended(len(upstream.sessions), 60)
                   if s.headers.get("x-request-id") == f"frames-{speed}")
    assert session.digest.hexdigest() == hashlib.sha256(text + binary + b"small").hexdigest()
