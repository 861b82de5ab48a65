"""ttft_relay/timing/metrics.py: records → Prometheus instruments, bounded labels, and a scrape
through a real mitmdump whose counts match the timing records."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from ttft_relay import apis
from ttft_relay.timing import metrics, record
from tests.conftest import reverse_to
from tests.fakes import client
from tests.harness import TimingLog, metrics_url, scrape, total

CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def a_record(**overrides):
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 52.0, "first_byte": 52.0,
             "first_token": 60.0, "last_token": 160.0, "end": 161.0}
    args = dict(id="f1", ts=1000.0, api=apis.OPENAI_CHAT, model="gpt-4o-mini", stream=True, status=200,
                upstream="api.openai.com", marks=marks, tokens_expected=True, tls_expected=True,
                reused_connection=True, rtt_ms=None, usage={"input_tokens": 12, "output_tokens": 11})
    return record.build_record(**(args | overrides))


LABELS = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai", "gen_ai_request_model": "gpt-4o-mini",
          "server_address": "api.openai.com", "api": "openai.chat", "status_class": "2xx"}


def test_a_successful_stream_feeds_every_instrument():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_values=10)
    m.observe(a_record(trim={"tokens_before": 900, "tokens_after": 400}))
    get = reg.get_sample_value
    assert get("gen_ai_server_time_to_first_token_seconds_sum", LABELS) == pytest.approx(0.060)
    assert get("gen_ai_server_time_to_first_token_seconds_bucket", LABELS | {"le": "0.06"}) == 1
    # (total 161 ms - ttft 60 ms) / (11 - 1) tokens
    assert get("gen_ai_server_time_per_output_token_seconds_sum", LABELS) == pytest.approx(0.0101)
    assert get("gen_ai_client_operation_duration_seconds_count", LABELS | {"error_type": ""}) == 1
    assert get("gen_ai_client_token_usage_sum", LABELS | {"gen_ai_token_type": "input"}) == 12
    assert get("gen_ai_client_token_usage_sum", LABELS | {"gen_ai_token_type": "output"}) == 11
    assert get("ttft_relay_upstream_wait_seconds_sum", LABELS) == pytest.approx(0.050)
    assert get("ttft_relay_relay_seconds_count", LABELS) == 1
    assert get("ttft_relay_trimmed_tokens_total", LABELS) == 500


def test_failures_count_as_operations_but_not_as_first_tokens():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_values=10)
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 30.0, "end": 31.0}
    m.observe(a_record(status=500, marks=marks, error="HTTP 500", error_phase="upstream_wait", usage=None))
    failed = LABELS | {"status_class": "5xx"}
    assert reg.get_sample_value("gen_ai_client_operation_duration_seconds_count",
                                failed | {"error_type": "upstream_wait"}) == 1
    assert reg.get_sample_value("gen_ai_server_time_to_first_token_seconds_count", failed) is None


def test_models_and_hosts_beyond_the_limit_fold_into_other():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_values=2)
    for model in ("a", "b", "c", "a", None):
        m.observe(a_record(model=model))
    models = {s.labels["gen_ai_request_model"]: s.value for s in reg.collect() for s in s.samples
              if s.name == "gen_ai_client_operation_duration_seconds_count"}
    assert models == {"a": 2, "b": 1, "other": 2}


def test_the_self_watch_samples_feed_the_lag_and_the_accept_queues():
    registry = CollectorRegistry()
    m = metrics.RelayMetrics(registry, 5)
    m.observe_load(0.002, None)
    m.observe_load(0.3, {"127.0.0.1:8001": 4})
    m.observe_load(0.004, {"127.0.0.1:8001": 0, "127.0.0.1:8002": 2})
    value = registry.get_sample_value
    assert value("ttft_relay_event_loop_lag_seconds_count") == 3
    assert value("ttft_relay_event_loop_lag_seconds_bucket", {"le": "0.25"}) == 2
    assert value("ttft_relay_accept_queue_connections", {"listener": "127.0.0.1:8001"}) == 0
    assert value("ttft_relay_accept_queue_connections", {"listener": "127.0.0.1:8002"}) == 2


def test_listen_addresses():
    assert metrics.parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert metrics.parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError):
        metrics.parse_listen("9464x")


def test_scrape_during_a_run_matches_the_records(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), relay_metrics_listen="127.0.0.1:0")
    url = metrics_url(relay)
    assert url.startswith("http://127.0.0.1:")

    def one(status: int = 200) -> None:
        conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", CHAT,
                                    {"x-fake-status": str(status)}, timeout=20)
        with conn:
            resp.read()

    for i in range(7):
        one(500 if i % 3 == 2 else 200)
    records = TimingLog(tmp_path / "timing.jsonl").wait(7)
    samples = scrape(url)  # while the relay runs

    assert len(records) == 7
    assert total(samples, "gen_ai_client_operation_duration_seconds_count") == 7
    ok = [r for r in records if r["status"] == 200]
    assert total(samples, "gen_ai_server_time_to_first_token_seconds_count") == len(ok) == 5
    assert total(samples, "gen_ai_client_operation_duration_seconds_count", status_class="5xx") == 2
    assert total(samples, "gen_ai_server_time_to_first_token_seconds_sum") == pytest.approx(
        sum(r["ttft_ms"] for r in ok) / 1000, rel=1e-6)
    out = sum(r["usage"]["output_tokens"] for r in ok)
    assert total(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == out


def test_requests_in_flight_from_their_head_to_their_record(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), relay_metrics_listen="127.0.0.1:0")
    url = metrics_url(relay)
    held, resp = client.request("POST", relay.url() + "/v1/chat/completions", CHAT,
                                {"x-fake-stall-after-chunks": "1"}, timeout=20)
    with held:
        next(resp.chunks())  # its head and first event through: begun, not recorded
        assert total(scrape(url), "ttft_relay_requests_in_flight") == 1
    conn, resp = client.request("POST", relay.url() + "/v1/chat/completions", CHAT, timeout=20)
    with conn:
        resp.read()
    TimingLog(tmp_path / "timing.jsonl").wait(2)  # the first one's client left, the second one ended: recorded
    # The gauge goes down as the record leaves for its sinks, by the line in the log.
    deadline = time.monotonic() + 10
    while (in_flight := total(scrape(url), "ttft_relay_requests_in_flight")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight == 0
