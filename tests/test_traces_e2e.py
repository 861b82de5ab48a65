"""Two chained relays (real mitmdump processes) export to a real trace store (Arize Phoenix,
tests/trace_store.py), and what the store answers is one trace per request or WebSocket turn
with both relays' spans, linked parent to child, phase durations equal to the records' and
the GenAI attributes.

    client ──► near relay ──► far relay ──► fake upstream
               relay_otlp_endpoint         OTEL_EXPORTER_OTLP_ENDPOINT (the standard variable)

A last case points a relay at a collector that is down: its requests and records are as
they were, its drops counted in the metric. The waterfall of the chained request is
screenshot from Phoenix's own page (test-artifacts/telemetry-trace.png; docs/telemetry.md
shows it) when Chromium is there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from ttft_relay import config
from ttft_relay.timing import phases
from ttft_relay.workers import free_port
from ttft_relay.testing import browser
from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes.client import request
from ttft_relay.testing.fakes.ws_client import WebSocketClient
from ttft_relay.testing.harness import MitmdumpProcess, metrics_url, scrape, total
from tests.trace_store import Phoenix

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}],
        "stream_options": {"include_usage": True}}
AUTH = {"authorization": f"Bearer {FAKE_OPENAI_KEY}"}
SPANS_PER_HOP = 2  # at least a root and the upstream span; the phases come on top
pytestmark = pytest.mark.shared_fake


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory) -> Iterator[Phoenix]:
    with Phoenix(tmp_path_factory.mktemp("phoenix")) as store:
        yield store


def relay(modes: list[str], confdir: Path, log: Path, env: dict[str, str] | None = None,
          **options: object) -> MitmdumpProcess:
    opts = {**config.MITMPROXY_DEFAULTS, "relay_timing_log": log, "relay_metrics_listen": "127.0.0.1:0", **options}
    clean = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "", **(env or {})}
    return MitmdumpProcess(modes, confdir, options=opts, env=clean).start()


@pytest.fixture(scope="module")
def chain(module_fake, phoenix, confdir, tmp_path_factory) -> Iterator[tuple[MitmdumpProcess, MitmdumpProcess]]:
    """(near, far): the near relay exports by its option, the far one by the standard variables.
    The module's tests share them (each finds its records and spans by `rid`), and `fake` is
    the far relay's upstream (`shared_fake`)."""
    logs = tmp_path_factory.mktemp("chain")
    far = relay([reverse_to(module_fake)], confdir, logs / "far.jsonl",
                env={"OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.otlp_base, "OTEL_SERVICE_NAME": "far-relay"})
    near = None
    try:
        near = relay([f"reverse:{far.url()}@0"], confdir, logs / "near.jsonl",
                     env={"OTEL_SERVICE_NAME": "near-relay"}, relay_otlp_endpoint=phoenix.otlp_base)
        yield near, far
    finally:
        for proc in (near, far):
            if proc is not None:
                proc.interrupt()
        for proc in (near, far):
            if proc is not None:
                proc.stop()
        for proc in (near, far):
            if proc is not None:
                assert not [ln for ln in proc.output if "Addon error" in ln], proc.text()
                proc.log.check_counts()


def hop(spans: list[dict], rec: dict) -> tuple[dict, dict[str, dict]]:
    """The root span of `rec` (by its record id) and its children by name."""
    (root,) = [s for s in spans if s["attributes"].get("ttft_relay.id") == rec["id"]]
    children = {s["name"]: s for s in spans if s["parent_id"] == root["context"]["span_id"]}
    return root, children


def at(span: dict, key: str) -> datetime:
    return datetime.fromisoformat(span[key])


def duration_ms(span: dict) -> float:
    return (at(span, "end_time") - at(span, "start_time")).total_seconds() * 1000


def phase_spans(rec: dict) -> set[str]:
    """The record's phases that get a span of their own: the critical path's and the stream."""
    return {name for name in (*phases.CRITICAL_PHASES, "stream") if name in rec["phases"]}


def spans_of(*recs: dict) -> int:
    """How many spans the hops of these records export (what to wait for: no fewer arrive)."""
    return sum(SPANS_PER_HOP + len(phase_spans(rec)) for rec in recs)


def assert_phases_match(children: dict[str, dict], rec: dict) -> None:
    """Every phase of the record has its span, with its duration (Phoenix keeps microseconds)."""
    expected = phase_spans(rec)
    assert expected and {n for n in children if n in phases.PHASES} == expected, (list(children), rec["phases"])
    for name in expected:
        assert duration_ms(children[name]) == pytest.approx(rec["phases"][name], abs=0.002), name


def assert_genai(root: dict, rec: dict) -> None:
    a = root["attributes"]
    assert (a["gen_ai.provider.name"], a["gen_ai.operation.name"]) == ("openai", "chat")
    assert a["gen_ai.request.model"] == rec["model"] and root["name"] == f"chat {rec['model']}"
    assert a["gen_ai.usage.input_tokens"] == rec["usage"]["input_tokens"]
    assert a["gen_ai.usage.output_tokens"] == rec["usage"]["output_tokens"]
    assert a["ttft_relay.verdict"] == rec["verdict"] and a["ttft_relay.ttft_ms"] == rec["ttft_ms"]
    assert a["ttft_relay.trimmed"] is False
    assert duration_ms(root) == pytest.approx(rec["phases"]["total"], abs=0.002)
    assert {e["name"] for e in root["events"]} >= {"first_byte", "first_event", "first_token"}
    text = json.dumps(root)
    assert FAKE_OPENAI_KEY not in text and "Say hello" not in text  # never a key, never a body


@pytest.mark.slow
def test_a_chained_request_is_one_trace_with_both_relays_phases(chain, fake, phoenix, rid):
    near, far = chain
    # A prefill the far side waits for: the waterfall shows where the time went (docs/telemetry.md).
    headers = {**AUTH, "x-request-id": rid, "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
               "x-fake-prefill-ms": "300"}
    conn, response = request("POST", near.url() + "/v1/chat/completions", CHAT, headers)
    with conn:
        assert response.status == 200 and b"[DONE]" in response.read()
    (near_rec,), (far_rec,) = near.log.of(rid), far.log.of(rid)

    spans = phoenix.wait_for_spans(CLIENT_TRACE, spans_of(near_rec, far_rec))
    assert {s["context"]["trace_id"] for s in spans} == {CLIENT_TRACE}
    near_root, near_children = hop(spans, near_rec)
    far_root, far_children = hop(spans, far_rec)
    # The client's span is the near root's parent; the near relay's upstream span the far root's.
    assert near_root["parent_id"] == CLIENT_SPAN
    near_upstream = near_children[f"upstream {near_rec['upstream']}"]
    assert far_root["parent_id"] == near_upstream["context"]["span_id"]
    # One clock, one machine: the far relay's whole wait lies within the near relay's exchange with it.
    assert at(near_upstream, "start_time") <= at(far_root, "start_time")
    assert at(far_root, "end_time") <= at(near_upstream, "end_time")
    far_upstream = far_children[f"upstream {far_rec['upstream']}"]
    # And the far relay passed its own upstream span on to the provider.
    (got,) = [r for r in fake.received if r.header("x-request-id") == rid]
    assert got.header("traceparent") == f"00-{CLIENT_TRACE}-{far_upstream['context']['span_id']}-01"
    assert got.header("tracestate") == "ttft-relay=1"
    for root, children, rec in ((near_root, near_children, near_rec), (far_root, far_children, far_rec)):
        assert_phases_match(children, rec)
        assert_genai(root, rec)
    assert near_root["attributes"]["server.address"] == "127.0.0.1"
    assert near_root["attributes"]["server.port"] == far.port
    screenshot(phoenix, CLIENT_TRACE, far_root["name"])


def test_a_relay_starts_the_trace_when_the_client_sent_none(chain, phoenix, rid):
    near, far = chain
    conn, response = request("POST", near.url() + "/v1/chat/completions", CHAT, {**AUTH, "x-request-id": rid})
    with conn:
        assert response.status == 200 and b"[DONE]" in response.read()
    (near_rec,), (far_rec,) = near.log.of(rid), far.log.of(rid)
    roots = phoenix.get("/v1/projects/default/spans", attribute=f"ttft_relay.request_id:{rid}", limit=10)["data"]
    deadline = time.monotonic() + 30
    while len(roots) < 2 and time.monotonic() < deadline:
        time.sleep(0.25)
        roots = phoenix.get("/v1/projects/default/spans", attribute=f"ttft_relay.request_id:{rid}", limit=10)["data"]
    (trace_id,) = {s["context"]["trace_id"] for s in roots}
    spans = phoenix.wait_for_spans(trace_id, spans_of(near_rec, far_rec))
    near_root, near_children = hop(spans, near_rec)
    far_root, _ = hop(spans, far_rec)
    assert near_root["parent_id"] is None
    assert far_root["parent_id"] == near_children[f"upstream {near_rec['upstream']}"]["context"]["span_id"]


def test_each_websocket_turn_is_one_trace_across_both_relays(chain, fake, phoenix, rid):
    near, _far = chain
    headers = {**AUTH, "openai-beta": "responses_websockets=2026-02-06", "x-request-id": rid}
    with WebSocketClient(near.url().replace("http://", "ws://") + "/v1/responses", headers=headers) as client:
        for _ in range(2):
            client.send_text(json.dumps({"type": "response.create", "model": "gpt-5.1-codex",
                                         "input": [{"type": "message", "role": "user", "content": "Say hello"}]}))
            while (msg := client.receive(20)) is not None:
                if json.loads(msg.text)["type"] in ("response.completed", "response.failed", "error"):
                    break
    near_recs = sorted(near.log.of(rid, 3), key=lambda r: r["turn"])
    far_recs = sorted(_far.log.of(rid, 3), key=lambda r: r["turn"])
    for near_rec, far_rec in zip(near_recs[1:], far_recs[1:]):  # the turns; 0 is the handshake
        roots = []
        deadline = time.monotonic() + 30
        while len(roots) < 2 and time.monotonic() < deadline:
            roots = [s for rec in (near_rec, far_rec) for s in phoenix.get(
                "/v1/projects/default/spans", attribute=f"ttft_relay.id:{rec['id']}", limit=10)["data"]]
            time.sleep(0.25)
        (trace_id,) = {s["context"]["trace_id"] for s in roots}
        spans = phoenix.wait_for_spans(trace_id, spans_of(near_rec, far_rec))
        near_root, near_children = hop(spans, near_rec)
        far_root, far_children = hop(spans, far_rec)
        assert far_root["parent_id"] == near_children[f"upstream {near_rec['upstream']}"]["context"]["span_id"]
        assert near_root["attributes"]["ttft_relay.turn"] == far_root["attributes"]["ttft_relay.turn"] == near_rec["turn"]
        for children, rec in ((near_children, near_rec), (far_children, far_rec)):
            assert_phases_match(children, rec)


def test_a_collector_that_is_down_changes_nothing_but_the_drop_count(fake, confdir, tmp_path, rid):
    down = f"http://127.0.0.1:{free_port()}"
    proc = relay([reverse_to(fake)], confdir, tmp_path / "timing.jsonl", relay_otlp_endpoint=down)
    try:
        for i in range(3):
            conn, response = request("POST", proc.url() + "/v1/chat/completions", CHAT,
                                     {**AUTH, "x-request-id": f"{rid}-{i}"})
            with conn:
                assert response.status == 200 and b"[DONE]" in response.read()
        recs = [proc.log.of(f"{rid}-{i}")[0] for i in range(3)]
        assert all(r["error"] is None and r["ttft_ms"] is not None for r in recs)
        proc.wait_for_output(r"OTLP export to .* failed", timeout=30)
        url = metrics_url(proc)
        deadline = time.monotonic() + 30
        while (dropped := total(scrape(url), "ttft_relay_otlp_dropped_records_total")) < 3 and \
                time.monotonic() < deadline:
            time.sleep(0.25)
        assert dropped == 3
    finally:
        proc.stop()
    assert len([ln for ln in proc.output if "OTLP export" in ln and "failed" in ln]) == 1  # logged once


@pytest.mark.parametrize("propagate, passed", [(None, True), ("api.openai.com", False), ("false", False)])
def test_trace_context_goes_only_to_the_upstreams_named(fake, confdir, tmp_path, rid, propagate, passed):
    """The provider received the relay's traceparent and a tracestate with the client's own entries
    whenever exporting was on. Now only the hops the operator names get them (by default those on
    loopback or a private network, as this fake upstream: a chained relay); elsewhere the
    request's headers are the client's, untouched."""
    from tests.test_otlp import Collector

    collector = Collector()
    options = {} if propagate is None else {"relay_otlp_propagate": propagate}
    proc = relay([reverse_to(fake)], confdir, tmp_path / "timing.jsonl",
                 relay_otlp_endpoint=collector.url, **options)
    client_context = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=client-secret"}
    try:
        conn, response = request("POST", proc.url() + "/v1/chat/completions", CHAT,
                                 {**AUTH, "x-request-id": rid, **client_context})
        with conn:
            assert response.status == 200 and b"[DONE]" in response.read()
        assert collector.wait(1)  # exported either way
    finally:
        proc.stop()
        collector.close()
    (got,) = [r for r in fake.received if r.header("x-request-id") == rid]
    if passed:
        assert got.header("traceparent").startswith(f"00-{CLIENT_TRACE}-")
        assert got.header("traceparent") != client_context["traceparent"]
        assert got.header("tracestate") == "ttft-relay=1,vendor=client-secret"
    else:
        assert (got.header("traceparent"), got.header("tracestate")) == tuple(client_context.values())


def screenshot(phoenix: Phoenix, trace_id: str, root_name: str) -> None:
    """Phoenix's page of the trace (its waterfall), for docs/telemetry.md."""
    if not browser.available():
        return
    out = browser.ARTIFACTS / "telemetry-trace.png"
    with browser.Browser(browser.ARTIFACTS / "chromium-telemetry", width=1440, height=1250) as b:
        page = b.open(f"{phoenix.url}/redirects/traces/{trace_id}")
        page.wait_for(f"document.body.innerText.includes({json.dumps(root_name)}) && "
                      "document.body.innerText.includes('head_to_first_token')", timeout=60)
        time.sleep(1)  # let the waterfall's bars finish drawing (no event says so)
        page.screenshot(out, full_page=False)
