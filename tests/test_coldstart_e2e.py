"""No cold start: the first request after the relay starts pays nothing upstream that
the tenth does not.

A relay in reverse mode to an HTTPS fake upstream behind a delaying link (TLS to the
fake, verified against the test CA), started and sent ten requests one after the
other, each on a new client connection (so each opens its own upstream connection,
with its own TLS handshake). Whatever the relay does on first use (TLS contexts, the
CA, tokenizers) must be done before its listeners report ready, or land in the
relay's own phases: the first request's upstream phases match the tenth's.
"""

from __future__ import annotations

import pytest

from tests.fakes.client import HttpConnection
from tests.fakes.forwarder import DelayingForwarder
from tests.test_timing_e2e import post, read_log

ONE_WAY_MS = 50
REQUESTS = 10
UPSTREAM_PHASES = ("upstream_connect", "upstream_tls", "upstream_wait")


@pytest.mark.parametrize("trim", ["true", "false"])
def test_the_first_requests_upstream_phases_match_the_tenths(fake_tls, start_relay, tmp_path, trim):
    with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as forwarder:
        relay = start_relay(f"reverse:https://localhost:{forwarder.port}@0", relay_trim=trim)
        for _ in range(REQUESTS):  # at once: no warm-up, no settling
            with HttpConnection(relay.url()) as conn:
                post(conn, "openai.chat")
        records = read_log(tmp_path / "timing.jsonl", REQUESTS)
    first, tenth = records[0]["phases"], records[-1]["phases"]
    for phase in UPSTREAM_PHASES:
        assert abs(first[phase] - tenth[phase]) <= max(0.10 * tenth[phase], 5.0), (phase, first, tenth)
