"""No cold start: the first request after the relay starts pays nothing upstream that
the tenth does not.

A relay in reverse mode to an HTTPS fake upstream behind a delaying link (TLS to the
fake, verified against the test CA), started and sent ten requests one after the
other, each on a new client connection (without the upstream pool, so each opens its own
upstream connection, with its own TLS handshake). Whatever the relay does on first use (TLS contexts, the
CA, tokenizers) must be done before its listeners report ready, or land in the
relay's own phases: the first request's upstream phases are no slower than the
slowest of the nine after it (within 10 % or 5 ms). Against the slowest, not the
tenth alone, and in up to three fresh relays: on a loaded machine any one request can
be slow by chance, but a cold start makes the first slower than all the later ones,
in every fresh relay.
"""

from __future__ import annotations

import pytest

from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.forwarder import DelayingForwarder
from tests.test_timing_e2e import post

ONE_WAY_MS = 50
REQUESTS = 10
ATTEMPTS = 3
UPSTREAM_PHASES = ("upstream_connect", "upstream_tls", "upstream_wait")


@pytest.mark.parametrize("trim", ["true", "false"])
def test_the_first_requests_upstream_phases_are_no_slower_than_the_later_ones(fake_tls, start_relay, tmp_path, trim):
    misses = []
    for attempt in range(ATTEMPTS):
        log = tmp_path / f"timing-{attempt}.jsonl"
        with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as forwarder:
            # Without the upstream pool, whose warm connections would hide the connects compared here.
            relay = start_relay(f"reverse:https://localhost:{forwarder.port}@0", relay_trim=trim,
                                relay_timing_log=log, relay_upstream_pool=False)
            for _ in range(REQUESTS):  # at once: no warm-up, no settling
                with HttpConnection(relay.url()) as conn:
                    post(conn, "openai.chat")
            relay.stop()  # stopping flushes the log
        records = relay.log.records()
        assert len(records) == REQUESTS, records
        miss = first_request_slower(records)
        if miss is None:
            return
        misses.append(miss)
    pytest.fail(f"the first request was slower upstream in all {ATTEMPTS} fresh relays: {misses}")


def first_request_slower(records: list[dict]) -> tuple | None:
    """The first upstream phase in which the first request is slower than the slowest of
    the later ones (beyond 10 % or 5 ms), with both figures; None if there is none."""
    first, later = records[0]["phases"], [record["phases"] for record in records[1:]]
    for phase in UPSTREAM_PHASES:
        slowest = max(phases[phase] for phases in later)
        if first[phase] - slowest > max(0.10 * slowest, 5.0):
            return phase, first[phase], slowest
    return None
