"""The Grafana dashboard of ttft-relay, generated from the panel list below.

    .venv/bin/python deploy/grafana/dashboard.py           # rewrite dashboards/ttft-relay.json
    .venv/bin/python deploy/grafana/dashboard.py --check   # exit 1 if the file is stale

Every PromQL expression lives here, once: tests/test_prometheus_e2e.py evaluates each
of them on a real Prometheus scraping a relay and compares the answers with the
relay's own timing records, and checks that the shipped JSON is this module's output.
A metric renamed in ttft_relay/observe/metrics.py fails that test.

Expressions use Grafana's `$__rate_interval`; the test puts a window in its place.
Ratios of two rates (means, shares, quantiles) do not depend on Prometheus's
extrapolation at the window's edges, so they equal what the records in the window say.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "ttft-relay.json"
RATE_INTERVAL = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
"""The uid the provisioned data source (provisioning/datasources/prometheus.yaml) has."""
PHASES = ("client_upload", "relay", "upstream_connect", "upstream_tls", "upstream_wait", "head_to_first_token")
"""The phases ttft_relay/observe/metrics.py exports as ttft_relay_<phase>_seconds, but relay_queue: it is
observed for every call (0 when the kernel held nothing), so its mean per call that had it would be its
mean over all calls; it has a saturation panel of its own."""
EPSILON = "1e-12"
"""A rate no real traffic has: dividing by at least it, a mean over no calls is 0, not NaN."""


def or_zero(expr: str) -> str:
    """`expr`, or 0 while it has no series (before the first call that has the metric): a panel
    shows 0, not nothing."""
    return f"({expr}) or on() vector(0)"


@dataclass(frozen=True)
class Query:
    legend: str
    expr: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]


def ttft_quantile(q: float) -> Query:
    return Query("{{gen_ai_request_model}} via {{server_address}}",
                 f"histogram_quantile({q}, sum by (le, gen_ai_request_model, server_address) "
                 f"(rate(gen_ai_server_time_to_first_token_seconds_bucket[{RATE_INTERVAL}])))")


def loop_lag_quantile(q: float) -> Query:
    return Query(f"p{round(q * 100)}", f"histogram_quantile({q}, sum by (le) "
                                     f"(rate(ttft_relay_event_loop_lag_seconds_bucket[{RATE_INTERVAL}])))")


def relay_queue_quantile(q: float) -> Query:
    return Query(f"p{round(q * 100)}", f"histogram_quantile({q}, sum by (le) "
                                     f"(rate(ttft_relay_relay_queue_seconds_bucket[{RATE_INTERVAL}])))")


def expected_ttft_quantile(q: float) -> Query:
    return Query("{{gen_ai_request_model}} via {{server_address}}, expected",
                 f"histogram_quantile({q}, sum by (le, gen_ai_request_model, server_address) "
                 f"(rate(ttft_relay_expected_time_to_first_token_seconds_bucket[{RATE_INTERVAL}])))")


def phase_mean(phase: str) -> Query:
    metric = f"ttft_relay_{phase}_seconds"
    return Query(phase, or_zero(f"sum(rate({metric}_sum[{RATE_INTERVAL}])) / "
                                f"clamp_min(sum(rate({metric}_count[{RATE_INTERVAL}])), {EPSILON})"))


CALLS = f"sum(rate(gen_ai_client_operation_duration_seconds_count[{RATE_INTERVAL}]))"

PANELS = (
    Panel("Time to first token p50", "Successful calls, request head at the relay to first token, per model and "
          "upstream.", "s", (ttft_quantile(0.5),)),
    Panel("Time to first token p95", "As p50, the slow tail.", "s", (ttft_quantile(0.95),)),
    Panel("Time to first token p95 vs expected", "The slow tail of the first token, beside the first token the "
          "relay learned each call's prompt predicts (ttft_relay/observe/prefill.py; from the 8th call of a model on): "
          "a first token far above its expected one is upstream queueing, one that follows it is context length.",
          "s", (ttft_quantile(0.95), expected_ttft_quantile(0.95))),
    Panel("Phase breakdown (mean)", "Where a call's time before the first token went: the relay's phases "
          "(ttft_relay/timing/phases.py), mean per call that had the phase; head_to_first_token is the prefill of "
          "an upstream that sends its head at once.", "s", tuple(phase_mean(p) for p in PHASES)),
    Panel("Error rate by phase", "Share of calls that failed, by the phase they failed in (error_type); none: "
          "no call failed.", "percentunit",
          (Query("{{error_type}}", f"(sum by (error_type) (rate(gen_ai_client_operation_duration_seconds_count"
                                   f"{{error_type!=\"\"}}[{RATE_INTERVAL}])) / scalar({CALLS})) or on() "
                                   f"label_replace(vector(0), \"error_type\", \"none\", \"\", \"\")"),)),
    Panel("Trimmed tokens per call", "Prompt tokens the trimmer removed, per call through the relay.", "short",
          (Query("trimmed", or_zero(f"sum(rate(ttft_relay_trimmed_tokens_total[{RATE_INTERVAL}])) / "
                                    f"clamp_min({CALLS}, {EPSILON})")),)),
    Panel("Relay saturation: event-loop lag", "How late the relay's event loop runs a timer due every 50 ms "
          "(ttft_relay/observe/selfwatch.py): beyond a few ms the relay itself is the slow hop (verdict \"relay saturated\"; "
          "then add workers, see Scaling out).", "s", (loop_lag_quantile(0.5), loop_lag_quantile(0.99))),
    Panel("Relay saturation: time queued in the relay", "How long a call's bytes waited in the kernel because "
          "the relay's event loop was busy (the relay_queue phase, ttft_relay/timing/phases.py; 0 for most calls): "
          "mean per call and p99. Above a few ms the relay is the slow hop.", "s",
          (phase_mean("relay_queue"), relay_queue_quantile(0.99))),
    Panel("Relay saturation: accept queue", "Connections the kernel holds for each listener until the relay "
          "accepts them.", "short",
          (Query("{{listener}}", "max by (listener) (ttft_relay_accept_queue_connections)"),)),
)


def dashboard() -> dict:
    panels = []
    for i, panel in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": panel.title,
            "description": panel.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": q.expr,
                         "legendFormat": q.legend} for j, q in enumerate(panel.queries)],
        })
    return {
        "uid": "ttft-relay",
        "title": "ttft-relay",
        "description": "Why is my first token slow? The relay's timing records as metrics (generated by "
                       "deploy/grafana/dashboard.py).",
        "tags": ["llm", "ttft-relay"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "utc",
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUTPUT.exists() or OUTPUT.read_text(encoding="utf8") != text:
            print(f"{OUTPUT} is stale: run {Path(__file__).name} to regenerate it", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
