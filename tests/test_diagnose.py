"""ttft-relay diagnose: the probe, the prompts, the findings, and the verdict end to end.

The end-to-end tests inject one cause at a time (a far upstream behind a delaying
forwarder, prefill that grows with the prompt, a slow hop to the relay, a dead
upstream) and check that the verdict names it, with its size within a stated
tolerance. Injected delays are a few hundred ms so scheduling noise on a busy
machine cannot decide; no test asserts an absolute time on its own. Issue 34's case
runs on a real far link (`ttft_relay/testing/fakes/link.py`) with diagnose's defaults:
the link is the verdict, and the context only at a user's own long prompts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from ttft_relay.diagnose import cli, findings, probe, probe_requests
from ttft_relay.diagnose.findings import ProbeResult
from ttft_relay.workers import free_port as closed_port
from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes import DelayingForwarder, link
from ttft_relay.testing.fakes.client import HttpConnection

pytestmark = pytest.mark.shared_fake  # and the relays to it, where cases differ only by request

REPO = Path(__file__).resolve().parent.parent
ONE_WAY_MS = 100
"""Injected one-way delay: a round trip costs 2 x this."""
SLACK_MS = 120
"""What a measured delay may exceed the injected one by (a busy 2-core machine, mitmproxy's own time)."""


# --- pure parts ---------------------------------------------------------------------------


def test_chunked_decoder_handles_every_split_point():
    wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"
    for split in range(len(wire) + 1):
        decoder = probe.ChunkedDecoder()
        body = decoder.feed(wire[:split]) + decoder.feed(wire[split:])
        assert body == b"hello, world" and decoder.done


def test_endpoint_takes_base_urls_with_or_without_v1():
    e = probe.Endpoint.parse("https://api.openai.com/v1/")
    assert (e.host, e.port, e.prefix, e.authority) == ("api.openai.com", 443, "", "api.openai.com")
    assert probe.Endpoint.parse("http://127.0.0.1:8001/gw/v1").url("/v1/x") == "http://127.0.0.1:8001/gw/v1/x"


def test_request_goes_absolute_through_a_plain_http_proxy_and_relative_elsewhere():
    req = probe_requests.ProbeRequest("/v1/chat/completions", [("a", "b")], b"{}", "id", 1)
    target = probe.Endpoint.parse("http://up:9000")
    proxied = probe.request_bytes(probe.Route(target, proxy=probe.Endpoint.parse("http://p:8080")), req)
    assert proxied.startswith(b"POST http://up:9000/v1/chat/completions HTTP/1.1\r\nhost: up:9000\r\n")
    assert probe.request_bytes(probe.Route(target), req).startswith(b"POST /v1/chat/completions HTTP/1.1")


def test_long_prompt_has_the_asked_size_and_a_fresh_prefix_each_time():
    factory = probe_requests.PromptFactory(probe_requests.API_SHAPES["openai.chat"], "m", 16, None)
    a, b = factory.long(2000), factory.long(2000)
    assert abs(a.prompt_tokens - 2000) <= 5
    assert a.body[:80] != b.body[:80]  # no shared prefix for a prompt cache to hit
    body = orjson.loads(a.body)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (a.headers[4][0], a.headers[4][1][:10]) == ("x-request-id", "ttft-diag-")


def test_user_body_is_streamed_and_only_its_prompt_counted():
    factory = probe_requests.PromptFactory(probe_requests.API_SHAPES["anthropic.messages"], "m", 16, "k")
    req = factory.from_user_body({"model": "claude-x", "system": "be brief", "max_tokens": 99,
                                  "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]},
                                 model_override=None)
    body = orjson.loads(req.body)
    assert body["stream"] is True and body["model"] == "claude-x" and body["max_tokens"] == 99
    assert req.prompt_tokens == factory.count("be brief") + factory.count("hi there")
    assert ("x-api-key", "k") in req.headers


def probe_result(path: str, prompt: str, ttft: float, *, sent: float = 1.0, tokens: int = 10, **kw) -> ProbeResult:
    marks = {"dns": 0.1, "tcp": 0.5, "sent": sent, "head": ttft - 1, "first_token": ttft, "end": ttft + 5}
    return ProbeResult(path, prompt, f"{path}-{prompt}-{ttft}", tokens, tokens * 4, marks, 200, **kw)


def test_probe_phases_run_between_consecutive_marks():
    p = probe_result("direct", "tiny", 100.0)
    assert p.phases() == {"dns": 0.1, "tcp": 0.4, "send": 0.5, "wait": 98.0, "head_to_first_token": 1.0,
                          "ttft": 100.0, "total": 105.0}


def test_context_length_is_a_rate_until_weighed_at_the_users_own_prompts():
    probes = [probe_result("direct", "tiny", 100 + i, tokens=10) for i in range(3)]
    probes += [probe_result("direct", "long", 900 + i, tokens=8010) for i in range(3)]
    unweighed = findings.diagnose(findings.Evidence(probes))
    context = finding(unweighed, findings.CONTEXT_LENGTH)
    assert context.numbers["ms_per_1k_tokens"] == pytest.approx(100, abs=1)
    assert not context.weighed and not context.significant and unweighed.verdict is None  # diagnose's size, not yours
    text = findings.render(findings.Evidence(probes), unweighed)
    assert "not weighed: every 8.0k tokens of history add 800 ms — pass --prompt-tokens N" in text
    weighed = findings.diagnose(findings.Evidence(probes, prompt_size=findings.PromptSize(30_010, "--prompt-tokens")))
    assert weighed.verdict.cause == findings.CONTEXT_LENGTH and weighed.verdict.weighed
    assert weighed.verdict.ms == pytest.approx(3000, abs=5)
    assert weighed.verdict.detail.startswith("your prompts (30.0k tokens: --prompt-tokens) wait ≈ 3000 ms longer")
    assert "not weighed" not in findings.render(findings.Evidence(probes), weighed)


def linked_probe(prompt: str, rtt: float, ttft: float, tokens: int, i: int = 0) -> ProbeResult:
    """A relayed probe as diagnose measures it over a link of `rtt` to the relay: its TCP
    connect takes one round trip, its request crosses the link once and its first token once."""
    marks = {"dns": 0.1, "tcp": 0.1 + rtt, "sent": 0.3 + rtt, "head": ttft - 1, "first_token": ttft, "end": ttft + 50}
    return ProbeResult("relayed", prompt, f"relayed-{prompt}-{i}", tokens, tokens * 4, marks, 200)


def probes_over(rtt: float, prefill_ms: float, per_1k_ms: float, repeat: int = 3) -> list[ProbeResult]:
    """`diagnose --no-direct` (tiny, and its default 8k-token long probe) through a link of `rtt`
    to a relay whose provider takes `prefill_ms` + `per_1k_ms` per 1k prompt tokens."""
    def ttft(tokens: int) -> float:
        return 2 * rtt + prefill_ms + per_1k_ms * tokens / 1000  # connect, request and first token
    return [linked_probe(prompt, rtt, ttft(tokens) + i, tokens, i)
            for i in range(repeat) for prompt, tokens in (("tiny", 10), ("long", 8010))]


def test_a_far_link_is_the_verdict_whatever_the_size_of_diagnoses_own_long_probe():
    # Issue 34: 150 ms each way, prefill 150 ms + 100 ms per 1k tokens. The long probe's extra
    # 800 ms read `context length (804 ms) — trim history` while the tiny probe showed the link.
    probes = probes_over(rtt=300, prefill_ms=150, per_1k_ms=100)
    result = findings.diagnose(findings.Evidence(probes))
    assert result.verdict.cause == findings.NETWORK_TO_RELAY
    assert result.verdict.ms == pytest.approx(300, abs=1)
    assert finding(result, findings.CONTEXT_LENGTH).numbers["ms_per_1k_tokens"] == pytest.approx(100, abs=1)
    text = findings.render(findings.Evidence(probes), result)
    assert "verdict: network to the relay (300 ms)" in text
    assert "not weighed: every 8.0k tokens of history add 800 ms" in text
    # At prompts of the user's that cost less than the link, the link stays the verdict.
    short = findings.diagnose(findings.Evidence(probes, prompt_size=findings.PromptSize(2000, "--prompt-tokens")))
    assert short.verdict.cause == findings.NETWORK_TO_RELAY
    assert finding(short, findings.CONTEXT_LENGTH).ms == pytest.approx(199, abs=1)


def test_a_long_history_on_a_near_link_is_context_length_from_the_relays_log():
    probes = probes_over(rtt=1, prefill_ms=150, per_1k_ms=100)
    records = [{"upstream": "api.openai.com", "prompt_tokens": 41_000,
                "usage": {"input_tokens": 40_000 + i, "cached_tokens": 10_000}} for i in range(5)]
    size = findings.prompt_size_of_traffic(records, ["api.openai.com"])
    assert size.tokens == 30_002  # uncached, as the upstream reported: the cache's share costs next to nothing
    result = findings.diagnose(findings.Evidence(probes, prompt_size=size))
    v = result.verdict
    assert v.cause == findings.CONTEXT_LENGTH and v.ms == pytest.approx(3000, abs=5)
    assert "the median of your 5 requests in the relay's log; 10.0k more read from the provider's cache" in v.detail


def test_with_the_relays_records_the_rate_is_the_upstreams_own_not_the_long_bodys_upload_over_the_link():
    # Over 300 ms round trips a long body takes two more of them to upload (slow start): the
    # link's, which the relay's records tell apart from the upstream's own wait.
    probes, records = [], {}
    for i in range(3):
        for prompt, tokens, upload, prefill_ms in (("tiny", 10, 0, 150), ("long", 8010, 600, 950)):
            probe = linked_probe(prompt, 300, 300 + upload + 300 + prefill_ms + 2 + i, tokens, i)
            probes.append(probe)
            records[probe.request_id] = {"phases": {"relay": 1.0, "upstream_wait": prefill_ms + 1.0}, "rtt_ms": 1.0}
    result = findings.diagnose(findings.Evidence(probes, records))
    context = finding(result, findings.CONTEXT_LENGTH)
    assert context.numbers["ms_per_1k_tokens"] == pytest.approx(100, abs=1)  # the probes' waits say 175
    assert context.numbers["link_extra_ms"] == pytest.approx(600, abs=1)
    assert "its way to the relay took 600 ms more (the link's, not counted here)" in context.detail
    assert result.verdict.cause == findings.NETWORK_TO_RELAY


def test_the_users_prompt_size_comes_from_their_own_first_token_requests_to_the_probed_upstream():
    records = [
        {"upstream": "up", "prompt_tokens": 900},  # counted by the relay, no usage
        {"upstream": "up", "prompt_tokens": 50, "usage": {"input_tokens": 1100}},  # the upstream's word first
        {"upstream": "up", "prompt_tokens": 5000, "transport": "websocket", "turn": 0},  # a handshake
        {"upstream": "up", "prompt_tokens": 5000, "prewarm": True},  # asks for no token
        {"upstream": "other", "prompt_tokens": 5000},  # another upstream's model
        {"upstream": "up"},  # size unknown
    ]
    assert findings.prompt_size_of_traffic(records, ["up"]) == findings.PromptSize(
        1000, "the median of your 2 requests in the relay's log")
    assert findings.prompt_size_of_traffic(records).tokens == 1100  # no probe record: every upstream
    assert findings.prompt_size_of_traffic(records[2:4]) is None


def test_network_to_relay_is_what_the_relay_record_does_not_account_for():
    probes = [probe_result("relayed", "tiny", 350 + i) for i in range(3)]
    records = {p.request_id: {"phases": {"relay": 1.0, "upstream_wait": 48.0}, "rtt_ms": 2.0} for p in probes}
    result = findings.diagnose(findings.Evidence(probes, records))
    assert result.verdict.cause == findings.NETWORK_TO_RELAY
    assert result.verdict.ms == pytest.approx(301, abs=1)


def test_instability_needs_a_spread_large_against_the_median_and_more_than_one_outlier():
    def spread_of(*ttfts: float) -> findings.Finding | None:
        return findings.upstream_instability(findings.Evidence([probe_result("direct", "tiny", t) for t in ttfts]))

    assert not spread_of(2000, 2100, 2200, 2300, 2400).significant  # 200 ms on 2.2 s (the middle three)
    assert spread_of(100, 110, 300, 500, 600).significant  # 390 ms on 300 ms
    assert not spread_of(100, 110, 120, 130, 3000).significant  # one slow try in five is not enough
    assert spread_of(100, 110, 120, 130, 3000).numbers["high_ms"] == pytest.approx(3000, abs=1)  # but reported
    assert spread_of(100, 500, 900) is None  # too few tries to tell


def test_a_mid_stream_stall_of_seconds_is_a_finding():
    probes = [probe_result("direct", "tiny", 100 + i) for i in range(3)]
    assert findings.mid_stream_stall(findings.Evidence(probes)) is None  # no chunk after the first token
    for i, p in enumerate(probes):
        p.stall_ms = 20.0 + i
    assert not findings.mid_stream_stall(findings.Evidence(probes)).significant
    stalled = probe_result("relayed", "tiny", 110)
    stalled.stall_ms = 3000.0
    result = findings.diagnose(findings.Evidence(probes + [stalled]))
    assert result.verdict.cause == findings.MID_STREAM_STALL and result.verdict.ms == 3000.0
    assert result.verdict.detail == ("relayed tiny: 3000 ms of silence after the first token (direct probes at most "
                                     "22 ms; relayed probes at most 3000 ms)")


def test_every_probe_failing_is_the_verdict():
    refused = ProbeResult("direct", "tiny", "r1", 2, 8, {"dns": 0.1, "end": 0.3}, error="Connection refused",
                          error_phase="tcp")
    gateway = ProbeResult("relayed", "tiny", "r2", 2, 8, {"dns": 0.1, "end": 3.0}, status=502,
                          error="HTTP 502: bad gateway", error_phase="wait")
    result = findings.diagnose(findings.Evidence([refused, gateway]))
    assert result.failed and result.verdict.cause == findings.UPSTREAM_UNREACHABLE
    assert "Connection refused (in tcp) 1/1" in result.verdict.detail
    only_relay = findings.diagnose(findings.Evidence([gateway]))
    assert only_relay.verdict.cause == findings.UPSTREAM_UNREACHABLE


def test_the_users_records_are_the_newest_before_the_probes_and_any_since_without_diagnoses_own(tmp_path,
                                                                                              monkeypatch):
    log = tmp_path / "timing.jsonl"

    def line(rid: str) -> bytes:
        return orjson.dumps({"request_id": rid, "prompt_tokens": 100}) + b"\n"

    log.write_bytes(line("too-old") + line("recent") + line("ttft-diag-earlier-run"))
    monkeypatch.setattr(cli, "USERS_RECORDS_BYTES", len(line("recent") + line("ttft-diag-earlier-run")) + 3)
    relay_log = cli.RelayLog(log)
    with open(log, "ab") as f:
        f.write(line("ttft-diag-this-run") + line("while-probing") + b'{"request_id": "half-writ')
    assert [r["request_id"] for r in relay_log.users_records()] == ["recent", "while-probing"]


def test_redactor_hides_the_key_in_text_and_log_lines():
    redact = cli.Redactor(["sk-secret"])
    assert redact("Incorrect API key provided: sk-secret.") == "Incorrect API key provided: [redacted]."


# --- end to end ---------------------------------------------------------------------------


def run_diagnosis(*argv: str, key: str | None = FAKE_OPENAI_KEY) -> tuple[findings.Evidence, findings.Diagnosis]:
    """The CLI's own collect step in-process; the findings from the pure functions."""
    args = cli.parse_args(list(argv))
    evidence = cli.collect(args, probe_requests.API_SHAPES[args.api], key)
    return evidence, findings.diagnose(evidence)


def finding(result: findings.Diagnosis, cause: str) -> findings.Finding:
    return next(f for f in result.findings if f.cause == cause)


@pytest.mark.parametrize("api", sorted(probe_requests.API_SHAPES))
def test_every_api_shape_finds_its_first_token(fake, api):
    fake.behaviour.prefill_ms = 50
    evidence, result = run_diagnosis("--api", api, "--upstream", fake.base_url, "--repeat", "2", "--long-tokens", "200")
    assert len(evidence.ok("direct tiny")) == len(evidence.ok("direct long")) == 2
    for p in evidence.probes:  # the token comes after the prefill, well after the head
        assert p.phases()["ttft"] >= 50 and p.phases()["head_to_first_token"] >= 25
    assert fake.received[0].path == probe_requests.API_SHAPES[api].path and not result.failed


def test_users_own_body_is_the_long_probe(fake, tmp_path):
    body_file = tmp_path / "request.json"
    body_file.write_bytes(orjson.dumps({"model": "my-model", "messages": [{"role": "user", "content": "x " * 3000}]}))
    evidence, _ = run_diagnosis("--upstream", fake.base_url, "--body-file", str(body_file), "--repeat", "1")
    (long,) = evidence.ok("direct long")
    sent = orjson.loads(fake.received[-1].body)
    assert sent["model"] == "my-model" and sent["stream"] is True and long.prompt_tokens >= 3000
    assert orjson.loads(fake.received[0].body)["model"] == "my-model"  # the tiny probe asks the same model


def test_far_upstream_behind_the_relay_is_named_with_its_tls_and_round_trip(start_relay, fake_tls, certs, tmp_path):
    with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as far:
        # Without the upstream pool: each relayed probe connects, so its TLS shows in the records.
        relay = start_relay(f"reverse:https://127.0.0.1:{far.port}@0", relay_upstream_pool=False)
        evidence, result = run_diagnosis(
            "--upstream", fake_tls.base_url, "--ca", str(certs.ca_pem), "--relay", relay.url(),
            "--relay-log", str(tmp_path / "timing.jsonl"), "--repeat", "3", "--long-tokens", "1000",
        )
    print(findings.render(evidence, result))
    assert len(evidence.records) == 6
    v = result.verdict
    round_trip = 2 * ONE_WAY_MS
    assert v.cause == findings.RELAY_UPSTREAM_NETWORK
    assert round_trip <= v.numbers["tls_ms"] < round_trip + SLACK_MS
    assert round_trip <= v.numbers["rtt_ms"] < round_trip + SLACK_MS
    assert 2 * round_trip <= v.ms < 2 * round_trip + SLACK_MS
    overhead = finding(result, findings.RELAY_OVERHEAD)
    assert abs(overhead.ms) < SLACK_MS  # the network difference explains the relayed-minus-direct gap


def test_prefill_growing_with_the_prompt_is_named_in_ms_per_1k_tokens(shared_relay, fake):
    per_1k_fake_tokens = 50  # the fake counts body bytes / 4 as tokens
    fake.behaviour.prefill_ms_per_1k_tokens = per_1k_fake_tokens
    relay = shared_relay(reverse_to(fake))  # its log shared too: diagnose joins its probes by x-request-id
    evidence, result = run_diagnosis(
        "--upstream", fake.base_url, "--relay", relay.url(), "--relay-log", str(relay.log.path),
        "--repeat", "3", "--long-tokens", "8000", "--prompt-tokens", "16000",
    )
    print(findings.render(evidence, result))
    tiny, long = evidence.ok("direct tiny")[0], evidence.ok("direct long")[0]
    expected = per_1k_fake_tokens * ((long.body_bytes - tiny.body_bytes) / 4) / (long.prompt_tokens - tiny.prompt_tokens)
    v = result.verdict
    assert v.cause == findings.CONTEXT_LENGTH and v.numbers["prompt_tokens"] == 16000
    assert v.numbers["ms_per_1k_tokens"] == pytest.approx(expected, rel=0.15)  # ±15 %: ≈ ±60 ms on 400 ms
    assert v.ms == pytest.approx(v.numbers["ms_per_1k_tokens"] * (16000 - tiny.prompt_tokens) / 1000, abs=1)


def users_requests(relay, words: int, n: int = 3) -> None:
    """`n` streamed requests of a user whose prompt is `words` words long, through the relay."""
    body = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "word " * words}]}
    for i in range(n):
        with HttpConnection(relay.url()) as conn:
            response = conn.request("POST", "/v1/chat/completions", body, {"x-request-id": f"user-{i}"})
            assert response.status == 200
            response.read()
        relay.log.of(f"user-{i}")  # in the log before diagnose reads it


def test_the_context_is_weighed_at_the_users_own_requests_in_the_relays_log(start_relay, fake, tmp_path):
    fake.behaviour.prefill_ms_per_1k_tokens = 50  # 20k-token prompts: a second of prefill
    relay = start_relay(reverse_to(fake))
    log = tmp_path / "timing.jsonl"
    argv = ("--upstream", fake.base_url, "--relay", relay.url(), "--relay-log", str(log), "--repeat", "2",
            "--long-tokens", "2000")
    _, before = run_diagnosis(*argv)  # only the probes in the log: the context is said as a rate
    assert finding(before, findings.CONTEXT_LENGTH).weighed is False
    assert before.verdict is None or before.verdict.cause != findings.CONTEXT_LENGTH
    users_requests(relay, 16_000)  # 80 kB each: 20k tokens as the fake counts them
    evidence, result = run_diagnosis(*argv)
    print(findings.render(evidence, result))
    v = result.verdict
    assert v.cause == findings.CONTEXT_LENGTH
    assert v.numbers["prompt_tokens"] == pytest.approx(20_000, rel=0.01)  # as the upstream counted them (the body)
    assert "the median of your 3 requests in the relay's log" in v.detail  # the probes of both runs left out
    assert v.ms > 5 * finding(result, findings.CONTEXT_LENGTH).numbers["probe_extra_ms"]


def test_slow_hop_to_the_relay_is_named_with_its_round_trip(shared_relay, fake):
    relay = shared_relay(reverse_to(fake))
    with DelayingForwarder("127.0.0.1", relay.port, ONE_WAY_MS) as slow_hop:
        evidence, result = run_diagnosis(
            "--upstream", fake.base_url, "--relay", f"http://127.0.0.1:{slow_hop.port}",
            "--relay-log", str(relay.log.path), "--repeat", "3", "--long-tokens", "1000",
        )
    print(findings.render(evidence, result))
    v = result.verdict
    assert v.cause == findings.NETWORK_TO_RELAY
    assert 2 * ONE_WAY_MS <= v.ms < 2 * ONE_WAY_MS + SLACK_MS


def test_through_the_relay_as_https_proxy(start_relay, fake_tls, certs, tmp_path):
    relay = start_relay("regular@0")
    evidence, result = run_diagnosis(
        "--upstream", fake_tls.base_url, "--ca", str(certs.ca_pem), "--ca", str(relay.ca_pem),
        "--relay", relay.url(), "--relay-mode", "proxy", "--relay-log", str(tmp_path / "timing.jsonl"),
        "--repeat", "2", "--long-tokens", "500",
    )
    print(findings.render(evidence, result))
    assert len(evidence.ok("relayed tiny")) == 2 and len(evidence.records) == 4
    assert all("tunnel" in p.marks and p.tls_version for p in evidence.ok("relayed tiny"))
    assert not result.failed


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENAI_API_KEY": FAKE_OPENAI_KEY}
    return subprocess.run([sys.executable, "-m", "ttft_relay", "diagnose", *argv],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


def test_dead_upstream_gives_a_verdict_and_exit_2_not_a_hang(start_relay, tmp_path):
    dead = f"http://127.0.0.1:{closed_port()}"
    relay = start_relay(f"reverse:{dead}@0")
    started = time.monotonic()
    done = run_cli("--upstream", dead, "--relay", relay.url(), "--relay-log", str(tmp_path / "timing.jsonl"),
                   "--timeout", "10")
    print(done.stdout, done.stderr)
    assert done.returncode == 2
    assert "verdict: upstream unreachable" in done.stdout
    assert "direct: Connection refused (in tcp) 1/1; via relay: " in done.stdout
    assert time.monotonic() - started < 30  # a failed warm-up ends its path's probing


def test_a_stream_that_stops_for_seconds_stands_out(fake):
    # "nothing stands out" for a 3 s mid-stream stall, before.
    fake.behaviour.midstream_pause_ms = 1500
    evidence, result = run_diagnosis("--upstream", fake.base_url, "--repeat", "2", "--long-tokens", "200")
    print(findings.render(evidence, result))
    assert all(p.stall_ms >= 1500 * 0.9 for p in evidence.ok("direct tiny"))
    assert result.verdict.cause == findings.MID_STREAM_STALL and result.verdict.significant


def test_silent_upstream_times_out_in_the_wait(fake):
    fake.behaviour.head_delay_ms = 10_000
    evidence, result = run_diagnosis("--upstream", fake.base_url, "--timeout", "0.5", "--repeat", "2")
    (timed_out,) = evidence.probes  # the warm-up, and no more
    assert (timed_out.error, timed_out.error_phase) == ("timed out after 0.5 s", "wait")
    assert result.verdict.cause == findings.UPSTREAM_UNREACHABLE


def test_the_key_never_appears_in_the_output(shared_relay, fake):
    leak = orjson.dumps({"error": {"message": f"Incorrect API key provided: {FAKE_OPENAI_KEY}", "type": "auth"}})
    fake.behaviour.status, fake.behaviour.error_body = 401, leak.decode()
    relay = shared_relay(reverse_to(fake))
    for fmt in ([], ["--json"]):
        done = run_cli("--upstream", fake.base_url, "--relay", relay.url(), "--repeat", "1", "-v", *fmt)
        assert done.returncode == 2
        assert "Incorrect API key provided: [redacted]" in done.stdout + done.stderr
        assert FAKE_OPENAI_KEY not in done.stdout + done.stderr
    assert all(r.header("authorization") == f"Bearer {FAKE_OPENAI_KEY}" for r in fake.received)  # it was sent
    report = orjson.loads(done.stdout)
    assert report["verdict"]["cause"] == findings.UPSTREAM_ERRORS


# --- waterfalls and the WebSocket transport -------------------------------------------------


def test_httpstat_waterfall_puts_each_running_total_under_its_column_end():
    lines = findings.httpstat([("dns", 5.0), ("tcp", 10.0), ("wait", 100.0), ("head_to_first_token", 50.0)])
    assert lines[0].split() == ["DNS", "Lookup", "TCP", "Connection", "Server", "Wait", "First", "Token"]
    assert lines[1].startswith("[") and lines[1].endswith("]") and lines[1].count("|") == 3
    assert [c.strip() for c in lines[1][1:-1].split("|")] == ["5 ms", "10 ms", "100 ms", "50 ms"]
    bars = [i for i, c in enumerate(lines[1]) if c in "|]"]
    totals = lines[3:]
    assert [t.strip().split("|")[0].strip() for t in totals] == [
        "namelookup:5 ms", "connect:15 ms", "starttransfer:115 ms", "first token:165 ms"]
    for line, bar in zip(totals, bars):  # each total ends at its column's separator
        assert line.rstrip("| ").endswith(" ms") and len(line.split("|")[0].rstrip()) == bar + 1
    ws = findings.httpstat([("send", 1.0), ("wait", 40.0)], websocket=True)
    assert "Upgrade Sent" in ws[0] and "Wait for 101" in ws[0] and "upgraded:41 ms" in ws[-1]


def test_the_text_report_draws_every_kind_on_one_axis():
    probes = [probe_result("direct", "tiny", 100 + i) for i in range(3)] + [
        probe_result("relayed", "tiny", 400 + i) for i in range(3)]
    text = findings.render(findings.Evidence(probes), findings.diagnose(findings.Evidence(probes)))
    assert "direct tiny: median of 3 probes" in text and "starttransfer:" in text
    direct, relayed = (line for line in text.splitlines() if line.startswith(("  direct tiny ", "  relayed tiny ")))
    assert relayed.count("w") > 3 * direct.count("w") and relayed.endswith("| 401 ms")


def ws_probe(path: str, handshake_ms: float, ttft: float = 500.0, **kw) -> ProbeResult:
    marks = {"dns": 0.1, "tcp": 0.5, "sent": 1.0, "head": 1.0 + handshake_ms, "message": 1.2 + handshake_ms,
             "first_token": ttft, "end": ttft + 5}
    return ProbeResult(path, "tiny", f"{path}-{handshake_ms}", 2, 8, marks, 101, transport="websocket", **kw)


def test_a_slow_websocket_handshake_is_its_own_finding_beside_the_direct_one():
    probes = [ws_probe("direct", 40.0 + i) for i in range(3)] + [ws_probe("relayed", 700.0 + i, ttft=1200.0) for i in range(3)]
    f = finding(findings.diagnose(findings.Evidence(probes)), findings.WEBSOCKET_HANDSHAKE)
    assert f.significant and f.ms == pytest.approx(701) and f.numbers["direct_ms"] == pytest.approx(41)
    assert "(direct: 41 ms)" in f.detail
    assert probes[3].wait_ms == pytest.approx(1200.0 - 701.2)  # a turn's wait starts at its message
    fast = [ws_probe("direct", 40.0)]
    assert not finding(findings.diagnose(findings.Evidence(fast)), findings.WEBSOCKET_HANDSHAKE).significant


def test_websockets_failing_past_the_connect_are_the_verdict_and_refused_connects_are_not():
    broken = [ProbeResult("relayed", "tiny", f"b{i}", 2, 8, {"dns": 0.1, "tcp": 0.4, "sent": 0.5, "head": 2.0,
                                                             "end": 14.0}, 101, transport="websocket",
                          error="WebSocket protocol error: Reserved bit set unexpectedly", error_phase="first_token")
              for i in range(2)]
    ok_direct = [ws_probe("direct", 40.0)]
    result = findings.diagnose(findings.Evidence(ok_direct + broken))
    assert result.failed and result.verdict.cause == findings.WEBSOCKET_FAILING
    assert "relayed: every WebSocket failed in the handshake or turn, after 14 ms" in result.verdict.detail
    refused = [ProbeResult("relayed", "tiny", "r", 2, 8, {"dns": 0.1, "end": 0.3}, transport="websocket",
                           error="Connection refused", error_phase="tcp")]
    assert findings.diagnose(findings.Evidence(refused)).verdict.cause == findings.RELAY_UNREACHABLE


def test_websocket_probe_sends_one_response_create_per_new_socket(fake):
    fake.behaviour.prefill_ms = 80
    evidence, result = run_diagnosis("--transport", "websocket", "--upstream", fake.base_url, "--repeat", "2",
                                     "--long-tokens", "300")
    assert len(evidence.ok("direct tiny")) == len(evidence.ok("direct long")) == 2 and not result.failed
    sockets = fake.sockets
    assert len(sockets) == 5  # the warm-up and four probes, a socket each
    for s in sockets:
        assert s.status == 101 and s.extensions and "permessage-deflate" in s.extensions
        (create,) = s.response_creates
        assert create["model"] and "stream" not in create and create["max_output_tokens"] == 16
        assert s.header("x-request-id").startswith("ttft-diag-") and s.header("authorization")
    for p in evidence.probes:
        assert p.transport == "websocket" and p.marks["sent"] < p.marks["head"] < p.marks["message"]
        assert p.wait_ms >= 80  # the prefill, after the turn was sent
    assert finding(result, findings.WEBSOCKET_HANDSHAKE).ms < p.wait_ms


def test_a_refused_websocket_upgrade_is_the_verdict_with_the_time_it_cost(fake):
    fake.behaviour.status = 426
    done = run_cli("--transport", "websocket", "--upstream", fake.base_url, "--repeat", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "verdict: WebSocket transport failing" in done.stdout
    assert "the WebSocket upgrade was refused: HTTP 426" in done.stdout


def test_a_slow_websocket_handshake_is_named(fake):
    fake.behaviour.head_delay_ms = 400  # the fake holds the 101
    evidence, result = run_diagnosis("--transport", "websocket", "--upstream", fake.base_url, "--repeat", "1",
                                     "--long-tokens", "100")
    f = finding(result, findings.WEBSOCKET_HANDSHAKE)
    # The fake starts holding the 101 when the head arrives, which on a loaded machine can be
    # a little before the probe, back from its write, takes its "sent" mark (seen: 399.7 ms).
    assert f.significant and 0.98 * 400 <= f.ms < 400 + SLACK_MS


def test_websocket_needs_the_responses_api():
    with pytest.raises(SystemExit):
        cli.parse_args(["--transport", "websocket", "--api", "openai.chat"])
    assert cli.parse_args(["--transport", "websocket"]).api == "openai.responses"
    assert cli.parse_args([]).api == "openai.chat"


def test_websocket_through_the_relay_is_joined_with_its_turn_records_and_reported_apart(start_relay, fake, tmp_path):
    fake.behaviour.prefill_ms = 150
    relay = start_relay(reverse_to(fake))
    log = tmp_path / "timing.jsonl"
    evidence, result = run_diagnosis("--transport", "websocket", "--upstream", fake.base_url, "--relay", relay.url(),
                                     "--relay-log", str(log), "--repeat", "2", "--long-tokens", "300")
    assert not result.failed, result.findings
    assert len(evidence.ok("relayed tiny")) == len(evidence.ok("relayed long")) == 2
    joined = [evidence.records[p.request_id] for p in evidence.ok("relayed tiny") + evidence.ok("relayed long")]
    assert all(rec["transport"] == "websocket" and rec["turn"] == 1 for rec in joined)  # the turn, not the handshake
    f = finding(result, findings.WEBSOCKET_HANDSHAKE)
    assert f.numbers["relayed_ms"] is not None and f.numbers["direct_ms"] is not None
    to_relay = finding(result, findings.NETWORK_TO_RELAY)
    assert to_relay.ms < 100  # loopback: the turn's records account for its first token, handshake aside
    sockets = 2 * 4 + 2  # four probes and a warm-up per path; the relayed ones reach the fake through the relay
    assert len(fake.sockets) == sockets
    done = subprocess.run([sys.executable, "-m", "ttft_relay", "report", log], capture_output=True,
                          text=True, check=True, cwd=REPO)
    # Its handshake names no model, so each turn and its handshake fall in different groups.
    assert done.stdout.startswith("WebSocket, all upstreams: 5 turns (0 prewarm), 5 handshakes (0 failed)\n")


def test_a_failed_record_without_a_verdict_is_left_out_of_the_relays_word():
    # Records are read from a log that may not be the relay's: without the guard, joining a None failed.
    gateway = ProbeResult("relayed", "tiny", "r2", 2, 8, {"dns": 0.1, "end": 3.0}, status=502,
                          error="HTTP 502: bad gateway", error_phase="wait")
    result = findings.diagnose(findings.Evidence([gateway], {"r2": {"error": "HTTP 502"}}))
    assert result.verdict.cause == findings.UPSTREAM_UNREACHABLE
    assert "the relay's records say" not in result.verdict.detail


# --- on a real far link (ttft_relay/testing/fakes/link.py) --------------------------------

FAR_ONE_WAY_MS = 150
"""Issue 34's client: 150 ms each way from its relay."""


@pytest.mark.slow
def test_on_a_real_far_link_the_defaults_name_the_link_and_a_long_history_on_a_near_one_the_context(
        far_link, fake_in, confdir, tmp_path):
    from tests.test_far_links_e2e import RELAY_PORT, relay_in

    far = far_link(delay_ms=FAR_ONE_WAY_MS)
    upstream = fake_in(far.far, prefill_ms=150, prefill_ms_per_1k_tokens=100)  # the relay reaches it on far's loopback
    relay = relay_in(far.far, [f"reverse:{upstream}@{RELAY_PORT}"], confdir, tmp_path / "timing.jsonl")
    argv = ("--relay", f"http://{far.far.ip}:{RELAY_PORT}", "--no-direct", "--repeat", "3")  # the run
    with relay:
        with far.near.entered():  # diagnose's sockets cross the link
            evidence, at_far = run_diagnosis(*argv)
            print(findings.render(evidence, at_far))
            evidence, with_records = run_diagnosis(*argv, "--relay-log", str(relay.log.path))
        print(findings.render(evidence, with_records))
        far.set(link.NEAR, delay_ms=1)
        far.set(link.FAR, delay_ms=1)
        with far.near.entered():
            evidence, long_history = run_diagnosis(*argv, "--prompt-tokens", "30000")
        print(findings.render(evidence, long_history))
    # Was `context length (804 ms) — trim history`: the default 8k-token probe's extra wait.
    v = at_far.verdict
    assert v.cause == findings.NETWORK_TO_RELAY  # the tiny probe's connect: one round trip
    assert 2 * FAR_ONE_WAY_MS <= v.ms < 2 * FAR_ONE_WAY_MS + SLACK_MS
    context = finding(at_far, findings.CONTEXT_LENGTH)
    assert not context.weighed and context.numbers["probe_extra_ms"] > v.ms  # larger, and still not the verdict
    # The relay's records split the long body's upload over the link (slow start) from the upstream's prefill.
    assert with_records.verdict.cause == findings.NETWORK_TO_RELAY
    context = finding(with_records, findings.CONTEXT_LENGTH)
    assert context.numbers["ms_per_1k_tokens"] == pytest.approx(100, rel=0.15)
    assert context.numbers["link_extra_ms"] >= 2 * FAR_ONE_WAY_MS
    v = long_history.verdict
    assert v.cause == findings.CONTEXT_LENGTH
    assert v.ms == pytest.approx(100 * 30, rel=0.25)  # 100 ms per 1k tokens (the fake's are bytes / 4), at 30k
