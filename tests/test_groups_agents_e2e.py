"""The real coding-agent CLIs through an upstream group of two fakes whose first member fails:
Claude Code (Messages, SSE) and Codex CLI (Responses, SSE and WebSocket) complete their turn as
direct, the failover unseen, and each record names the member that served and what failed.

The group is the listener's own upstream (127.0.0.1, first in the group's order while nothing is
learned) and `b`; the first refuses connections (nothing listens on its port) or answers 503.
The CLIs, their sandbox and the fake's view of a run are tests/test_agents_e2e.py's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_agents_e2e import (
    agent_behaviour,
    assert_claude_turn_once,
    assert_codex_turn_once,
    run_claude,
    run_codex,
)
from tests.test_groups_e2e import refused_port
from ttft_relay.testing.fakes import Behaviour, FakeUpstream
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
