"""A real Prometheus scrapes a real relay while streams flow, and every PromQL expression of
the shipped Grafana dashboard (deploy/grafana/dashboard.py) answers what the relay's
timing records say.

The same traffic mix runs twice: first to create every series (Prometheus's rate()
counts only what changes after a series' first sample), then the measured round. Each
expression is evaluated at the first scrape after the measured round, over a window
that starts just before the last scrape before it, and compared with the measured round's
records: means and shares exactly, quantiles by Prometheus's own interpolation over
ttft_relay/observe/metrics.py's buckets.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from ttft_relay.observe import metrics
from deploy.grafana import dashboard
from ttft_relay.workers import free_port
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.upstream import FakeUpstream
from ttft_relay.testing.harness import metrics_url, read_records

PROMETHEUS = shutil.which("prometheus")
SCRAPE_MS = 250
TRIM_BUDGET = 300
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="Prometheus is not installed (Debian/Ubuntu: "
                                "apt-get install prometheus; scripts/test installs it when run as root)")


def test_the_shipped_dashboard_is_the_generators_output():
    assert dashboard.main(["--check"]) == 0, "run deploy/grafana/dashboard.py"
    exprs = [t["expr"] for p in json.loads(dashboard.OUTPUT.read_text())["panels"] for t in p["targets"]]
    assert exprs == [q.expr for p in dashboard.PANELS for q in p.queries]


# --- Prometheus ----------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, tmp_path, target: str) -> None:
        config = tmp_path / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_MS}ms\n  scrape_timeout: {SCRAPE_MS}ms\n"
                          f"scrape_configs:\n  - job_name: relay\n    static_configs:\n"
                          f"      - targets: ['{target}']\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))
        self.wait(lambda: self._ready(), "ready")
        with urllib.request.urlopen(self.url + "/api/v1/status/buildinfo", timeout=10) as r:
            version = json.load(r)["data"]["version"]
        # Range selectors include their start up to Prometheus 2.x; from 3.0 they do not.
        self.range_start_lead_ms = 0 if version.startswith("2.") else 1

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait(self, condition, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, f"prometheus: {what} not within {timeout} s"
            time.sleep(SCRAPE_MS / 1000 / 5)

    def scraped_calls(self, n: int) -> float:
        """Wait until a scrape has seen `n` calls, then for the next scrape, and return its time.
        The next one: a scrape can fall between the instruments one record feeds (the call
        counted, its first token not yet); the one after sees the record whole."""
        self.wait(lambda: self.scalar("sum(gen_ai_client_operation_duration_seconds_count)") == n, f"{n} calls")
        seen = self.scalar('timestamp(up{job="relay"})')
        self.wait(lambda: self.scalar('timestamp(up{job="relay"})') > seen, "the next scrape")
        assert self.scalar("sum(gen_ai_client_operation_duration_seconds_count)") == n
        return self.scalar('timestamp(up{job="relay"})')

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# --- the traffic --------------------------------------------------------------------------------


CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-opus-4-6", "stream": True, "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
LONG_HISTORY = {**CHAT, "messages": [{"role": "user" if i % 2 == 0 else "assistant",
                                      "content": f"turn {i}: " + "tell me more about the weather " * 8}
                                     for i in range(41)]}


def _post(url: str, body: dict, **headers: str) -> int:
    conn, resp = client.request("POST", url, orjson.dumps(body), headers={"content-type": "application/json",
                                                                          **headers})
    with conn:
        resp.read()
    return resp.status


def held_for(port: int) -> tuple[int, int]:
    """What the kernel holds for the relay's loopback listener on `port`: connections not yet
    accepted (a listening socket's rx_queue in /proc/net/tcp) and request bytes not yet read
    (the rx_queue of its connections)."""
    waiting, unread = 0, 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}":
            queued = int(fields[4].split(":")[1], 16)
            if fields[3] == "0A":  # LISTEN
                waiting = queued
            elif fields[3] == "01":  # ESTABLISHED
                unread += queued
    return waiting, unread


HELD_S = 0.03


def while_frozen(relay, port: int, send) -> None:
    """Run `send` (a request to the listener on `port`) while the relay process is stopped,
    until the kernel holds the connection and its request for it, then let the relay go on: a saturated relay,
    as its self-watch sees one (a late-run event loop, bytes the kernel held)."""
    done = threading.Thread(target=send)
    relay.proc.send_signal(signal.SIGSTOP)
    try:
        done.start()
        deadline = time.monotonic() + 10
        while 0 in held_for(port):
            assert time.monotonic() < deadline, "the request never reached the kernel's queues"
            time.sleep(0.005)
        # Held long enough that its time queued in the relay (relay_queue) counts in whole ms.
        time.sleep(HELD_S)
    finally:
        relay.proc.send_signal(signal.SIGCONT)
    done.join(30)


def run_mix(relay, ports: list[int], prefills: tuple[int, ...]) -> int:
    """Streams to two upstreams at several speeds, upstream errors, a dead upstream, trimmed
    requests, one request while the relay is frozen; returns the number of calls."""
    openai_url, anthropic_url, dead_url = (f"http://127.0.0.1:{port}" for port in ports)
    calls = 0
    for ms in prefills:
        assert _post(openai_url + "/v1/chat/completions", CHAT, **{"x-fake-prefill-ms": str(ms)}) == 200
        assert _post(anthropic_url + "/v1/messages", MESSAGES, **{"x-fake-prefill-ms": str(ms // 2)}) == 200
        calls += 2
    for _ in range(2):
        assert _post(openai_url + "/v1/chat/completions", CHAT, **{"x-fake-status": "500"}) == 500
    assert _post(openai_url + "/v1/chat/completions", LONG_HISTORY) == 200
    calls += 3
    assert _post(dead_url + "/v1/chat/completions", CHAT) == 502
    statuses = []
    while_frozen(relay, ports[0], lambda: statuses.append(_post(openai_url + "/v1/chat/completions", CHAT)))
    assert statuses == [200]
    return calls + 2


# --- what the records say -----------------------------------------------------------------------


def bucket_quantile(q: float, values: list[float], bounds: tuple[float, ...]) -> float:
    """Prometheus's histogram_quantile over `values` observed into buckets `bounds` (+Inf added)."""
    upper = [*bounds, math.inf]
    return quantile_of_buckets(q, upper, [sum(v <= b for v in values) for b in upper])


def quantile_of_buckets(q: float, upper: list[float], cumulative: list[float]) -> float:
    """Prometheus's histogram_quantile over cumulative bucket counts (the last bound +Inf)."""
    rank = q * cumulative[-1]
    b = next(i for i, c in enumerate(cumulative[:-1] + [math.inf]) if c >= rank)
    if b == len(upper) - 1:
        return upper[-2]
    start, count = (upper[b - 1], cumulative[b] - cumulative[b - 1]) if b else (0.0, cumulative[0])
    return start + (upper[b] - start) * ((rank - (cumulative[b - 1] if b else 0)) / count)


def error_type(rec: dict) -> str:
    return rec["error_phase"] or ("client_aborted" if rec["error"] or rec["client_aborted"] else "")


def expected(panel_title: str, recs: list[dict], relay_side: dict[str, dict[str, float]]) -> dict[str, float]:
    """What each panel's queries must answer for these records, keyed by series; `relay_side`
    holds what records cannot say (the event loop's lag, the accept queues)."""
    ok = [r for r in recs if not r["error"] and not r["client_aborted"] and (r["status"] or 0) < 400
          and r["ttft_ms"] is not None]
    if panel_title.startswith("Time to first token"):
        q = 0.5 if "p50" in panel_title else 0.95
        groups = defaultdict(list)
        for r in ok:
            groups[f"{r['model']} via {r['upstream']}"].append(r["ttft_ms"] / 1000)
            if panel_title.endswith("vs expected") and r["expected_ttft_ms"] is not None:
                groups[f"{r['model']} via {r['upstream']}, expected"].append(r["expected_ttft_ms"] / 1000)
        return {k: bucket_quantile(q, v, metrics.TTFT_BUCKETS) for k, v in groups.items()}
    if panel_title.startswith("Phase breakdown"):
        out = {}
        for phase in dashboard.PHASES:
            ms = [r["phases"][phase] for r in recs if r["phases"].get(phase) is not None]
            out[phase] = sum(ms) / len(ms) / 1000
        return out
    if panel_title == "Relay saturation: time queued in the relay":
        # Observed for every call, 0 when the kernel held nothing (metrics.ALWAYS_OBSERVED).
        queued = [r["phases"].get("relay_queue", 0.0) / 1000 for r in recs]
        return {"relay_queue": sum(queued) / len(queued), "p99": bucket_quantile(0.99, queued, metrics.TTFT_BUCKETS)}
    if panel_title.startswith("Error rate"):
        counts = defaultdict(int)
        for r in recs:
            if t := error_type(r):
                counts[t] += 1
        return {t: n / len(recs) for t, n in counts.items()}
    if panel_title.startswith("Trimmed tokens"):
        trimmed = sum(t["tokens_before"] - t["tokens_after"] for r in recs if (t := r["trim"])
                      and t.get("tokens_before") and t.get("tokens_after") and t["tokens_before"] > t["tokens_after"])
        return {"trimmed": trimmed / len(recs)}
    if panel_title in relay_side:
        return relay_side[panel_title]
    raise AssertionError(f"no expectation for panel {panel_title!r}: add one")


def loop_lag_in_window(prometheus: Prometheus, window: str, at: float) -> dict[str, float]:
    """The lag quantiles of the samples the relay exported in the window, from the raw
    bucket counts Prometheus stored (first and last sample of each bucket)."""
    delta = {}
    for series in prometheus.query(f"ttft_relay_event_loop_lag_seconds_bucket[{window}]", at=at):
        values = series["values"]
        delta[float(series["metric"]["le"])] = float(values[-1][1]) - float(values[0][1])
    upper = sorted(delta)
    assert delta[math.inf] > 0, "no lag samples in the window"
    return {f"p{round(q * 100)}": quantile_of_buckets(q, upper, [delta[b] for b in upper]) for q in (0.5, 0.99)}


def series_name(legend: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        legend = legend.replace("{{" + name + "}}", value)
    return legend


# --- the test ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_dashboard_expression_answers_what_the_records_say(start_relay, certs, tmp_path):
    # One upstream over TLS, so that every phase of the breakdown occurs.
    with FakeUpstream() as openai_fake, FakeUpstream(tls=True, certs=certs) as anthropic_fake:
        ports = [free_port() for _ in range(3)]  # mitmproxy may report listeners in another order
        relay = start_relay(f"reverse:{openai_fake.base_url}@{ports[0]}", f"reverse:{anthropic_fake.base_url}@{ports[1]}",
                            f"reverse:http://127.0.0.1:{free_port()}@{ports[2]}",  # nothing listens there
                            relay_metrics_listen="127.0.0.1:0", relay_trim_max_tokens=TRIM_BUDGET,
                            # Every request connects after its head: the connect phases occur (an
                            # eager connect's handshake overlaps the client's and shows as 0).
                            relay_upstream_pool=False, connection_strategy="lazy")
        relay.wait_for_output("tokenizer ready")  # requests before it go untrimmed
        relay_started = time.time()
        target = urllib.parse.urlsplit(metrics_url(relay)).netloc
        prometheus = Prometheus(tmp_path, target)
        try:
            # Before the first TLS handshake, trim or failure, their panels show 0, not nothing.
            plain = 2
            for _ in range(plain):
                assert _post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", CHAT) == 200
            t_plain = prometheus.scraped_calls(plain)
            window = f"{round((t_plain - relay_started) * 1000)}ms"
            for title, legend, zero in (("Phase breakdown (mean)", "upstream_tls", {"upstream_tls": 0.0}),
                                        ("Error rate by phase", "{{error_type}}", {"none": 0.0}),
                                        ("Trimmed tokens per call", "trimmed", {"trimmed": 0.0})):
                (query,) = [q for p in dashboard.PANELS if p.title == title for q in p.queries if q.legend == legend]
                result = prometheus.query(query.expr.replace(dashboard.RATE_INTERVAL, window), at=t_plain)
                assert {series_name(legend, r["metric"]): float(r["value"][1]) for r in result} == zero, title
            warmup = plain + run_mix(relay, ports, (40, 120))
            t0 = prometheus.scraped_calls(warmup)
            # Five per upstream (OpenAI: seven, with the trimmed and the frozen one): odd counts, so
            # p50 and p95 ranks fall inside a bucket, never on its edge, where the float sums of rates could tip the answer into the next bucket.
            measured = run_mix(relay, ports, (20, 60, 150, 300, 600))
            t1 = prometheus.scraped_calls(warmup + measured)
            # From the scrape at t0 to the one at t1: no extrapolation at either edge, so ratios
            # are exact (with a lead before t0, Prometheus extrapolates each series by it, but
            # never below zero: a sum still at 0 is not extrapolated, its count is).
            window = f"{round((t1 - t0) * 1000) + prometheus.range_start_lead_ms}ms"
            relay_side = {
                "Relay saturation: event-loop lag": loop_lag_in_window(prometheus, window, t1),
                # Idle by now: the kernel holds no connection for any of the relay's listeners.
                "Relay saturation: accept queue": {f"127.0.0.1:{port}": 0.0 for port in ports},
            }
            answers = {}
            for panel in dashboard.PANELS:
                for query in panel.queries:
                    result = prometheus.query(query.expr.replace(dashboard.RATE_INTERVAL, window), at=t1)
                    # A quantile of no observations is NaN and draws nothing: a model whose first token the
                    # relay has not learned to expect yet.
                    answers[panel.title] = answers.get(panel.title, {}) | {
                        series_name(query.legend, r["metric"]): float(r["value"][1]) for r in result
                        if not math.isnan(float(r["value"][1]))}
        finally:
            prometheus.stop()
    relay.stop()
    recs = read_records(tmp_path / "timing.jsonl")
    assert len(recs) == warmup + measured
    measured_recs = recs[warmup:]
    assert any(r["trim"] and r["trim"].get("trimmed") for r in measured_recs)  # the mix trims, fails, streams
    assert {error_type(r) for r in measured_recs} >= {"upstream_wait", "upstream_connect", ""}
    assert any(r["expected_ttft_ms"] for r in measured_recs)  # the relay learned to expect the first token
    for panel in dashboard.PANELS:
        want = expected(panel.title, measured_recs, relay_side)
        # Every series has something to show, but the accept queues, empty again once the
        # traffic is over (the frozen request filled one: the lag shows it).
        assert want and (all(v > 0 for v in want.values()) or "accept queue" in panel.title), (panel.title, want)
        got = answers[panel.title]
        assert got.keys() == want.keys(), (panel.title, got, want)
        for series, value in want.items():
            assert got[series] == pytest.approx(value, rel=1e-6), (panel.title, series, got, want)
