"""Hedging before the head (`relay_upstream_hedge`) through a real mitmdump and two fake upstreams:
a request whose chosen member has no head by its bound goes to the next member as well, the
first head wins, the other attempt's connection is closed before the client sees a byte of it,
within the budget, and never a request the operator marked unsafe to repeat."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator

import httpx2
import pytest

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from tests.test_groups_e2e import PATH, body, send
from ttft_relay.route import late_heads
from ttft_relay.testing.fakes import client
from ttft_relay.testing.fakes.replies import answer_text
from ttft_relay.testing.fakes.upstream import Behaviour, FakeUpstream
from ttft_relay.testing.harness import metrics_url, scrape, total

A_CHUNKS, B_CHUNKS = 5, 3
"""Each fake's answer in its own number of pieces: which one the client read."""
FROM_A, FROM_B = answer_text(A_CHUNKS), answer_text(B_CHUNKS)
LATE_MS = 10_000
A_PREFILL_MS, B_PREFILL_MS = 20, 120
"""a is chosen (the quicker); b's expected first token is well within a's bound (at least
`groups.SLOW_HEAD_MIN_MS`): a late head of a is hedged to b, expected sooner than waiting."""


@pytest.fixture
def learned(start_relay) -> Iterator:
    """`learned(rid, b_prefill_ms=B_PREFILL_MS, **options)`: a relay with a group of two fakes,
    a (the listener's own, the quicker) and b, hedging (every request, unless the options say
    otherwise), that has learned both (three requests each): (relay, a, b)."""
    with FakeUpstream(behaviour=Behaviour(prefill_ms=A_PREFILL_MS, chunks=A_CHUNKS)) as a, \
            FakeUpstream() as b:
        def start(rid: str, b_prefill_ms: int = B_PREFILL_MS, **options: object):
            b.behaviour = Behaviour(prefill_ms=b_prefill_ms, chunks=B_CHUNKS)
            options = {"relay_upstream_hedge": True, "relay_upstream_hedge_budget": 100, **options}
            relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                                relay_upstream_explore=100, relay_metrics_listen="127.0.0.1:0", **options)
            for n in range(6):  # three to a (nothing learned), three exploring b: both predict
                send(relay, f"{rid}-{n}", body(f"single {n}"))
            assert len(a.received) == 3 and len(b.received) == 3
            return relay, a, b

        yield start


def pieces(relay, rid: str, payload: dict) -> tuple[str, dict]:
    """One streamed request read whole (one `[DONE]`): the answer's text, its record."""
    conn, response = client.request("POST", relay.url() + PATH, payload,
                                    {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": rid})
    with conn:
        assert response.status == 200
        data = response.read()
    assert data.count(b"[DONE]") == 1, data
    (rec,) = relay.log.of(rid)
    deltas = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: {")]
    return "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d.get("choices")), rec


@pytest.mark.parametrize("pool", [False, True], ids=["own connections", "pooled"])
def test_the_hedge_answers_when_the_chosen_member_has_no_head_and_the_late_one_is_closed(learned, rid, pool):
    relay, a, b = learned(rid, relay_upstream_pool=pool)
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=LATE_MS, chunks=A_CHUNKS)  # a's queue, from now on
    answered, rec = pieces(relay, f"{rid}-late", body("single 6"))
    assert answered == FROM_B  # b's answer, and only it
    route = rec["route"]
    assert route["upstream"] == "b" and rec["status"] == 200 and rec["error"] is None
    hedged = route["hedged"]
    assert (hedged["from"], hedged["upstream"], hedged["won"]) == ("127.0.0.1", "b", "b"), hedged
    assert "failed_over" not in route
    assert rec["ttft_ms"] < LATE_MS and hedged["after_ms"] < rec["ttft_ms"]
    assert rec["verdict"] == "upstream hedged", rec
    assert rec["verdict_detail"].startswith("hedged: 127.0.0.1 had no head after ") and ", b answered in " in \
        rec["verdict_detail"], rec["verdict_detail"]
    # Both got the request; a's attempt was closed (the fake saw its client go), not waited for.
    assert len(a.received) == 4 and len(b.received) == 4
    assert a.wait_finished(4, timeout=5) and a.sent[-1].outcome == "client_closed", a.sent[-1]
    assert a.sent[-1].status is None  # nothing of its answer was sent
    # The conversation's prefix is cached where the hedge answered: its next turn goes there.
    route = send(relay, f"{rid}-next", body("single 6", "more"))["route"]
    assert route["upstream"] == "b" and route["why"] == "lowest expected first token (this conversation's cache is there)"
    samples = scrape(metrics_url(relay))
    hedges = {"group": "127.0.0.1", "from_member": "127.0.0.1"}
    assert total(samples, "ttft_relay_upstream_hedges_total", **hedges, won="second") == 1
    assert total(samples, "ttft_relay_upstream_duplicated_prompt_tokens_total", **hedges, cause="hedge") == \
        rec["prompt_tokens"] > 0


def test_the_first_head_wins_when_it_comes_before_the_hedges(learned, rid):
    relay, a, b = learned(rid)
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=1500, chunks=A_CHUNKS)
    b.behaviour = Behaviour(prefill_ms=B_PREFILL_MS, head_delay_ms=LATE_MS, chunks=B_CHUNKS)
    answered, rec = pieces(relay, f"{rid}-late", body("single 6"))
    assert answered == FROM_A
    route = rec["route"]
    assert route["upstream"] == "127.0.0.1" and route["hedged"]["won"] == "127.0.0.1", route
    assert rec["verdict"] == "upstream hedged" and "127.0.0.1 answered first" in rec["verdict_detail"], rec
    assert len(b.received) == 4 and b.wait_finished(4, timeout=5) and b.sent[-1].outcome == "client_closed"


def test_no_hedge_to_a_member_expected_later_than_waiting(learned, rid):
    """b's first token is expected after a's late head would give its own (b's prefill is long):
    b's head would win a race at once (the fake, as the providers, sends it before the prefill),
    and its first token come later, its prompt paid twice."""
    relay, a, b = learned(rid, b_prefill_ms=1200)
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=1000, chunks=A_CHUNKS)
    answered, rec = pieces(relay, f"{rid}-late", body("single 6"))
    assert answered == FROM_A and rec["ttft_ms"] >= 1000
    route = rec["route"]
    assert route["upstream"] == "127.0.0.1" and "hedged" not in route, route
    assert route["not_hedged"].startswith("b expected 1.") and " s, 127.0.0.1 0." in route["not_hedged"], route
    assert len(b.received) == 3
    samples = scrape(metrics_url(relay))
    assert total(samples, "ttft_relay_upstream_hedges_total") == 0
    assert total(samples, "ttft_relay_upstream_late_heads_waited_total", member="127.0.0.1", instead_of="hedge") == 1


def test_a_first_attempt_failing_while_the_hedge_runs_leaves_the_hedge_to_answer(learned, rid):
    relay, a, b = learned(rid)
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=700, reset_before_headers=True, chunks=A_CHUNKS)
    b.behaviour = Behaviour(prefill_ms=B_PREFILL_MS, head_delay_ms=1500, chunks=B_CHUNKS)
    answered, rec = pieces(relay, f"{rid}-reset", body("single 6"))
    assert answered == FROM_B and rec["error"] is None
    route = rec["route"]
    assert route["upstream"] == "b" and route["hedged"]["won"] == "b", route
    (failed,) = route["failed_over"]
    assert failed["upstream"] == "127.0.0.1" and failed["cause"] == "connection", failed
    assert hedged_after(route) < failed["after_ms"] < rec["ttft_ms"]
    assert "then failed (" in rec["verdict_detail"], rec
    assert len(a.received) == 4 and len(b.received) == 4  # b was not sent it twice


def hedged_after(route: dict) -> float:
    return route["hedged"]["after_ms"]


def test_a_request_unsafe_to_repeat_is_not_failed_over_once_it_went(start_relay, rid):
    with FakeUpstream(behaviour=Behaviour(status=503)) as a, FakeUpstream() as b:
        relay = start_relay(reverse_to(a), relay_upstream_groups=f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                            relay_upstream_no_repeat="/v1/chat/")
        conn, response = client.request("POST", relay.url() + PATH, body("hello"),
                                        {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": rid})
        with conn:
            assert response.status == 503
            response.read()
        (rec,) = relay.log.of(rid)
        assert "failed_over" not in rec["route"] and len(a.received) == 1 and not b.received


def test_the_budget_and_a_request_unsafe_to_repeat_leave_a_late_head_waited_for(learned, rid):
    relay, a, b = learned(rid, relay_upstream_hedge_budget=100, relay_upstream_no_repeat="POST /v1/chat")
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=1000, chunks=A_CHUNKS)
    answered, rec = pieces(relay, f"{rid}-unsafe", body("single 6"))
    assert answered == FROM_A and rec["route"]["upstream"] == "127.0.0.1" and "hedged" not in rec["route"]
    assert len(b.received) == 3 and rec["ttft_ms"] >= 1000
    samples = scrape(metrics_url(relay))
    assert total(samples, "ttft_relay_upstream_hedges_total") == 0


def test_no_hedge_beyond_the_budget(learned, rid):
    relay, a, b = learned(rid, relay_upstream_hedge_budget=1)  # 7 requests: 0.07 of one hedge
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=1000, chunks=A_CHUNKS)
    answered, rec = pieces(relay, f"{rid}-over", body("single 6"))
    assert answered == FROM_A and "hedged" not in rec["route"] and len(b.received) == 3


def test_an_http2_clients_request_is_hedged_as_any(learned, rid):
    """An HTTP/2 client's streams share its connection: the hedge answers on the stream, once."""
    relay, a, b = learned(rid, http2=True)
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=LATE_MS, chunks=A_CHUNKS)
    tls = ssl.create_default_context(cafile=relay.ca_pem)
    with httpx2.Client(http2=True, verify=tls, timeout=30) as h2:
        with h2.stream("POST", f"https://127.0.0.1:{relay.port}{PATH}", json=body("single 6"),
                       headers={"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": f"{rid}-h2"}) as response:
            assert response.http_version == "HTTP/2" and response.status_code == 200
            data = b"".join(response.iter_bytes())
    assert data.count(b"[DONE]") == 1 and data == b.sent[-1].body
    (rec,) = relay.log.of(f"{rid}-h2")
    assert rec["route"]["hedged"]["won"] == "b" and rec["verdict"] == "upstream hedged", rec
    assert a.wait_finished(4, timeout=5) and a.sent[-1].outcome == "client_closed"


def test_a_hedge_that_does_not_connect_is_no_race_and_costs_nothing(learned, rid):
    """b is gone: the hedge's connect is refused, nothing of it sent; a's late head is the
    answer, not a hedge's 'first head', and no prompt counts as paid twice."""
    relay, a, b = learned(rid)
    b.stop()
    a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=1000, chunks=A_CHUNKS)
    answered, rec = pieces(relay, f"{rid}-late", body("single 6"))
    assert answered == FROM_A and rec["error"] is None
    hedged = rec["route"]["hedged"]
    assert (hedged["from"], hedged["upstream"], hedged["won"]) == ("127.0.0.1", "b", None), hedged
    assert hedged["error"], hedged
    assert rec["verdict"] != "upstream hedged", rec
    samples = scrape(metrics_url(relay))
    assert total(samples, "ttft_relay_upstream_hedges_total") == 0
    assert total(samples, "ttft_relay_upstream_duplicated_prompt_tokens_total", cause="hedge") == 0


def test_a_hedge_that_does_not_connect_is_given_back_to_the_budget(start_relay, rid):
    """b and c are gone: a's late head is hedged to one of them, whose connect is refused (not
    charged), and the next late head to the other (the first tried last after its failed
    connect): the budget holds one hedge, and both were let go."""
    with FakeUpstream(behaviour=Behaviour(prefill_ms=A_PREFILL_MS, chunks=A_CHUNKS)) as a, \
            FakeUpstream(behaviour=Behaviour(prefill_ms=B_PREFILL_MS)) as b, \
            FakeUpstream(behaviour=Behaviour(prefill_ms=B_PREFILL_MS)) as c:
        relay = start_relay(reverse_to(a), relay_upstream_groups=[f"127.0.0.1 b=http://127.0.0.1:{b.port}",
                                                                   f"127.0.0.1 c=http://127.0.0.1:{c.port}"],
                            relay_upstream_explore=100, relay_upstream_hedge=True, relay_upstream_hedge_budget=10)
        for n in range(9):  # three to a (nothing learned), three exploring b, three c: all predict
            send(relay, f"{rid}-{n}", body(f"single {n}"))
        assert (len(a.received), len(b.received), len(c.received)) == (3, 3, 3)
        b.stop()
        c.stop()
        a.behaviour = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=LATE_MS, chunks=A_CHUNKS)
        # The 10th request (1.0 hedge in the budget) and the 11th (1.1): each client gives up
        # (no first token for a's line to learn a queue from: a stays the quickest).
        hedged = []
        for n in (10, 11):
            with pytest.raises(TimeoutError):
                client.request("POST", relay.url() + PATH, body(f"single {n}"),
                               {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": f"{rid}-{n}"}, timeout=2)
            (refused,) = relay.log.of(f"{rid}-{n}")
            route = refused["route"]
            assert refused["client_aborted"] and route["upstream"] == "127.0.0.1", route
            assert "hedged" in route and route["hedged"]["error"] and route["hedged"]["won"] is None, route
            hedged.append(route["hedged"]["upstream"])
        assert sorted(hedged) == ["b", "c"]


SPIKE_MS = 2400
FAR_PREFILL_MS = 1600


@pytest.mark.parametrize("instead", ["hedge", "slow_head"])
def test_a_member_whose_late_heads_were_long_is_left_at_its_bound_once_it_has_shown_them(learned, rid, instead):
    """b's first token (a prefill of FAR_PREFILL_MS: the prefix not cached there) comes later than
    a late head of a seems to need at a's bound, where the wait so far is all the rule knows: a's
    spikes are waited out. Once a has shown `late_heads.MIN_SAMPLES` of them (SPIKE_MS each), its
    remaining wait at the bound is what those took from there, longer than b's: the next is
    hedged to b, or (`relay_upstream_slow_head`, the same rule) given up on for b."""
    options = {} if instead == "hedge" else {"relay_upstream_hedge": False, "relay_upstream_slow_head": 100}
    waited = "not_hedged" if instead == "hedge" else "not_given_up"
    relay, a, b = learned(rid, b_prefill_ms=FAR_PREFILL_MS, **options)
    quick = Behaviour(prefill_ms=A_PREFILL_MS, chunks=A_CHUNKS)
    spike = Behaviour(prefill_ms=A_PREFILL_MS, head_delay_ms=SPIKE_MS, chunks=A_CHUNKS)
    for shown in range(late_heads.MIN_SAMPLES):
        a.behaviour = spike
        answered, rec = pieces(relay, f"{rid}-spike-{shown}", body(f"spike {shown}"))
        route = rec["route"]
        assert answered == FROM_A and "hedged" not in route and "failed_over" not in route, route
        assert route[waited].startswith("b expected 1.") and "(its late heads)" not in route[waited], route
        a.behaviour = quick
        # The queue a's spike taught goes as its quick answers come (and no three spikes in a row
        # make a new speed of its line): a chosen again at its old bound.
        for n in range(3):
            assert send(relay, f"{rid}-quick-{shown}-{n}", body(f"quick {shown} {n}"))["route"]["upstream"] == \
                "127.0.0.1"
    a.behaviour = spike
    answered, rec = pieces(relay, f"{rid}-known", body("spike known"))
    route = rec["route"]
    assert answered == FROM_B and route["upstream"] == "b", route
    if instead == "hedge":
        hedged = route["hedged"]
        assert hedged["won"] == "b", hedged
        why = hedged["why"]
    else:
        (gave_up,) = route["failed_over"]
        assert gave_up["upstream"] == "127.0.0.1" and gave_up["cause"] == "slow_head", gave_up
        why = gave_up["why"]
    assert why.startswith("b expected 1.") and why.endswith(" s more (its late heads)"), route
    assert a.wait_finished(len(a.received), timeout=5) and a.sent[-1].outcome == "client_closed", a.sent[-1]
