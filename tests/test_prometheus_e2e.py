"""A real Prometheus scrapes a real relay while streams flow, and every PromQL expression of
the shipped Grafana dashboard (deploy/grafana/dashboard.py) answers what the relay's
timing records say.

The same traffic mix runs twice: first to create every series (Prometheus's rate()
counts only what changes after a series' first sample), then the measured round. Each
expression is evaluated at the first scrape after the measured round, over a window
that starts just before the last scrape before it, and compared with the measured round's
records: means and shares exactly, quantiles by Prometheus's own interpolation over
addons/metrics.py's buckets.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections import defaultdict

import orjson
import pytest

from addons import metrics
from deploy.grafana import dashboard
from scripts.workers import free_port
from tests.fakes import client
from tests.fakes.upstream import FakeUpstream
from tests.harness import metrics_url

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


def run_mix(urls: list[str], prefills: tuple[int, ...]) -> int:
    """Streams to two upstreams at several speeds, upstream errors, a dead upstream, trimmed
    requests; returns the number of calls."""
    openai_url, anthropic_url, dead_url = urls
    calls = 0
    for ms in prefills:
        assert _post(openai_url + "/v1/chat/completions", CHAT, **{"x-fake-prefill-ms": str(ms)}) == 200
        assert _post(anthropic_url + "/v1/messages", MESSAGES, **{"x-fake-prefill-ms": str(ms // 2)}) == 200
        calls += 2
    for _ in range(2):
        assert _post(openai_url + "/v1/chat/completions", CHAT, **{"x-fake-status": "500"}) == 500
        assert _post(openai_url + "/v1/chat/completions", LONG_HISTORY) == 200
        calls += 2
    assert _post(dead_url + "/v1/chat/completions", CHAT) == 502
    return calls + 1


# --- what the records say -----------------------------------------------------------------------


def bucket_quantile(q: float, values: list[float], bounds: tuple[float, ...]) -> float:
    """Prometheus's histogram_quantile over `values` observed into buckets `bounds` (+Inf added)."""
    upper = [*bounds, math.inf]
    cumulative = [sum(v <= b for v in values) for b in upper]
    rank = q * cumulative[-1]
    b = next(i for i, c in enumerate(cumulative[:-1] + [math.inf]) if c >= rank)
    if b == len(upper) - 1:
        return upper[-2]
    start, count = (upper[b - 1], cumulative[b] - cumulative[b - 1]) if b else (0.0, cumulative[0])
    return start + (upper[b] - start) * ((rank - (cumulative[b - 1] if b else 0)) / count)


def error_type(rec: dict) -> str:
    return rec["error_phase"] or ("client_aborted" if rec["error"] or rec["client_aborted"] else "")


def expected(panel_title: str, recs: list[dict]) -> dict[str, float]:
    """What each panel's queries must answer for these records, keyed by series."""
    ok = [r for r in recs if not r["error"] and not r["client_aborted"] and (r["status"] or 0) < 400
          and r["ttft_ms"] is not None]
    if panel_title.startswith("Time to first token"):
        q = 0.5 if "p50" in panel_title else 0.95
        groups = defaultdict(list)
        for r in ok:
            groups[f"{r['model']} via {r['upstream']}"].append(r["ttft_ms"] / 1000)
        return {k: bucket_quantile(q, v, metrics.TTFT_BUCKETS) for k, v in groups.items()}
    if panel_title.startswith("Phase breakdown"):
        out = {}
        for phase in dashboard.PHASES:
            ms = [r["phases"][phase] for r in recs if r["phases"].get(phase) is not None]
            out[phase] = sum(ms) / len(ms) / 1000
        return out
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
    raise AssertionError(f"no expectation for panel {panel_title!r}: add one")


def series_name(legend: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        legend = legend.replace("{{" + name + "}}", value)
    return legend


# --- the test ------------------------------------------------------------------------------------


def test_every_dashboard_expression_answers_what_the_records_say(start_relay, certs, tmp_path):
    # One upstream over TLS, so that every phase of the breakdown occurs.
    with FakeUpstream() as openai_fake, FakeUpstream(tls=True, certs=certs) as anthropic_fake:
        ports = [free_port() for _ in range(3)]  # mitmproxy may report listeners in another order
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        relay = start_relay(f"reverse:{openai_fake.base_url}@{ports[0]}", f"reverse:{anthropic_fake.base_url}@{ports[1]}",
                            f"reverse:http://127.0.0.1:{free_port()}@{ports[2]}",  # nothing listens there
                            relay_metrics_listen="127.0.0.1:0", relay_trim_max_tokens=TRIM_BUDGET)
        relay.wait_for_output("tokenizer ready")  # requests before it go untrimmed
        target = urllib.parse.urlsplit(metrics_url(relay)).netloc
        prometheus = Prometheus(tmp_path, target)
        try:
            warmup = run_mix(urls, (40, 120))
            t0 = prometheus.scraped_calls(warmup)
            # Five per upstream: p50 and p95 ranks (2.5, 4.75) fall inside a bucket, never on its
            # edge, where the float sums of rates could tip the answer into the next bucket.
            measured = run_mix(urls, (20, 60, 150, 300, 600))
            t1 = prometheus.scraped_calls(warmup + measured)
            # From just before the scrape at t0: rate() extrapolates every series by the same
            # 1 ms, so ratios are exact (a longer lead would be cut short, per series, where a
            # counter's first value is small: Prometheus never extrapolates below zero).
            window = f"{round((t1 - t0) * 1000) + 1}ms"
            answers = {}
            for panel in dashboard.PANELS:
                for query in panel.queries:
                    result = prometheus.query(query.expr.replace(dashboard.RATE_INTERVAL, window), at=t1)
                    answers[panel.title] = answers.get(panel.title, {}) | {
                        series_name(query.legend, r["metric"]): float(r["value"][1]) for r in result}
        finally:
            prometheus.stop()
    relay.stop()
    recs = [orjson.loads(line) for line in (tmp_path / "timing.jsonl").read_bytes().splitlines()]
    assert len(recs) == warmup + measured
    measured_recs = recs[warmup:]
    assert any(r["trim"] and r["trim"].get("trimmed") for r in measured_recs)  # the mix trims, fails, streams
    assert {error_type(r) for r in measured_recs} >= {"upstream_wait", "upstream_connect", ""}
    for panel in dashboard.PANELS:
        want = expected(panel.title, measured_recs)
        assert want and all(v > 0 for v in want.values()), (panel.title, want)
        got = answers[panel.title]
        assert got.keys() == want.keys(), (panel.title, got, want)
        for series, value in want.items():
            assert got[series] == pytest.approx(value, rel=1e-6), (panel.title, series, got, want)
