"""Upstream TLS sessions resumed (ttft_relay/tls_resumption.py), through a real mitmdump.

Each request comes on a new client connection and the pool is off, so each opens an upstream
connection of its own to the HTTPS fake (Python's ssl: TLS 1.3, two session tickets per
handshake). The first handshake is a full one; the next resume the session the one before
left, and their records say so. With `relay_upstream_tls_resumption=false` every one is full.
"""

from __future__ import annotations

import pytest

from tests.test_upstream_pool_e2e import first_token_ms, new_connection_request
from ttft_relay.testing.fakes.client import HttpConnection

REQUESTS = 3


@pytest.mark.parametrize("resumption", [True, False], ids=["on", "off"])
def test_new_upstream_connections_resume_the_last_session(fake_tls, start_relay, rid, resumption):
    relay = start_relay(f"reverse:https://localhost:{fake_tls.port}@0", relay_trim="false",
                        relay_upstream_pool="false", relay_upstream_tls_resumption=str(resumption).lower())
    for _ in range(REQUESTS):
        new_connection_request(relay.url(), rid)
    records = relay.log.of(rid, REQUESTS)
    assert all(rec["status"] == 200 and "upstream_tls" in rec["phases"] for rec in records), records
    assert [rec["upstream_tls_resumed"] for rec in records] == [False, *[resumption] * (REQUESTS - 1)]


def test_a_request_on_a_kept_connection_waited_for_no_handshake(fake_tls, start_relay, rid):
    relay = start_relay(f"reverse:https://localhost:{fake_tls.port}@0", relay_trim="false",
                        relay_upstream_pool="false")
    with HttpConnection(relay.url()) as conn:
        first_token_ms(conn, rid)
        first_token_ms(conn, rid)
    first, second = relay.log.of(rid, 2)
    assert first["upstream_tls_resumed"] is False
    assert second["reused_connection"] and second["upstream_tls_resumed"] is None
