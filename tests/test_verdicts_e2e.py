"""Verdicts a user can trust, through a real mitmdump: healthy requests are `ok`, a long prompt's
wait is `context length` and a queue spike `upstream queueing` (learned from the traffic and kept
across a restart), a repeated prefix read uncached is a `prompt cache miss`, and a request the
client cut and sent again is one attempt group that `ttft-relay report` explains.

The fake's first token takes PREFILL_MS + PER_1K_MS per 1k uncached prompt tokens (0.1 s + 25 ms
per KB at its 4 bytes a token); a queue spike holds its head QUEUE_MS. Verdicts are counted, not
timed: each side must be right for at least 7 of 8 requests.

The tests that judge requests against what their own relay learned from nothing (and the one
whose fake holds cut requests for 30 s) start their own relay; the others share the module's
(`shared_relay` and `shared_fake`, each finding its records by `rid`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ttft_relay import store
from ttft_relay.observe import attempts, verdicts
from ttft_relay.timing import phases
from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.ws_client import WebSocketClient
from ttft_relay.testing.harness import REPO, RelayWorkers, read_records

PREFILL_MS = 100
PER_1K_MS = 100  # per 1k tokens of 4 bytes: 25 ms per KB
QUEUE_MS = 1500
AUTH = {"Authorization": f"Bearer {FAKE_OPENAI_KEY}"}
CHAT = "/v1/chat/completions"
PARALLEL = 4


def body(kb: float, *, tag: str = "", history: int = 1) -> dict:
    """A chat request of about `kb` KB; `history` user turns (a conversation growing turn by turn)."""
    text = "lorem ipsum dolor sit amet " * int(kb * 1024 / 27)
    messages = [{"role": "system", "content": f"You are terse. {tag}"}]
    for i in range(history):
        messages += [{"role": "user", "content": f"turn {i}: {text}"}, {"role": "assistant", "content": f"ok {i}"}]
    return {"model": "gpt-4o-mini", "stream": True, "messages": messages[:-1]}


def post(url: str, payload: dict, rid: str, **knobs: object) -> None:
    headers = AUTH | {"x-request-id": rid, "x-fake-prefill-ms": str(PREFILL_MS),
                      "x-fake-prefill-ms-per-1k-tokens": str(PER_1K_MS)}
    headers |= {f"x-fake-{k.replace('_', '-')}": str(v) for k, v in knobs.items()}
    with HttpConnection(url) as conn:
        response = conn.request("POST", CHAT, payload, headers)
        assert response.status == 200, response.read()[:300]
        response.read()


def send_all(url: str, requests: list[tuple[dict, str, dict]]) -> None:
    with ThreadPoolExecutor(PARALLEL) as pool:
        for done in [pool.submit(post, url, payload, rid, **knobs) for payload, rid, knobs in requests]:
            done.result()


def verdicts_of(relay, rid: str, n: int) -> list[str]:
    return [r["verdict"] for r in relay.log.of(rid, n)]


@pytest.mark.slow
def test_context_length_is_told_from_upstream_queueing_learned_by_workers_and_kept_across_a_restart(
        fake, start_relay, tmp_path):
    # Warm-up through `ttft-relay run --workers 2`: prompts from 0.5 to 56 KB, no spikes. The first
    # ones say they are still learning; both workers append what they learn to one shared file.
    sizes = [0.5, 56, 2, 40, 8, 24, 1, 48, 16, 4, 32, 12]
    workers = RelayWorkers(fake.base_url, 2, tmp_path, {"relay_timing_log": tmp_path / "timing.jsonl",
                                                        "relay_trim": "false"}).start()
    try:
        send_all(workers.url(), [(body(kb), "warm", {}) for kb in sizes])
    finally:
        workers.stop()
    warm = [r for log in tmp_path.glob("timing*.jsonl") for r in read_records(log)]
    assert len(warm) == len(sizes)
    first = min(warm, key=lambda r: r["ts"] + r["phases"]["total"] / 1000)  # the first judged
    # Nothing learned yet: no expectation, and never the provider's fault (a cold worker may truly
    # have held it: relay saturated or starting).
    assert first["expected_ttft_ms"] is None and first["verdict"] not in (
        phases.CONTEXT_LENGTH, phases.UPSTREAM_QUEUEING, phases.PROMPT_CACHE_MISS, phases.UPSTREAM_WAIT), first
    if first["verdict"] == phases.OK:
        assert "learning this upstream · model: " in first["verdict_detail"]
    (learned,) = verdicts.learned_lines(tmp_path / store.FILE_NAME)  # one line
    assert len(learned.value["samples"]) == len(sizes)  # every worker's samples

    # A new relay logging there starts from what the workers learned.
    relay = start_relay(reverse_to(fake), relay_trim="false")
    big = [(body(kb), "big", {}) for kb in (36, 40, 44, 48, 52, 56, 38, 46)]
    small = [(body(kb), "spiked", {"head_delay_ms": QUEUE_MS}) for kb in (0.5, 1, 1.5, 2, 0.5, 1, 1.5, 2)]
    send_all(relay.url(), big + small)
    big_verdicts, spiked_verdicts = verdicts_of(relay, "big", 8), verdicts_of(relay, "spiked", 8)
    assert big_verdicts.count(phases.CONTEXT_LENGTH) >= 7, big_verdicts
    assert spiked_verdicts.count(phases.UPSTREAM_QUEUEING) >= 7, spiked_verdicts
    for rec in relay.log.of("big", 8):
        if rec["verdict"] == phases.CONTEXT_LENGTH:
            # "first token 1.4 s: 13.0k prompt tokens (0 cached) at 98 ms per 1k explain 1280 ms of it (...)"
            assert " prompt tokens (0 cached) at " in rec["verdict_detail"] and " ms per 1k explain " in rec["verdict_detail"]
            assert rec["expected_ttft_ms"] == pytest.approx(rec["ttft_ms"], rel=0.35)
    for rec in relay.log.of("spiked", 8):
        if rec["verdict"] == phases.UPSTREAM_QUEUEING:
            assert "× the " in rec["verdict_detail"] and "this prompt predicts" in rec["verdict_detail"]
            assert rec["ttft_ms"] > 3 * rec["expected_ttft_ms"]

    # `report`, over the workers' logs and the relay's, shows the learned rates per model and the outliers.
    text = subprocess.run([sys.executable, "-m", "ttft_relay", "report", str(tmp_path / "timing*.jsonl")], cwd=REPO,
                          check=True, capture_output=True, text=True).stdout
    assert "first token learned: " in text and "ms per 1k uncached tokens" in text, text
    assert "beyond what their prompt predicts (upstream queueing)" in text, text


@pytest.mark.shared_fake
def test_healthy_requests_are_ok(fake, shared_relay, rid):
    # 20 requests with a 5 ms first token and events 10 ms apart read "stream stall" 19 times before.
    relay = shared_relay(reverse_to(fake), relay_trim="false")
    with HttpConnection(relay.url()) as conn:  # one kept connection: its smoothed RTT is loopback noise
        for n in range(23):  # the first 3 may meet a relay just started (its first flows run late)
            response = conn.request("POST", CHAT, body(0.2), AUTH | {
                "x-request-id": f"{rid}:healthy" if n >= 3 else f"{rid}:started", "x-fake-prefill-ms": "5",
                "x-fake-gap-ms": "10", "x-fake-chunks": "20"})
            response.read()
    relay.log.of(f"{rid}:started", 3)
    records = relay.log.of(f"{rid}:healthy", 20)
    said = [r["verdict"] for r in records]
    # Nothing but ok; a relay the loaded test machine really held up may say so (with its numbers).
    assert set(said) <= {phases.OK, phases.RELAY_SATURATED} and said.count(phases.OK) >= 18, said
    assert all(r["verdict_detail"] for r in records)


@pytest.mark.shared_fake
def test_websocket_handshakes_and_prewarms_are_never_prefill(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), relay_trim="false")
    url = relay.url().replace("http://", "ws://") + "/v1/responses"
    for _ in range(3):
        with WebSocketClient(url, headers=AUTH | {"x-request-id": rid}) as client:
            client.send_text(json.dumps({"type": "response.create", "model": "gpt-5", "generate": False, "input": []}))
            while (msg := client.receive(20)) is not None and json.loads(msg.text)["type"] != "response.completed":
                pass
    records = relay.log.of(rid, 6)
    handshakes = [r for r in records if r["turn"] == 0]
    prewarms = [r for r in records if r["prewarm"]]
    assert len(handshakes) == len(prewarms) == 3
    for rec in handshakes + prewarms:
        # Never prefill or queueing; a quick one (3-15 ms on loopback) ok. A loaded test machine may
        # make one slow for real: then its slow hop is named.
        assert rec["verdict"] not in (phases.UPSTREAM_WAIT, phases.UPSTREAM_QUEUEING, phases.CONTEXT_LENGTH,
                                      phases.RESPONSE_DOWNLOAD), rec
        assert rec["verdict"] == phases.OK or rec["phases"]["total"] >= phases.NOISE_MS, rec
        assert rec["expected_ttft_ms"] is None
    assert sum(rec["verdict"] == phases.OK for rec in handshakes + prewarms) >= 4


def test_a_repeated_prefix_read_uncached_is_a_prompt_cache_miss(fake, start_relay):
    relay = start_relay(reverse_to(fake), relay_trim="false")
    sizes = [0.5, 40, 2, 30, 8, 20, 1, 36, 16, 4]
    send_all(relay.url(), [(body(kb, tag=f"w{i}"), "warm", {}) for i, kb in enumerate(sizes)])
    relay.log.of("warm", len(sizes))
    # A conversation growing by 12 KB a turn: the provider caches it, then misses its prefix.
    post(relay.url(), body(12, tag="conv", history=1), "conv-1")
    prefix = json.dumps(body(12, tag="conv", history=1)).encode()
    post(relay.url(), body(12, tag="conv", history=2), "conv-2", cached_tokens=len(prefix) // 4)
    post(relay.url(), body(12, tag="conv", history=3), "conv-3", cached_tokens=0)
    (second,), (third,) = relay.log.of("conv-2"), relay.log.of("conv-3")
    assert second["usage"]["cached_tokens"] > 0 and second["verdict"] != phases.PROMPT_CACHE_MISS, second
    assert third["verdict"] == phases.PROMPT_CACHE_MISS, third
    assert "read uncached" in third["verdict_detail"] and "earlier, had " in third["verdict_detail"]


def test_a_request_cut_by_the_client_and_sent_again_is_one_attempt_group(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), relay_trim="false")
    payload = body(1)
    for n in (1, 2):  # cut by the client while the upstream has not answered
        cut_while_unanswered(relay.url(), payload, fake, n)
        relay.log.of(f"attempt-{n}")
    post(relay.url(), payload, "attempt-3")
    post(relay.url(), body(1, tag="another"), "unrelated")
    (a1,), (a2,), (a3,), (other,) = (relay.log.of(rid) for rid in ("attempt-1", "attempt-2", "attempt-3", "unrelated"))
    assert a1["client_aborted"] and a1["error_phase"] == "upstream_wait"
    assert [(r["attempt_group"], r["attempt"]) for r in (a1, a2, a3)] == [(a1["id"], 1), (a1["id"], 2), (a1["id"], 3)]
    assert other["attempt_group"] is None and other["attempt"] is None
    assert not (tmp_path / attempts.LEGACY_FILE).exists()  # the groups are in the store, shared by every process
    text = subprocess.run([sys.executable, "-m", "ttft_relay", "report", tmp_path / "timing.jsonl"], cwd=REPO,
                          check=True, capture_output=True, text=True).stdout
    assert "waited " in text and " over 3 attempts" in text, text
    assert "cut by the client after " in text and "while the upstream had not answered" in text, text


@pytest.mark.shared_fake
def test_two_keys_behind_one_address_sending_the_same_request_are_not_one_attempt_group(fake, shared_relay, rid):
    # A team behind one NAT: the same request (a warm-up every client sends alike) from two
    # access keys, the first failed; the second is not its retry. The same key sending it
    # again, in the same session, is.
    relay = shared_relay(reverse_to(fake), relay_trim="false")
    payload = body(1, tag=rid)  # the same request within this test, no other test's

    def send(name: str, key: str, session: str, status: int = 200) -> None:
        headers = {"Authorization": f"Bearer {key}", "x-request-id": f"{rid}:{name}", "session_id": session,
                   "x-fake-status": str(status)}
        with HttpConnection(relay.url()) as conn:
            response = conn.request("POST", CHAT, payload, headers)
            assert response.status == status
            response.read()

    send("first", FAKE_OPENAI_KEY, "s1", 500)
    send("other-key", FAKE_OPENAI_KEY.replace("FAKEKEY", "OTHERKEY"), "s1")
    send("other-session", FAKE_OPENAI_KEY, "s2")
    send("retry", FAKE_OPENAI_KEY, "s1")
    first, other_key, other_session, retry = (relay.log.of(f"{rid}:{name}")[0] for name in
                                              ("first", "other-key", "other-session", "retry"))
    assert (first["attempt_group"], first["attempt"]) == (first["id"], 1)
    assert other_key["attempt"] is None and other_session["attempt"] is None
    assert (retry["attempt_group"], retry["attempt"]) == (first["id"], 2)


def cut_while_unanswered(url: str, payload: dict, fake, n: int) -> None:
    """Send `payload` through the relay to a fake that holds its head, and hang up once the fake has it."""
    port = int(url.rsplit(":", 1)[1])
    data = json.dumps(payload).encode()  # as HttpConnection sends it: the same request, byte for byte
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"x-request-id: attempt-{n}\r\nx-fake-head-delay-ms: 30000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + data)
        assert fake.wait_received(n)
