"""A new upstream connection's round trips on the real far link (ttft_relay/testing/fakes/link.py).

The HTTPS fake beyond a link of ONE_WAY_MS each way, the relay beside the client with the pool
off, so each request on a new client connection opens an upstream connection of its own.

- TLS 1.2 (the relay's upstream TLS capped there): a full handshake takes two round trips, one
  that resumes the session of the connection before takes one (`tls_resumption`). TLS 1.3
  takes one either way: resuming saves its certificate and verification, not a round trip
  (docs/benchmarks.md).
- A 32 kB request leaves a new connection in one flight only with a larger initial window on
  the route (the README's optional VPS step): with the kernel's ten segments it waits a round
  trip more (`upstream_upload`).

Times are held against the same record's `upstream_connect` (one round trip on this link).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.pool_cc import body, request
from tests.test_far_links_e2e import relay_in
from ttft_relay.testing.fakes import link
from ttft_relay.testing.fakes.upstream import FakeUpstream

ONE_WAY_MS = 50


@pytest.fixture
def far_tls(far_link, certs) -> Iterator[tuple[link.FarLink, FakeUpstream]]:
    far = far_link(delay_ms=ONE_WAY_MS)
    with far.far.entered():
        fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip).start()
    try:
        fake.behaviour.prefill_ms = 5
        yield far, fake
    finally:
        fake.stop()


def test_a_tls12_handshake_that_resumes_takes_one_round_trip_not_two(far_tls, confdir, tmp_path, rid):
    far, fake = far_tls
    relay = relay_in(far.near, [f"reverse:https://{far.far.ip}:{fake.port}@0"], confdir, tmp_path / "timing.jsonl",
                     ssl_insecure=True, relay_upstream_pool=False, tls_version_server_max="TLS1_2")
    with relay, far.near.entered():
        for _ in range(3):
            request(relay.url(), body(1), rid)
        records = relay.log.of(rid, 3)
    assert [rec["upstream_tls_resumed"] for rec in records] == [False, True, True]
    handshakes = [rec["phases"]["upstream_tls"] / rec["phases"]["upstream_connect"] for rec in records]
    assert handshakes[0] > 1.7 and max(handshakes[1:]) < 1.4, handshakes


def test_the_routes_initial_window_sends_a_32_kb_request_in_its_first_flight(far_tls, confdir, tmp_path, rid):
    far, fake = far_tls
    relay = relay_in(far.near, [f"reverse:https://{far.far.ip}:{fake.port}@0"], confdir, tmp_path / "timing.jsonl",
                     ssl_insecure=True, relay_upstream_pool=False)
    with relay, far.near.entered():
        request(relay.url(), body(32), rid)
        far.route(far.near, initcwnd=64)
        request(relay.url(), body(32), rid)
        kernels, wide = relay.log.of(rid, 2)
    assert kernels["phases"]["upstream_upload"] > 0.8 * kernels["phases"]["upstream_connect"], kernels["phases"]
    assert wide["phases"].get("upstream_upload", 0.0) < 0.3 * wide["phases"]["upstream_connect"], wide["phases"]
