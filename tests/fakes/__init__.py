"""Fake upstream servers and network helpers shared by the tests and benchmarks.

- `FakeUpstream` (upstream.py): OpenAI / Anthropic / Gemini look-alike with delay, fault and gate knobs.
- `TestCerts` (certs.py): a test CA and a localhost server certificate.
- `DelayingForwarder` (forwarder.py): a TCP forwarder that makes an upstream far away.
- client.py: raw HTTP/1.1 client helpers that never buffer (`stream_post`, `slow_upload`, ...).
"""

from tests.fakes.certs import TestCerts
from tests.fakes.forwarder import DelayingForwarder
from tests.fakes.replies import answer_pieces, answer_text
from tests.fakes.upstream import Behaviour, FakeUpstream, Gate, Received, Sent, StreamWatch

__all__ = [
    "Behaviour",
    "DelayingForwarder",
    "FakeUpstream",
    "Gate",
    "Received",
    "Sent",
    "StreamWatch",
    "TestCerts",
    "answer_pieces",
    "answer_text",
]
