"""The real coding-agent CLIs through an upstream group of two fakes whose first member fails:
Claude Code (Messages, SSE) and Codex CLI (Responses, SSE and WebSocket) complete their turn as
direct, the failover unseen, and each record names the member that served and what failed.

The group is the listener's own upstream (127.0.0.1, first in the group's order while nothing is
learned) and `b`; the first refuses connections (nothing listens on its port) or answers 503.
With hedging (`relay_upstream_hedge`), the first member's head late: the CLI's turn is answered
by the hedge at b, once, and a's attempt is closed before a byte of it reaches the CLI.

The CLIs, their sandbox and the fake's view of a run are tests/test_agents_e2e.py's.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from tests.conftest import reverse_to
from tests.test_agents_e2e import (
    GAP_MS,
    PREFILL_MS,
    agent_behaviour,
    assert_claude_turn_once,
    assert_codex_turn_once,
    run_claude,
    run_codex,
)
from tests.test_groups_e2e import refused_port
from ttft_relay.testing.fakes import Behaviour, FakeUpstream, client
from ttft_relay.testing.fakes.replies import THINKING_PIECES

FIRST_FAILS = {"refused": ("connection", None), "503": ("5xx", "503")}
"""How the first member fails: the failover's `cause`, and its `error` where it is exact (a refused
connect's text is the OS's)."""


@pytest.fixture(params=list(FIRST_FAILS))
def failing(request) -> Iterator[tuple[str, FakeUpstream | None]]:
    """(how the first member fails, its fake: None when nothing listens on its port)."""
    if request.param == "refused":
        yield request.param, None
    else:
        with FakeUpstream(behaviour=Behaviour(status=503)) as upstream:
            yield request.param, upstream


@pytest.fixture
def group(failing, start_relay):
    """A relay whose reverse listener's group is the failing member, then `b` (a working fake)."""
    how, first = failing
    with FakeUpstream(behaviour=agent_behaviour()) as b:
        first_url = first.base_url if first is not None else f"http://127.0.0.1:{refused_port()}"
        relay = start_relay(f"reverse:{first_url}@0", relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}")
        yield relay, how, first, b


def assert_failed_over_to_b(rec: dict, how: str, b: FakeUpstream) -> None:
    """One record served by `b` after the first member failed, as the client saw it: a whole answer."""
    cause, error = FIRST_FAILS[how]
    assert rec["status"] == 200 and rec["error"] is None, rec
    assert rec["upstream"] == f"127.0.0.1:{b.port}" and rec["route"]["upstream"] == "b", rec
    assert rec["route"]["why"] == "nothing learned yet: the group's order", rec["route"]
    (failed,) = rec["route"]["failed_over"]
    assert failed["upstream"] == "127.0.0.1" and failed["cause"] == cause, failed
    assert failed["error"] == error if error else "onnect" in failed["error"], failed
    assert rec["verdict"] == "upstream failed over", rec


def first_member_saw(first: FakeUpstream | None) -> int:
    return 0 if first is None else len(first.received)


def test_claude_completes_its_turn_once_through_a_failover(clis, refusing, group, tmp_path) -> None:
    relay, how, first, b = group
    seen = run_claude(clis, b, tmp_path, refusing.url, relay.url(), {})
    assert_claude_turn_once(seen)  # one streamed POST at b, the answer printed whole
    assert first_member_saw(first) == (0 if first is None else 1)
    (rec,) = relay.log.wait(1)
    assert rec["api"] == "anthropic.messages" and rec["stream"] is True, rec
    assert rec["usage"]["output_tokens"] == len(THINKING_PIECES) + 5
    assert_failed_over_to_b(rec, how, b)


def test_codex_sse_completes_its_turn_once_through_a_failover(clis, refusing, group, tmp_path) -> None:
    relay, how, first, b = group
    seen = run_codex(clis, b, tmp_path, refusing.url, f"{relay.url()}/v1", websockets=False, env={})
    assert_codex_turn_once(seen, websockets=False)
    assert first_member_saw(first) == (0 if first is None else 1)
    (rec,) = relay.log.wait(1)
    assert (rec["api"], rec["transport"]) == ("openai.responses", "http"), rec
    assert rec["usage"]["output_tokens"] == 5
    assert_failed_over_to_b(rec, how, b)


def test_codex_websocket_handshake_fails_over_and_its_turns_stay_on_b(clis, refusing, group, tmp_path) -> None:
    """The upgrade fails over as a request does; the socket's turns then go where it is (b)."""
    relay, how, first, b = group
    seen = run_codex(clis, b, tmp_path, refusing.url, f"{relay.url()}/v1", websockets=True, env={})
    assert_codex_turn_once(seen, websockets=True)  # one socket at b, prewarm and turn, no fallback to HTTP
    assert first_member_saw(first) == (0 if first is None else 1)
    records = sorted(relay.log.wait(3), key=lambda r: r["turn"])
    assert [(r["transport"], r["turn"], r["prewarm"]) for r in records] == [
        ("websocket", 0, False), ("websocket", 1, True), ("websocket", 2, False)], records
    handshake, prewarm, turn = records
    cause, _ = FIRST_FAILS[how]
    assert handshake["status"] == 101 and handshake["error"] is None, handshake
    assert handshake["route"]["upstream"] == "b", handshake["route"]
    assert [(f["upstream"], f["cause"]) for f in handshake["route"]["failed_over"]] == [("127.0.0.1", cause)]
    for rec in (prewarm, turn):
        assert rec["error"] is None and rec["upstream"] == f"127.0.0.1:{b.port}", rec
    assert turn["usage"]["output_tokens"] == 5


# --- hedging ---------------------------------------------------------------------------------

LATE = Behaviour(prefill_ms=PREFILL_MS, gap_ms=GAP_MS, head_delay_ms=30_000)
SLOWER = Behaviour(prefill_ms=PREFILL_MS + 125, gap_ms=GAP_MS)
"""b while the lines are learned: slower than a, so that the CLI's turn goes to a, yet
expected before a's late head's bound (a's expected first token and its line's tolerance, at
least `prefill.QUEUE_MIN_MS`), so that a's late head is hedged to b (`choice.sooner_elsewhere`): 125 ms
is about half that tolerance, a margin each way."""


@pytest.fixture
def hedging(start_relay):
    """A relay hedging every late head (`relay_upstream_hedge`, budget 100 %) over a (the
    listener's own upstream) and b, both fakes the CLIs expect."""
    with FakeUpstream(behaviour=agent_behaviour()) as a, FakeUpstream(behaviour=SLOWER) as b:
        relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                            relay_upstream_explore=100, relay_upstream_hedge=True, relay_upstream_hedge_budget=100)
        yield relay, a, b


def learn_both(relay, a: FakeUpstream, b: FakeUpstream, run_cli) -> int:
    """One run of the CLI, then its request sent again (as other conversations) until both
    members' first-token lines predict at this prompt's size (a's first, then b's while it
    explores); then a is late and b as the CLI expects. The records so far."""
    run_cli()
    post = next(r for r in reversed(a.received) if r.method == "POST")
    headers = {name: value for name, value in post.headers
               if name.lower() not in ("host", "content-length", "connection", "accept-encoding")}
    body = orjson.loads(post.body)
    for n in range(1, 30):  # each a conversation of its own (none sticks to where its cache is)
        own = {"prompt_cache_key": f"learn {n}"} if "input" in body else {"metadata": {"user_id": f"learn {n}"}}
        conn, response = client.request("POST", relay.url() + post.path, {**body, **own}, headers)
        with conn:
            assert response.status == 200
            response.read()
        if None not in relay.log.wait(n + 1)[-1]["route"]["expected_ms"].values():
            break  # both predicted when it was sent
    else:
        raise AssertionError(f"the lines did not learn: {len(a.received)} requests at a, {len(b.received)} at b")
    a.behaviour, b.behaviour = LATE, agent_behaviour()
    return n + 1


def assert_hedged_to_b(rec: dict, a: FakeUpstream, b: FakeUpstream) -> None:
    """The CLI's record: a's head late, the hedge at b answered, a's attempt closed unanswered."""
    assert rec["status"] == 200 and rec["error"] is None, rec
    route = rec["route"]
    assert route["upstream"] == "b" and rec["upstream"] == f"127.0.0.1:{b.port}", route
    assert (route["hedged"]["from"], route["hedged"]["won"]) == ("127.0.0.1", "b"), route
    assert rec["verdict"] == "upstream hedged" and rec["ttft_ms"] < LATE.head_delay_ms, rec
    assert a.wait_finished(len(a.received)) and a.sent[-1].outcome == "client_closed" and a.sent[-1].status is None


def test_claude_completes_its_turn_once_through_a_hedge(clis, refusing, hedging, tmp_path) -> None:
    relay, a, b = hedging
    learned = learn_both(relay, a, b, lambda: run_claude(clis, a, tmp_path / "learn", refusing.url, relay.url(), {}))
    at_a = len(a.received)
    seen = run_claude(clis, b, tmp_path / "hedged", refusing.url, relay.url(), {})
    assert_claude_turn_once(seen)  # one streamed POST at b, the answer printed whole, once
    assert len(a.received) == at_a + 1
    rec = relay.log.wait(learned + 1)[-1]
    assert rec["api"] == "anthropic.messages" and rec["usage"]["output_tokens"] == len(THINKING_PIECES) + 5
    assert_hedged_to_b(rec, a, b)


def test_codex_sse_completes_its_turn_once_through_a_hedge(clis, refusing, hedging, tmp_path) -> None:
    relay, a, b = hedging
    learned = learn_both(relay, a, b, lambda: run_codex(clis, a, tmp_path / "learn", refusing.url,
                                                        f"{relay.url()}/v1", websockets=False, env={}))
    at_a = len(a.received)
    seen = run_codex(clis, b, tmp_path / "hedged", refusing.url, f"{relay.url()}/v1", websockets=False, env={})
    assert_codex_turn_once(seen, websockets=False)
    assert len(a.received) == at_a + 1
    rec = relay.log.wait(learned + 1)[-1]
    assert (rec["api"], rec["transport"]) == ("openai.responses", "http") and rec["usage"]["output_tokens"] == 5
    assert_hedged_to_b(rec, a, b)
