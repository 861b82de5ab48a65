"""Load, nothing lost (the light variant of `scripts/bench load`, which runs 500 streams):
100 concurrent streams x 3 rounds through a real mitmdump. Every stream byte-identical
to what the fake sent for it, exactly one record per request, and the relay's memory
back near its level after the first round."""

from __future__ import annotations

import asyncio

from benchmarks import load as bench_load
from tests.conftest import reverse_to

STREAMS = 100
ROUNDS = 3
CHUNKS = 10
RSS_SLACK_KIB = 30 * 1024


def test_concurrent_streams_in_rounds_lose_nothing(fake, start_relay, tmp_path):
    fake.behaviour.chunks = CHUNKS
    fake.behaviour.prefill_ms = 1000  # every stream stays open while the others connect
    relay = start_relay(reverse_to(fake), relay_timing_console="false")
    log = tmp_path / "timing.jsonl"
    rss = []
    for round_no in range(1, ROUNDS + 1):
        result = asyncio.run(bench_load.run_round(relay.url(), STREAMS, round_no, CHUNKS))
        assert result.failures == [] and result.ok == STREAMS
        # All in flight at once, upstream too: the last request reached the fake before any
        # stream's first token left it (the client's own count of open streams cannot fail).
        this_round = fake.sent[-STREAMS:]
        last_in = max(s.request.at for s in this_round)
        first_out = min(s.first_token_at for s in this_round)
        assert last_in < first_out, f"the last request arrived {last_in - first_out:.3f} s after a first token"
        counts = bench_load.wait_for_records(log, STREAMS * round_no)
        assert all(counts.get(rid) == 1 for rid in result.request_ids)
        rss.append(bench_load.rss_kib(relay.proc.pid))
    assert rss[-1] - rss[0] < RSS_SLACK_KIB, f"relay RSS per round (KiB): {rss}"
    relay.stop()
    assert sum(bench_load.records_by_id(log).values()) == STREAMS * ROUNDS
    assert len(fake.received) == STREAMS * ROUNDS
