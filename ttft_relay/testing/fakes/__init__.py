"""Fake upstream servers and network helpers shared by the tests and benchmarks.

- `FakeUpstream` (upstream.py): OpenAI / Anthropic / Gemini look-alike with delay, fault and gate knobs;
  the Responses API over WebSocket too (websocket.py: `SocketSession`, `SocketTurn`).
- `RefusingProxy` (refusing_proxy.py): an HTTP(S) proxy that refuses every host, for clients that call home.
- `TestCerts` (certs.py): a test CA and a localhost server certificate.
- `DelayingForwarder` (forwarder.py): a TCP forwarder that makes an upstream far away (its TCP ends there).
- `FarLink` (link.py): a real far and lossy link: two network namespaces joined by a userspace packet
  forwarder between TUN devices, so TCP on both ends sees a real round trip and real retransmits.
- client.py: raw HTTP/1.1 client helpers that never buffer (`stream_post`, `slow_upload`, ...) and a
  WebSocket client (`WebSocketClient`, permessage-deflate, one Responses `turn()` at a time).
"""

from ttft_relay.testing.fakes.certs import TestCerts
from ttft_relay.testing.fakes.forwarder import DelayingForwarder
from ttft_relay.testing.fakes.link import FarLink
from ttft_relay.testing.fakes.refusing_proxy import RefusingProxy
from ttft_relay.testing.fakes.replies import answer_pieces, answer_text
from ttft_relay.testing.fakes.upstream import Behaviour, FakeUpstream, Gate, Received, Sent, StreamWatch
from ttft_relay.testing.fakes.websocket import SocketSession, SocketTurn

__all__ = [
    "Behaviour",
    "DelayingForwarder",
    "FakeUpstream",
    "FarLink",
    "Gate",
    "Received",
    "RefusingProxy",
    "Sent",
    "SocketSession",
    "SocketTurn",
    "StreamWatch",
    "TestCerts",
    "answer_pieces",
    "answer_text",
]
