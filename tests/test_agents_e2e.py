"""The real coding-agent CLIs through a real relay: Codex CLI (`codex exec`) and Claude Code (`claude -p`).

Each case runs the CLI twice against the same fake upstream in the same test: once
direct, once through a real `mitmdump -s ttft_relay/relay.py`, in reverse mode (base URL
at the relay) or HTTPS-proxy mode (HTTPS_PROXY at the relay, mitmproxy's CA trusted).
Codex talks the Responses API over a WebSocket (`supports_websockets = true`) or
over HTTP SSE; Claude Code the Anthropic Messages API with thinking and tools.

What is checked: the turn completes with the fake's text printed; nothing is
re-sent (the fake sees each `response.create` exactly once, on exactly one
WebSocket, and no HTTP fallback); the time from the fake writing the first token
to the CLI printing the answer through the relay is within `ADDED_LATENCY_S` of
the direct run's (never an absolute time); each turn has one correct record. And
what each client does with the relay's errors (a first-token timeout, an upstream
cut mid-stream); docs/agents.md reports it.

The CLIs are installed from npm on first use (`tests/agent_clis.py`); without npm
or a reachable registry the module skips. Outside hosts the CLIs call (Codex asks for
github.com and chatgpt.com) get a 403 from a `RefusingProxy`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from ttft_relay.workers import free_port
from ttft_relay.testing import sse_samples
from tests.agent_clis import (
    AgentSandbox,
    CliRun,
    Clis,
    claude_first_text,
    claude_print,
    claude_result,
    codex_answer,
    codex_exec,
)
from ttft_relay.testing.fakes import Behaviour, FakeUpstream, Received, Sent, SocketSession
from ttft_relay.testing.fakes.client import request
from ttft_relay.testing.fakes.replies import THINKING_PIECES, answer_pieces, answer_text
from ttft_relay.testing.harness import MitmdumpProcess, read_records

PREFILL_MS = 200
"""The fake's time to the first token: big enough that a record's first token is told from its
handshake, small enough to keep the module quick."""
GAP_MS = 40
"""Between events: a relay that buffered a stream would show the sum of them."""
ADDED_LATENCY_S = 0.25
"""How much later than direct the CLI may print through the relay. The relay's own cost is about
a millisecond; what this catches costs seconds (reconnects, a fallback to HTTP) or the whole
stream (buffering)."""
FIRST_TOKEN_TIMEOUT_S = 1
"""The relay's `relay_first_token_timeout` in the error cases."""
RECORD_WAIT_S = 10.0
PROMPT = "Say hello."


# --- fixtures: one fake pair, one refusing proxy, one relay per module -----------------------------


def agent_behaviour() -> Behaviour:
    return Behaviour(prefill_ms=PREFILL_MS, gap_ms=GAP_MS)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    with FakeUpstream(behaviour=agent_behaviour()) as upstream:
        yield upstream


@pytest.fixture(scope="module")
def fake_tls(certs) -> Iterator[FakeUpstream]:
    """Behind the relay's HTTPS-proxy listener: a TLS upstream at https://localhost:PORT."""
    with FakeUpstream(tls=True, certs=certs, behaviour=agent_behaviour()) as upstream:
        yield upstream


@dataclass
class Relay:
    proc: MitmdumpProcess
    log: Path

    @property
    def reverse_url(self) -> str:
        return self.proc.url(0)

    @property
    def proxy_url(self) -> str:
        return self.proc.url(1)

    def records_between(self, start: float, end: float) -> list[dict]:
        return [r for r in read_records(self.log) if start <= r["ts"] <= end]

    def wait_records(self, start: float, end: float, count: int, api: str) -> list[dict]:
        """The records of `api` requests that began in [start, end], once at least `count` are written
        (in HTTPS-proxy mode the CLIs' calls home are recorded too)."""
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            found = [r for r in self.records_between(start, end) if r["api"] == api]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)  # records are written off the relay's event loop within moments


def start_relay(fake: FakeUpstream, confdir: Path, certs, log: Path, **options: object) -> MitmdumpProcess:
    """A relay with a reverse listener to `fake` and an HTTPS-proxy listener (ports 0 and 1)."""
    opts = {"ssl_verify_upstream_trusted_ca": certs.ca_pem, "relay_timing_log": log, "relay_metrics_listen": "",
            **options}
    modes = [f"reverse:{fake.base_url}@{free_port()}", f"regular@{free_port()}"]  # two listeners: two ports
    return MitmdumpProcess(modes, confdir, options=opts).start()


@pytest.fixture(scope="module")
def relay(fake, confdir, certs, tmp_path_factory) -> Iterator[Relay]:
    log = tmp_path_factory.mktemp("relay") / "timing.jsonl"
    proc = start_relay(fake, confdir, certs, log)
    yield Relay(proc, log)
    proc.stop()


@pytest.fixture(scope="module")
def strict_relay(fake, confdir, certs, tmp_path_factory) -> Iterator[Relay]:
    """A relay that gives up on an upstream after FIRST_TOKEN_TIMEOUT_S without a token."""
    log = tmp_path_factory.mktemp("strict-relay") / "timing.jsonl"
    proc = start_relay(fake, confdir, certs, log, relay_first_token_timeout=FIRST_TOKEN_TIMEOUT_S)
    yield Relay(proc, log)
    proc.stop()


# --- what the fake saw during one CLI run ---------------------------------------------------------


@dataclass
class Seen:
    """One CLI run and what the fake received and answered meanwhile."""

    run: CliRun
    received: list[Received]
    sent: list[Sent]
    sockets: list[SocketSession]

    @property
    def posts(self) -> list[Received]:
        return [r for r in self.received if r.method == "POST"]

    @property
    def response_creates(self) -> list[dict]:
        return [m for s in self.sockets for m in s.response_creates]

    def first_token_at(self) -> float:
        """When the fake wrote the first token of the answer (on the socket or request that delivered it)."""
        ws_turns = [t.first_token_at for s in self.sockets for t in s.turns if not t.prewarm and t.first_token_at]
        http = [s.first_token_at for s in self.sent if s.first_token_at is not None]
        return max(ws_turns + http)

    def first_request_at(self) -> float:
        """When the fake read the turn's first request (a generating response.create or a POST): a retry
        or a fallback counts from the first attempt."""
        ws_turns = [t.at for s in self.sockets for t in s.turns if not t.prewarm]
        return min(ws_turns + [r.at for r in self.posts])


def observe(fake: FakeUpstream, run_cli) -> Seen:
    before_received, before_sockets = len(fake.received), len(fake.sockets)
    run = run_cli()
    assert fake.wait_finished(len(fake.received)), "the fake still answers a request after the CLI exited"
    return Seen(run, fake.received[before_received:], fake.sent[before_received:], fake.sockets[before_sockets:])


# --- Codex CLI ---------------------------------------------------------------------------------


@dataclass
class CodexPair:
    """The same codex turn direct and through the relay."""

    mode: str
    websockets: bool
    direct: Seen
    relayed: Seen
    relay: Relay


def run_codex(clis: Clis, fake: FakeUpstream, root: Path, proxy_url: str, base_url: str, *, websockets: bool,
              env: dict[str, str], headers: dict[str, str] | None = None, **provider: object) -> Seen:
    sandbox = AgentSandbox(root, proxy_url)
    sandbox.write_codex_config(base_url, websockets=websockets, headers=headers, **provider)
    return observe(fake, lambda: codex_exec(clis, sandbox, PROMPT, sandbox.env(**env)))


def codex_through(relay: Relay, fake: FakeUpstream, fake_tls: FakeUpstream, mode: str, ca_pem: Path) -> dict:
    """Where codex goes for `mode`: its fake, the direct and relayed base URL and environment."""
    if mode == "reverse":
        return {"fake": fake, "direct": (f"{fake.base_url}/v1", {}), "relayed": (f"{relay.reverse_url}/v1", {})}
    tls_url = f"https://localhost:{fake_tls.port}/v1"
    return {
        "fake": fake_tls,
        "direct": (tls_url, {"CODEX_CA_CERTIFICATE": str(ca_pem)}),
        # HTTPS_PROXY at the relay for every host, localhost included; codex trusts mitmproxy's CA
        "relayed": (tls_url, {"CODEX_CA_CERTIFICATE": str(relay.proc.ca_pem), "proxy": relay.proxy_url, "no_proxy": ""}),
    }


@pytest.fixture(scope="module", params=[
    pytest.param(("reverse", True), id="reverse-websocket"),
    pytest.param(("reverse", False), id="reverse-sse"),
    pytest.param(("proxy", True), id="proxy-websocket"),
    pytest.param(("proxy", False), id="proxy-sse"),
])
def codex_pair(request, clis, refusing, fake, fake_tls, relay, certs, tmp_path_factory) -> CodexPair:
    mode, websockets = request.param
    where = codex_through(relay, fake, fake_tls, mode, certs.ca_pem)
    runs = {}
    for path in ("direct", "relayed"):
        base_url, env = where[path]
        root = tmp_path_factory.mktemp(f"codex-{request.param_index}-{path}")
        runs[path] = run_codex(clis, where["fake"], root, refusing.url, base_url, websockets=websockets, env=env)
    return CodexPair(mode, websockets, runs["direct"], runs["relayed"], relay)


def assert_codex_turn_once(seen: Seen, websockets: bool) -> None:
    run = seen.run
    assert run.returncode == 0, run.describe()
    answer = codex_answer(run)
    assert answer is not None and answer[1] == answer_text(5), run.describe()
    assert "Reconnecting" not in run.stdout and "Falling back" not in run.stdout, run.describe()
    if websockets:
        (socket,) = seen.sockets  # one WebSocket for the session: no reconnect
        assert socket.status == 101 and socket.protocol_error is None
        assert socket.extensions and socket.extensions.startswith("permessage-deflate")
        # prewarm, then the turn continuing from it: each response.create exactly once
        assert [t.prewarm for t in socket.turns] == [True, False], socket.messages
        assert socket.turns[1].request.get("previous_response_id") == socket.turns[0].response_id
        assert [t.outcome for t in socket.turns] == ["complete", "complete"]
        assert seen.posts == [], "codex fell back to HTTP"
    else:
        assert seen.sockets == []
        (post,) = seen.posts
        assert post.path == "/v1/responses" and orjson.loads(post.body)["stream"] is True


def test_codex_completes_the_turn_once(codex_pair: CodexPair) -> None:
    assert_codex_turn_once(codex_pair.direct, codex_pair.websockets)  # the fake is what codex expects
    assert_codex_turn_once(codex_pair.relayed, codex_pair.websockets)


def assert_prints_as_soon(direct: Seen, relayed: Seen, printed_at) -> None:
    """From the fake writing the first token, and from the turn's first request, to the CLI printing:
    through the relay within ADDED_LATENCY_S of direct."""
    delays = {}
    for path, seen in (("direct", direct), ("relayed", relayed)):
        printed = printed_at(seen.run)
        assert printed is not None, seen.run.describe()
        delays[path] = {"from first token": printed[0] - seen.first_token_at(),
                        "from first request": printed[0] - seen.first_request_at()}
    for since in delays["direct"]:
        assert delays["relayed"][since] <= delays["direct"][since] + ADDED_LATENCY_S, delays


def test_codex_prints_as_soon_through_the_relay_as_direct(codex_pair: CodexPair) -> None:
    assert_prints_as_soon(codex_pair.direct, codex_pair.relayed, codex_answer)


def assert_first_token_as_the_fake_wrote_it(rec: dict, fake_delay_s: float) -> None:
    """The record's first token (from the request leaving the relay's hooks, trimming included) is the
    time the fake took to write it (from reading the request: prefill and the events before it) within
    10 % or 5 ms, plus however late the relay's own event loop ran meanwhile (its loop_lag_ms: on a
    loaded machine the relay notices an arrival late by that much, and says so)."""
    first_token = rec["marks"]["first_token"] - rec["marks"]["forwarded"]
    allowed = max(0.1 * fake_delay_s * 1000, 5) + (rec["loop_lag_ms"] or 0)
    assert abs(first_token - fake_delay_s * 1000) <= allowed, (rec, fake_delay_s)


def test_codex_turns_have_one_record_each(codex_pair: CodexPair) -> None:
    run = codex_pair.relayed.run
    expected = 3 if codex_pair.websockets else 1  # handshake, prewarm, turn | one POST
    records = codex_pair.relay.wait_records(run.started_at, run.ended_at, expected, "openai.responses")
    if codex_pair.websockets:
        by_turn = sorted(records, key=lambda r: r["turn"])
        assert [(r["transport"], r["turn"], r["prewarm"]) for r in by_turn] == [
            ("websocket", 0, False), ("websocket", 1, True), ("websocket", 2, False)], records
        handshake, prewarm, turn = by_turn
        assert handshake["status"] == 101 and handshake["error"] is None
        flow_id = handshake["id"].removesuffix("#0")  # the handshake is the flow's own record
        assert [prewarm["id"], turn["id"]] == [f"{flow_id}#1", f"{flow_id}#2"]
        assert prewarm["marks"].get("first_token") is None and prewarm["error"] is None
        fake_turn = codex_pair.relayed.sockets[0].turns[1]
        fake_delay = fake_turn.first_token_at - fake_turn.at
    else:
        (turn,) = records
        assert (turn["transport"], turn["turn"]) == ("http", None)
        (sent,) = codex_pair.relayed.sent
        fake_delay = sent.first_token_at - sent.request.at
    assert turn["model"] == "gpt-test" and turn["error"] is None, orjson.dumps(records).decode()
    assert turn["usage"]["output_tokens"] == 5
    assert_first_token_as_the_fake_wrote_it(turn, fake_delay)


# --- Claude Code ---------------------------------------------------------------------------------


@dataclass
class ClaudePair:
    mode: str
    direct: Seen
    relayed: Seen
    relay: Relay


def run_claude(clis: Clis, fake: FakeUpstream, root: Path, proxy_url: str, base_url: str, env: dict[str, str]) -> Seen:
    sandbox = AgentSandbox(root, proxy_url)
    return observe(fake, lambda: claude_print(clis, sandbox, PROMPT, sandbox.env(ANTHROPIC_BASE_URL=base_url, **env)))


@pytest.fixture(scope="module", params=["reverse", "proxy"])
def claude_pair(request, clis, refusing, fake, fake_tls, relay, certs, tmp_path_factory) -> ClaudePair:
    mode = request.param
    if mode == "reverse":
        target, direct, relayed = fake, (fake.base_url, {}), (relay.reverse_url, {})
    else:
        tls_url = f"https://localhost:{fake_tls.port}"
        target = fake_tls
        direct = (tls_url, {"NODE_EXTRA_CA_CERTS": str(certs.ca_pem)})
        relayed = (tls_url, {"NODE_EXTRA_CA_CERTS": str(relay.proc.ca_pem), "proxy": relay.proxy_url, "no_proxy": ""})
    runs = {}
    for path, (base_url, env) in (("direct", direct), ("relayed", relayed)):
        root = tmp_path_factory.mktemp(f"claude-{mode}-{path}")
        runs[path] = run_claude(clis, target, root, refusing.url, base_url, env)
    return ClaudePair(mode, runs["direct"], runs["relayed"], relay)


def assert_claude_turn_once(seen: Seen) -> None:
    run = seen.run
    assert run.returncode == 0, run.describe()
    result = claude_result(run)
    assert result is not None and result.get("is_error") is False, run.describe()
    assert result["result"] == answer_text(5), run.describe()
    (post,) = seen.posts  # streamed once, not re-sent without streaming
    body = orjson.loads(post.body)
    assert post.path.startswith("/v1/messages") and body["stream"] is True
    assert body["tools"] and body["thinking"]["type"] in ("enabled", "adaptive")
    thinking = [e["event"]["delta"]["thinking"] for _, e in run.events()
                if e.get("type") == "stream_event" and e["event"].get("delta", {}).get("type") == "thinking_delta"]
    assert thinking == list(THINKING_PIECES)


def test_claude_completes_the_turn_once(claude_pair: ClaudePair) -> None:
    assert_claude_turn_once(claude_pair.direct)
    assert_claude_turn_once(claude_pair.relayed)


def test_claude_streams_as_soon_through_the_relay_as_direct(claude_pair: ClaudePair) -> None:
    assert_prints_as_soon(claude_pair.direct, claude_pair.relayed, claude_first_text)


def test_claude_turn_has_one_record(claude_pair: ClaudePair) -> None:
    run = claude_pair.relayed.run
    (rec,) = claude_pair.relay.wait_records(run.started_at, run.ended_at, 1, "anthropic.messages")
    assert rec["status"] == 200 and rec["stream"] is True and rec["error"] is None, rec
    assert (rec["transport"], rec["turn"], rec["prewarm"]) == ("http", None, False)
    assert rec["usage"]["output_tokens"] == len(THINKING_PIECES) + 5  # as the fake's message_delta says
    (sent,) = claude_pair.relayed.sent
    assert_first_token_as_the_fake_wrote_it(rec, sent.first_token_at - sent.request.at)


# --- what the clients do with the relay's errors -----------------------------------------------------
# Observed with the pinned versions; docs/agents.md says the same in words.

BEFORE_FIRST_TOKEN = {"responses": 4, "anthropic": 2}
"""Event index of the first text (Responses: created, in_progress, item added, part added) or thinking
(Anthropic: message_start, block start) delta in the fake's streams: a stall there is a first token
that never comes; a prewarm (3 events) is not held."""
CUT_AFTER = {"responses": 6, "anthropic": 9}
"""A reset of the upstream connection right after the first text deltas: an upstream cut mid-stream."""
CLIENT_RETRIES = 1
"""codex's `stream_max_retries` (default 5) and Claude Code's CLAUDE_CODE_MAX_RETRIES (default 10) in the
error cases: what they do, in less time."""


def codex_error_run(clis, refusing, fake, base_url, root, websockets, knob, value) -> Seen:
    return run_codex(clis, fake, root, refusing.url, base_url, websockets=websockets, env={},
                     headers={f"x-fake-{knob}": str(value)}, stream_max_retries=CLIENT_RETRIES)


def claude_error_run(clis, refusing, fake, base_url, root, knob, value) -> Seen:
    env = {"ANTHROPIC_CUSTOM_HEADERS": f"x-fake-{knob}: {value}", "CLAUDE_CODE_MAX_RETRIES": str(CLIENT_RETRIES)}
    return run_claude(clis, fake, root, refusing.url, base_url, env)


def turn_failed(run: CliRun) -> str | None:
    return next((e["error"]["message"] for _, e in run.events() if e.get("type") == "turn.failed"), None)


def streamed_flags(seen: Seen) -> list[bool]:
    return [orjson.loads(p.body)["stream"] for p in seen.posts]


def test_codex_sse_retries_a_first_token_timeout_then_fails_the_turn(clis, refusing, fake, strict_relay, tmp_path) -> None:
    seen = codex_error_run(clis, refusing, fake, f"{strict_relay.reverse_url}/v1", tmp_path, False,
                           "stall-after-chunks", BEFORE_FIRST_TOKEN["responses"])
    assert seen.run.returncode != 0 and turn_failed(seen.run), seen.run.describe()
    assert len(seen.posts) == 1 + CLIENT_RETRIES, seen.run.describe()
    assert [s.outcome for s in seen.sent] == ["client_closed"] * len(seen.posts)  # the relay let go upstream
    records = strict_relay.wait_records(seen.run.started_at, seen.run.ended_at, len(seen.posts), "openai.responses")
    assert ["first token" in (r["error"] or "") for r in records] == [True] * len(seen.posts), records


def test_claude_answers_a_first_token_timeout_with_a_non_streamed_resend(clis, refusing, fake, strict_relay, tmp_path) -> None:
    """The turn completes, from a second request without streaming: the upstream is paid twice."""
    seen = claude_error_run(clis, refusing, fake, strict_relay.reverse_url, tmp_path,
                            "stall-after-chunks", BEFORE_FIRST_TOKEN["anthropic"])
    assert seen.run.returncode == 0 and claude_result(seen.run)["result"] == answer_text(5), seen.run.describe()
    assert streamed_flags(seen) == [True, False], seen.run.describe()
    records = strict_relay.wait_records(seen.run.started_at, seen.run.ended_at, 2, "anthropic.messages")
    assert ["first token" in (r["error"] or "") for r in records] == [True, False], records


def test_claude_without_its_non_streamed_fallback_reports_the_relays_timeout(
    clis, refusing, fake, strict_relay, tmp_path
) -> None:
    """CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK=1 (docs/agents.md's recipe against paying twice): one streamed
    request, and the turn fails with the relay's message."""
    seen = run_claude(clis, fake, tmp_path, refusing.url, strict_relay.reverse_url, {
        "ANTHROPIC_CUSTOM_HEADERS": f"x-fake-stall-after-chunks: {BEFORE_FIRST_TOKEN['anthropic']}",
        "CLAUDE_CODE_MAX_RETRIES": str(CLIENT_RETRIES), "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1"})
    assert seen.run.returncode == 1, seen.run.describe()
    assert "ttft-relay: first token timeout" in claude_result(seen.run)["result"], seen.run.describe()
    assert streamed_flags(seen) == [True], seen.run.describe()

@pytest.mark.parametrize("websockets", [True, False], ids=["websocket", "sse"])
def test_codex_retries_an_upstream_cut_as_it_would_direct(clis, refusing, fake, relay, tmp_path, websockets) -> None:
    """codex re-sends the turn `stream_max_retries` times, then fails it, through the relay as direct. Over a
    WebSocket (on a new socket each time), the retries exhausted, it falls back to HTTP and retries there too."""
    runs = {path: codex_error_run(clis, refusing, fake, base_url, tmp_path / path, websockets,
                                  "reset-after-chunks", CUT_AFTER["responses"])
            for path, base_url in (("direct", f"{fake.base_url}/v1"), ("relayed", f"{relay.reverse_url}/v1"))}
    for seen in runs.values():
        assert seen.run.returncode != 0 and turn_failed(seen.run), seen.run.describe()
    # (HTTP posts, WebSockets, response.create messages): the same number re-sent either way
    counts = {path: (len(seen.posts), len(seen.sockets), len(seen.response_creates)) for path, seen in runs.items()}
    assert counts["relayed"] == counts["direct"], counts
    # over a WebSocket: prewarm and turn on the first socket, the retry on a second, then HTTP and its retry
    assert counts["direct"] == ((1 + CLIENT_RETRIES, 1 + CLIENT_RETRIES, 2 + CLIENT_RETRIES) if websockets
                                else (1 + CLIENT_RETRIES, 0, 0)), counts


def test_claude_fails_a_cut_turn_through_the_relay_as_direct(clis, refusing, fake, relay, tmp_path) -> None:
    """A stream cut after its first text: Claude Code retries, then fails the turn ("API Error: ... mid-response.
    The response above may be incomplete.", exit 1). Direct it sees the connection drop ("Connection lost");
    through the relay, the relay's `event: error` ("Server error")."""
    runs = {path: claude_error_run(clis, refusing, fake, base_url, tmp_path / path,
                                   "reset-after-chunks", CUT_AFTER["anthropic"])
            for path, base_url in (("direct", fake.base_url), ("relayed", relay.reverse_url))}
    results = {path: (seen.run.returncode, claude_result(seen.run)["result"], streamed_flags(seen))
               for path, seen in runs.items()}
    assert results["direct"][0] == results["relayed"][0] == 1, results
    assert "Connection lost mid-response" in results["direct"][1], results
    assert "Server error mid-response" in results["relayed"][1], results
    assert results["relayed"][2] == results["direct"][2], results


def test_a_client_hanging_up_after_the_terminal_event_had_a_complete_turn(fake, relay) -> None:
    """codex reads a Responses stream up to `response.completed` and closes the connection, not waiting for
    the body's end: the turn is complete, not a client abort (the fake holds the end of the body here)."""
    events = len(sse_samples.responses_stream(answer_pieces(5)))
    start = time.time()
    conn, response = request("POST", f"{relay.reverse_url}/v1/responses", {"model": "gpt-test", "stream": True},
                             {"x-fake-stall-after-chunks": str(events)})
    with conn:
        received = b""
        for chunk in response.chunks():
            received += chunk.data
            if b"response.completed" in received:
                break
    fake.release_stalls()
    (rec,) = relay.wait_records(start, time.time(), 1, "openai.responses")
    assert (rec["error"], rec["client_aborted"]) == (None, False), rec
    assert rec["usage"]["output_tokens"] == 5 and "client aborted" not in rec["verdict"], rec



REFUSAL_RUNS = 4
"""Codex runs against a busy relay: each is a chance for mitmproxy to write the refusal's body late."""


def test_codex_shows_the_upstreams_text_for_a_refused_websocket_through_a_busy_relay(
    clis, refusing, fake, confdir, certs, tmp_path
) -> None:
    """An upstream refuses the upgrade (404, a JSON error). Codex reads the answer once: when a busy
    relay's loop wrote the body after the head, it said "Unknown error" instead of the upstream's text.
    The relay's event loop is kept busy (ttft_relay/testing/fakes/hog.py) so that the two writes fall apart."""
    proc = MitmdumpProcess([f"reverse:{fake.base_url}@0"], confdir,
                           options={"ssl_verify_upstream_trusted_ca": certs.ca_pem, "relay_metrics_listen": "",
                                    "relay_timing_log": tmp_path / "timing.jsonl"},
                           extra_args=["-s", str(Path(__file__).parents[1] / "ttft_relay" / "testing" / "fakes" / "hog.py")],
                           env={"TTFT_HOG_MS": "40", "TTFT_HOG_EVERY_MS": "45"})
    with proc.start():
        shown = []
        for attempt in range(REFUSAL_RUNS):
            seen = run_codex(clis, fake, tmp_path / str(attempt), refusing.url, f"{proc.url()}/v1", websockets=True,
                             env={}, headers={"x-fake-status": "404"}, stream_max_retries=1)
            falling_back = [e["item"]["message"] for _, e in seen.run.events()
                            if e.get("type") == "item.completed" and "Falling back" in e["item"].get("message", "")]
            assert falling_back, seen.run.describe()
            shown.append(falling_back[0])
    assert all("Fake upstream refused the WebSocket (404)" in message for message in shown), shown
