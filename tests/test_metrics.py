"""ttft_relay/observe/metrics.py: records → Prometheus instruments, bounded labels, and a scrape
through a real mitmdump whose counts match the timing records."""

from __future__ import annotations

import gzip
import importlib.metadata
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client import values as prometheus_values
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from ttft_relay import apis
from ttft_relay.observe import metrics, multiproc, series
from ttft_relay.timing import record
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import REPO, TimingLog, metrics_url, scrape, total
from tests.patches.pins import assert_unchanged

CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def a_record(**overrides):
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 52.0, "first_byte": 52.0,
             "first_token": 60.0, "last_token": 160.0, "end": 161.0}
    args = dict(id="f1", ts=1000.0, api=apis.OPENAI_CHAT, model="gpt-4o-mini", stream=True, status=200,
                upstream="api.openai.com", marks=marks, tokens_expected=True, tls_expected=True,
                reused_connection=True, rtt_ms=None, usage={"input_tokens": 12, "output_tokens": 11})
    return record.build_record(record.RecordInput(**(args | overrides)))


CHAT_API = apis.get(apis.OPENAI_CHAT)
"""The API of every record here (`a_record`'s)."""
LABELS = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai", "gen_ai_request_model": "gpt-4o-mini",
          "server_address": "api.openai.com", "api": "openai.chat", "status_class": "2xx"}


def test_a_successful_stream_feeds_every_instrument():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=10)
    m.observe(a_record(trim={"tokens_before": 900, "tokens_after": 400}), CHAT_API)
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


def test_the_requests_upload_over_the_upstream_link_is_its_own_phase_not_the_upstreams_wait():
    # The relay wrote the request at 2 ms; its kernel sent the last byte at 30 ms (a congestion
    # window the request did not fit in): 28 ms of the link's, then 22 ms of the upstream's own.
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=10)
    marks = {"request_body": 1.0, "forwarded": 2.0, "upstream_sent": 30.0, "response_head": 52.0,
             "first_byte": 52.0, "first_token": 60.0, "last_token": 160.0, "end": 161.0}
    m.observe(a_record(marks=marks), CHAT_API)
    assert reg.get_sample_value("ttft_relay_upstream_upload_seconds_sum", LABELS) == pytest.approx(0.028)
    assert reg.get_sample_value("ttft_relay_upstream_wait_seconds_sum", LABELS) == pytest.approx(0.022)
    # A request whose upload fit its first flight has no such phase, and no sample.
    m.observe(a_record(), CHAT_API)
    assert reg.get_sample_value("ttft_relay_upstream_upload_seconds_count", LABELS) == 1


def test_failures_count_as_operations_but_not_as_first_tokens():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=10)
    marks = {"request_body": 1.0, "forwarded": 2.0, "response_head": 30.0, "end": 31.0}
    m.observe(a_record(status=500, marks=marks, error="HTTP 500", error_phase="upstream_wait", usage=None), CHAT_API)
    failed = LABELS | {"status_class": "5xx"}
    assert reg.get_sample_value("gen_ai_client_operation_duration_seconds_count",
                                failed | {"error_type": "upstream_wait"}) == 1
    assert reg.get_sample_value("gen_ai_server_time_to_first_token_seconds_count", failed) is None


def durations(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.labels["gen_ai_request_model"], s.labels["status_class"]): s.value for m in reg.collect()
            for s in m.samples if s.name == "gen_ai_client_operation_duration_seconds_count"}


def test_label_combinations_are_bounded_and_junk_never_pushes_out_a_model_with_a_success():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=3)
    m.observe(a_record(model="gpt-4o"), CHAT_API)  # a success: the upstream knows it
    refused = {"status": 404, "error": "HTTP 404", "error_phase": "upstream_wait", "usage": None}
    for i in range(50):
        m.observe(a_record(model=f"junk-{i}", **refused), CHAT_API)
    m.observe(a_record(model="gpt-4o"), CHAT_API)
    m.observe(a_record(model="gpt-4o", **refused), CHAT_API)  # gpt-4o's failures are gpt-4o's too
    # gpt-4o kept its labels through 50 junk models (it was "other" for good after 50 of them)
    assert durations(reg) == {("gpt-4o", "2xx"): 2, ("gpt-4o", "4xx"): 1, ("junk-49", "4xx"): 1}
    samples = sum(len(metric.samples) for metric in reg.collect())
    m.observe(a_record(model="junk-x", **refused), CHAT_API)  # junk takes junk's place, the series stay as many
    assert ("junk-x", "4xx") in durations(reg) and ("junk-49", "4xx") not in durations(reg)
    assert sum(len(metric.samples) for metric in reg.collect()) == samples


def test_without_room_for_a_proven_model_junk_is_counted_as_other():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=2)
    m.observe(a_record(model="gpt-4o"), CHAT_API)
    m.observe(a_record(model="gpt-4.1"), CHAT_API)
    for i in range(5):
        m.observe(a_record(model=f"junk-{i}", status=404, error="HTTP 404", error_phase="upstream_wait"), CHAT_API)
    assert durations(reg) == {("gpt-4o", "2xx"): 1, ("gpt-4.1", "2xx"): 1, ("other", "4xx"): 5}
    m.observe(a_record(model="gpt-5"), CHAT_API)  # another real model takes the least recently used one's place
    assert set(durations(reg)) == {("gpt-4.1", "2xx"), ("gpt-5", "2xx"), ("other", "4xx")}


def test_the_self_watch_samples_feed_the_lag_the_accept_queues_and_the_gc_pauses():
    registry = CollectorRegistry()
    m = metrics.RelayMetrics(registry, 5)
    m.observe_load(0.002, None)
    m.observe_load(0.3, {"127.0.0.1:8001": 4})
    m.observe_load(0.004, {"127.0.0.1:8001": 0, "127.0.0.1:8002": 2}, [(0, 0.0002), (2, 0.12)])
    value = registry.get_sample_value
    assert value("ttft_relay_gc_pause_seconds_count", {"generation": "2"}) == 1
    assert value("ttft_relay_gc_pause_seconds_bucket", {"generation": "2", "le": "0.1"}) == 0
    assert value("ttft_relay_gc_pause_seconds_count", {"generation": "0"}) == 1
    assert value("ttft_relay_event_loop_lag_seconds_count") == 3
    assert value("ttft_relay_event_loop_lag_seconds_bucket", {"le": "0.25"}) == 2
    assert value("ttft_relay_accept_queue_connections", {"listener": "127.0.0.1:8001"}) == 0
    assert value("ttft_relay_accept_queue_connections", {"listener": "127.0.0.1:8002"}) == 2


def test_what_the_relay_learned_is_read_from_the_store_at_each_scrape(tmp_path):
    from ttft_relay import store as learned_store
    from ttft_relay.observe import attempts
    from ttft_relay.trim import plans, policy, windows

    registry = CollectorRegistry()
    metrics.watch_learned(registry, tmp_path / "timing.jsonl")
    store = windows.LearnedWindows(tmp_path / learned_store.FILE_NAME)

    def learned() -> dict[str, tuple[dict[str, str], float]]:
        return {s.labels["gen_ai_request_model"]: (s.labels, s.value)
                for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples if s.name == metrics.LEARNED_WINDOWS}

    assert learned() == {}  # no file yet
    store.keep(windows.Learned("api.anthropic.com", "acme-coder-2", 60_000, None, 1.0, 1.0, 400,
                               "invalid_request_error", "k1"))
    store.keep(windows.Learned("api.openai.com", "gpt-4-fork", None, 40_000, 1.0, 1.0, 400,
                               "context_length_exceeded", "k1", confirmed="k2"))
    assert learned() == {
        "acme-coder-2": ({"server_address": "api.anthropic.com", "gen_ai_request_model": "acme-coder-2",
                          "limit": "max_input", "confirmed": "no", "learned_from": "k1"}, 60_000),
        "gpt-4-fork": ({"server_address": "api.openai.com", "gen_ai_request_model": "gpt-4-fork",
                        "limit": "window", "confirmed": "yes", "learned_from": "k1"}, 40_000),
    }
    # And how much of each kind the store holds, and when the newest was learned.
    kept = plans.KeptPlans(tmp_path / learned_store.FILE_NAME)
    kept.put(bytes(16), policy.Plan(((0, 1),), 2, bytes(16)))
    kept.save()
    groups = learned_store.SharedStore(tmp_path / learned_store.FILE_NAME, [attempts.KIND])
    groups.entries.put(attempts.entry(attempts.Attempt(bytes(16), "r1", 1, time.time() - 2, time.time() - 1, True)))
    groups.sync()
    scraped = {(s.name, s.labels["kind"]): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples if s.name in (metrics.LEARNED_ENTRIES, metrics.LEARNED_NEWEST)}
    assert {k: v for k, v in scraped.items() if k[0] == metrics.LEARNED_ENTRIES} == {
        (metrics.LEARNED_ENTRIES, "window"): 2, (metrics.LEARNED_ENTRIES, "plan"): 1,
        (metrics.LEARNED_ENTRIES, "first-token"): 0, (metrics.LEARNED_ENTRIES, "attempt"): 1}
    assert scraped[(metrics.LEARNED_NEWEST, "window")] == 1.0
    assert scraped[(metrics.LEARNED_NEWEST, "plan")] > 1.7e9 and (metrics.LEARNED_NEWEST, "first-token") not in scraped


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


# --- the endpoint ---------------------------------------------------------------------------


@pytest.fixture
def endpoint(monkeypatch):
    monkeypatch.setattr(metrics, "SCRAPE_HEAD_TIMEOUT_S", 0.5)
    reg = CollectorRegistry()
    metrics.RelayMetrics(reg).observe(a_record(), CHAT_API)
    (host, port), server = metrics.serve("127.0.0.1:0", reg)
    yield f"http://{host}:{port}", port
    server.shutdown()
    server.server_close()


def test_the_endpoint_answers_metrics_and_nothing_else(endpoint):
    url, _ = endpoint
    assert total(scrape(url + "/metrics"), "gen_ai_client_operation_duration_seconds_count") == 1
    for path, status in (("/", 404), ("/anything", 404), ("/metrics/x", 404)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + path, timeout=5)
        assert e.value.code == status
    request = urllib.request.Request(url + "/metrics", headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.headers["Content-Encoding"] == "gzip" and gzip.decompress(answer.read()).startswith(b"# HELP")
    request = urllib.request.Request(url + "/metrics", method="POST", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=5)
    assert e.value.code == 405


def test_idle_connections_are_closed_and_cost_no_thread_each(endpoint):
    url, port = endpoint
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(200)]
    try:
        assert threading.active_count() == threads  # one thread serves them all (was one each)
        assert total(scrape(url + "/metrics"), "gen_ai_client_operation_duration_seconds_count") == 1  # meanwhile
        for s in idle:  # the oldest were closed to make room, the others after the head timeout
            s.settimeout(10)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()


def test_a_workers_series_are_bounded_in_its_multiprocess_files_too(tmp_path):
    # In a process of its own: prometheus-client picks its multiprocess value class at import.
    script = f"""
import os
os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
from prometheus_client import CollectorRegistry
from ttft_relay.observe import metrics, multiproc
from tests.test_metrics import CHAT_API, a_record
m = metrics.RelayMetrics(CollectorRegistry(), max_series=20)
m.observe(a_record(model="gpt-4o"), CHAT_API)
for i in range(3000):
    m.observe(a_record(model=f"junk-{{i}}", upstream=f"127.0.0.1:{{i % 50}}", status=None, error="refused",
                       error_phase="upstream_connect", usage=None), CHAT_API)
m.observe(a_record(model="gpt-4o"), CHAT_API)
print(sum(f.rewrites for f in multiproc.files().values()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0  # the files were rewritten without the evicted series' keys
    text = generate_latest(metrics.multiprocess_registry(tmp_path)).decode()
    combos = {tuple(sorted(s.labels.items())) for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "gen_ai_client_operation_duration_seconds_count"}
    assert len(combos) <= 20 + 1  # the bound, and the overflow series of junk that found no room
    assert 'gen_ai_request_model="gpt-4o"' in text
    assert sum(p.stat().st_size for p in tmp_path.glob("*.db")) < 5 * 1024 * 1024  # was: every key ever


def test_junk_through_the_proxy_listener_is_bounded_and_a_real_model_keeps_its_labels(fake, start_relay):
    # Through a proxy listener anyone allowed in may name any host, path and model: the issue's
    # 10k requests over 50 closed ports x 50 models x 4 paths gave 780,017 series.
    relay = start_relay("regular@0", relay_metrics_listen="127.0.0.1:0", relay_metrics_max_series=10)
    url = metrics_url(relay)
    ports = []
    for _ in range(10):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])  # closed once the block ends
    paths = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1beta/models/x:generateContent"]

    def proxied(target: str, model: str) -> int:
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        with socket.create_connection(("127.0.0.1", relay.port), 20) as s:
            s.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        return int(answer.split(b" ", 2)[1])

    assert proxied(f"{fake.base_url}/v1/chat/completions", "gpt-4o") == 200
    for i in range(200):
        assert proxied(f"http://127.0.0.1:{ports[i % 10]}{paths[i // 10 % 4]}", f"junk-{i // 40}") == 502
    assert proxied(f"{fake.base_url}/v1/chat/completions", "gpt-4o") == 200
    relay.log.wait(202)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    combos = {tuple(sorted(s.labels.items())) for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "gen_ai_client_operation_duration_seconds_count"}
    assert len(combos) <= 10 + 4  # the bound, and per API shape the overflow of junk
    assert any(('gen_ai_request_model', 'gpt-4o') in c and ('status_class', '2xx') in c for c in combos)
    gpt = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "gen_ai_client_operation_duration_seconds_count"
              and s.labels["gen_ai_request_model"] == "gpt-4o")
    assert gpt == 2  # both of its calls under its own name (was: "other" for good after 50 junk models)


def test_a_series_bound_without_evictions_keeps_its_order():
    evicted = []
    bound = series.SeriesBound(2)
    a, b, c = (("chat", "openai", m, "h", "openai.chat", "4xx") for m in "abc")
    assert bound.admit(a, False, evicted.append) == a
    assert bound.admit(b, False, evicted.append) == b
    assert bound.admit(a, False, evicted.append) == a  # a used last: b is the least recently used
    assert bound.admit(c, False, evicted.append) == c and evicted == [b]
    ok = (*c[:5], "2xx")
    assert bound.admit(ok, True, evicted.append) == ok and evicted == [b, a]  # c's model proven now
    assert bound.admit(b, False, evicted.append) == series.overflow(b)  # only proven ones left: no room for junk


PROMETHEUS_CLIENT_PINNED = {
    # multiproc._read_live_metrics is this reader and one line more
    "MultiProcessCollector._read_metrics": (MultiProcessCollector._read_metrics, "c8d3db164cc96b03"),
    "MultiProcessCollector._accumulate_metrics": (MultiProcessCollector._accumulate_metrics, "a7834784c48cba70"),
    "MultiProcessCollector.collect": (MultiProcessCollector.collect, "86fc50ce2593e7a2"),
    # the file format and its names, which BoundedValue writes as MmapedValue does
    "MultiProcessValue": (prometheus_values.MultiProcessValue, "8077cd2c482fc32e"),
    "MmapedDict.__init__": (MmapedDict.__init__, "e8224907c3694559"),
    "MmapedDict._init_value": (MmapedDict._init_value, "b07be9310c2735ae"),
    "MmapedDict.read_value": (MmapedDict.read_value, "8579657db528e958"),
    "MmapedDict.write_value": (MmapedDict.write_value, "edffcc45d7ea2046"),
    "MmapedDict.read_all_values_from_file": (MmapedDict.read_all_values_from_file, "949b6512ed6abe8b"),
    # instruments take values.ValueClass when they make a child; remove() drops the child
    "Counter._metric_init": (prometheus_metrics.Counter._metric_init, "17b9d10bf21b912c"),
    "Gauge._metric_init": (prometheus_metrics.Gauge._metric_init, "d569c1f7e90e12a8"),
    "Histogram._metric_init": (prometheus_metrics.Histogram._metric_init, "61aeac1b768d4786"),
    "MetricWrapperBase.remove": (prometheus_metrics.MetricWrapperBase.remove, "23e153676908c251"),
}


def test_the_prometheus_client_code_multiproc_builds_on_is_unchanged():
    assert importlib.metadata.version("prometheus-client") == "0.26.0"
    assert_unchanged(PROMETHEUS_CLIENT_PINNED, multiproc)


def gpt_count(reg: CollectorRegistry) -> float | None:
    return reg.get_sample_value("gen_ai_client_operation_duration_seconds_count",
                                LABELS | {"gen_ai_request_model": "gpt-4o", "error_type": ""})


@pytest.mark.parametrize("hosts", [1, 150])
def test_junk_an_upstream_answers_200_to_never_pushes_out_a_model_in_use(hosts):
    """150 model names sent to the attacker's own upstream (answering 200 to anything) evicted
    gpt-4o, whose counter restarted at 1. Its upstream proves its newest models within its own
    quota; spread over 150 upstreams, a success each proves less than gpt-4o's upstream has."""
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=100)
    for _ in range(3):
        m.observe(a_record(model="gpt-4o"), CHAT_API)
    for i in range(150):
        m.observe(a_record(model=f"junk-{i}", upstream=f"evil-{i % hosts}.example:8080"), CHAT_API)
    m.observe(a_record(model="gpt-4o"), CHAT_API)
    assert gpt_count(reg) == 4  # never evicted: counted on, not restarted
    assert len(m.series) <= 100
    proven_junk = [labels for labels in m.series.proven if labels[series.MODEL].startswith("junk-")]
    assert len(proven_junk) <= m.series.per_upstream * hosts  # each upstream proves within its quota


def test_an_upstream_proves_its_models_only_within_its_quota():
    evicted: list[series.Labels] = []
    bound = series.SeriesBound(100, per_upstream=3)
    for model in ("a", "b", "c", "d"):
        bound.admit(("chat", "openai", model, "h", "openai.chat", "2xx"), True, evicted.append)
    assert [bound.is_proven(m, "h") for m in "abcd"] == [False, True, True, True]
    assert ("chat", "openai", "a", "h", "openai.chat", "2xx") in bound.unproven  # the first junk to go


def test_metrics_model_labels_are_cut():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=10)
    m.observe(a_record(model="m" * 200_000), CHAT_API)
    (model,) = {s.labels["gen_ai_request_model"] for f in reg.collect() for s in f.samples
                if "gen_ai_request_model" in s.labels}
    assert len(model) <= metrics.LABEL_MAX and model.endswith("(200000 characters)")


@pytest.mark.parametrize("listener", ["proxy", "reverse"])
def test_junk_models_on_an_attackers_upstream_leave_a_real_models_series(start_relay, listener):
    """The break of issue 36 on real mitmdump, in both shapes: a proxy listener naming the attacker's
    upstream, and a reverse listener in front of it; either way a second fake, answering 200 to
    any model, stands for the attacker's upstream."""
    from ttft_relay.testing.fakes.upstream import FakeUpstream

    with FakeUpstream() as real, FakeUpstream() as attacker:
        if listener == "proxy":
            relay = start_relay("regular@0", relay_metrics_listen="127.0.0.1:0", relay_metrics_max_series=20)
            urls = (f"{real.base_url}/v1/chat/completions", f"{attacker.base_url}/v1/chat/completions")
            proxy: str | None = relay.url()
        else:
            from ttft_relay.workers import free_port

            relay = start_relay(f"reverse:{real.base_url}@{free_port()}", f"reverse:{attacker.base_url}@{free_port()}",
                                relay_metrics_listen="127.0.0.1:0",
                                relay_metrics_max_series=20)
            urls = tuple(f"http://127.0.0.1:{port}/v1/chat/completions" for port in relay.ports)
            proxy = None

        def call(url: str, model: str) -> None:
            body = {**CHAT, "model": model, "stream": False}
            conn, resp = client.request("POST", url, body, {"x-request-id": model}, proxy=proxy)
            with conn:
                assert resp.status == 200
                resp.read()

        for _ in range(3):
            call(urls[0], "gpt-4o")
        for i in range(150):
            call(urls[1], f"junk-{i}")
        call(urls[0], "gpt-4o")
        relay.log.wait(154)
        text = urllib.request.urlopen(metrics_url(relay), timeout=10).read().decode()
    gpt = [s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name == "gen_ai_client_operation_duration_seconds_count" and s.labels["gen_ai_request_model"] == "gpt-4o"]
    assert gpt == [4]  # was: evicted, and back at 1


def a_routed_record(**overrides):
    route = {"group": "api.openai.com", "upstream": "b", "why": "…", "reason": "lowest",
             "expected_ms": {"api.openai.com": 900.0, "b": 400.0}}
    return a_record(prompt_tokens=1200, route=route | overrides.pop("route", {}), **overrides)


def test_an_upstream_groups_choices_failovers_their_prompt_tokens_and_each_members_first_tokens():
    reg = CollectorRegistry()
    m = metrics.RelayMetrics(reg, max_series=10)
    get = reg.get_sample_value
    group = {"group": "api.openai.com"}
    m.observe_route(a_routed_record())
    # Every member's counters exist from the group's first record, at 0 where nothing happened yet.
    assert get("ttft_relay_upstream_choices_total", group | {"member": "b", "reason": "lowest"}) == 1
    assert get("ttft_relay_upstream_choices_total", group | {"member": "api.openai.com", "reason": "sticky"}) == 0
    assert get("ttft_relay_upstream_failovers_total", group | {"from_member": "api.openai.com", "cause": "5xx"}) == 0
    assert get("ttft_relay_upstream_member_time_to_first_token_seconds_sum", group | {"member": "b"}) == \
        pytest.approx(0.060)

    # Chosen first, left on a 503 and then on a slow head: each failover costs the prompt once more.
    failed = [{"upstream": "api.openai.com", "error": "503", "cause": "5xx", "after_ms": 30.0},
              {"upstream": "c", "error": "no head after 0.3 s", "cause": "slow_head", "after_ms": 400.0}]
    m.observe_route(a_routed_record(route={"reason": "sticky", "failed_over": failed,
                                           "expected_ms": {"api.openai.com": 300.0, "b": 400.0, "c": 350.0}}))
    assert get("ttft_relay_upstream_choices_total", group | {"member": "api.openai.com", "reason": "sticky"}) == 1
    assert get("ttft_relay_upstream_choices_total", group | {"member": "b", "reason": "sticky"}) == 0
    assert get("ttft_relay_upstream_failovers_total", group | {"from_member": "api.openai.com", "cause": "5xx"}) == 1
    assert get("ttft_relay_upstream_failovers_total", group | {"from_member": "c", "cause": "slow_head"}) == 1
    assert get("ttft_relay_upstream_duplicated_prompt_tokens_total",
               group | {"from_member": "api.openai.com", "cause": "5xx"}) == 1200
    assert get("ttft_relay_upstream_duplicated_prompt_tokens_total",
               group | {"from_member": "c", "cause": "slow_head"}) == 1200
    # A failed-over first token holds the abandoned attempt's wait: not b's own.
    assert get("ttft_relay_upstream_member_time_to_first_token_seconds_count", group | {"member": "b"}) == 1
    # A failure is a choice, and no first token.
    m.observe_route(a_routed_record(status=500, error="HTTP 500", error_phase="upstream_wait"))
    assert get("ttft_relay_upstream_choices_total", group | {"member": "b", "reason": "lowest"}) == 2
    assert get("ttft_relay_upstream_member_time_to_first_token_seconds_count", group | {"member": "b"}) == 1
    # Late heads waited for (no other member expected sooner): by the late member and what was not done.
    waited = group | {"member": "b"}
    assert get("ttft_relay_upstream_late_heads_waited_total", waited | {"instead_of": "hedge"}) == 0
    m.observe_route(a_routed_record(route={"not_hedged": "api.openai.com expected 1.6 s, b 0.3 s more"}))
    m.observe_route(a_routed_record(route={"not_given_up": "api.openai.com expected 1.6 s, b 0.3 s more"}))
    m.observe_route(a_routed_record(route={"not_given_up": "api.openai.com expected 1.6 s, b 0.3 s more"}))
    assert get("ttft_relay_upstream_late_heads_waited_total", waited | {"instead_of": "hedge"}) == 1
    assert get("ttft_relay_upstream_late_heads_waited_total", waited | {"instead_of": "slow_head"}) == 2
    assert get("ttft_relay_upstream_late_heads_waited_total",
               group | {"member": "api.openai.com", "instead_of": "slow_head"}) == 0
    # Records without a group (every other listener) count nothing here.
    before = sum(len(family.samples) for family in reg.collect())
    m.observe_route(a_record())
    assert sum(len(family.samples) for family in reg.collect()) == before
