"""Marks → phases → verdict, without a proxy."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttft_relay.timing import phases

CRITICAL_UP_TO_TTFT = ("client_upload", "relay", "upstream_connect", "upstream_tls", "upstream_upload", "upstream_wait",
                       "head_to_first_token")


def stream_marks(**overrides: float) -> dict[str, float]:
    """A streamed request on a reused connection, every hop a few ms."""
    m = {
        "request_body": 2.0,
        "forwarded": 3.0,
        "response_head": 60.0,
        "first_byte": 61.0,
        "first_event": 61.0,
        "first_token": 70.0,
        "last_token": 400.0,
        "end": 401.0,
    }
    m.update(overrides)
    return m


def test_relative_marks_in_ms_and_timeline_order():
    rel = phases.relative_marks({"end": 101.5, "request_body": 100.25, "unknown": 1.0}, 100.0)
    assert rel == {"request_body": 250.0, "end": 1500.0}
    assert list(rel) == ["request_body", "end"]


def test_reused_connection_has_no_connect_or_tls_phase():
    p = phases.compute(stream_marks(), tokens_expected=True)
    assert p == {
        "client_upload": 2.0,
        "relay": 1.0,
        "upstream_wait": 57.0,
        "head_to_first_token": 10.0,
        "stream": 330.0,
        "ttft": 70.0,
        "total": 401.0,
    }


def test_lazy_connect_after_forwarded_is_on_the_critical_path():
    m = stream_marks(upstream_connect_start=3.5, upstream_tcp=10.0, upstream_tls=210.0, response_head=460.0, first_token=470.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["relay"] == 1.5  # forwarded → connect start is the relay's
    assert p["upstream_connect"] == 6.5
    assert p["upstream_tls"] == 200.0
    assert p["upstream_wait"] == 250.0
    assert p["ttft"] == 470.0


def test_eager_connect_the_request_waited_on_is_on_its_path():
    # Accepted at -301, connect at -300, TCP at -280, TLS at -80; the client's request was in
    # the kernel from the accept on (client_arrived), its head parsed at 0, once the connect was done.
    m = stream_marks(client_connect=-301.0, client_arrived=-301.0, upstream_connect_start=-300.0,
                     upstream_tcp=-280.0, upstream_tls=-80.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 0.0
    assert p["relay_queue"] == 1.0 + 80.0  # held: accept → connect start, TLS done → head read
    assert p["upstream_connect"] == 20.0
    assert p["upstream_tls"] == 200.0
    assert p["client_upload"] == 2.0 and p["relay"] == 1.0
    assert p["upstream_wait"] == 57.0
    assert p["ttft"] == 371.0


def test_the_clock_starts_at_the_requests_first_byte_not_at_the_connection():
    # A client that opened its connection 777 ms before writing the request (Codex's fallback):
    # the early connect ended long before; the relay read the head as it came.
    m = stream_marks(client_connect=-777.0, upstream_connect_start=-776.0, upstream_tcp=-770.0, upstream_tls=-760.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 777.0
    assert p["ttft"] == 70.0 and p["client_upload"] == 2.0
    assert p["upstream_connect"] == p["upstream_tls"] == 0.0  # this request opened it, but did not wait on it
    # The TCP handshake is set-up too: from the client's SYN.
    assert phases.compute(stream_marks(client_syn=-150.0, client_connect=-1.0), tokens_expected=True)[
        "connection_setup"] == 150.0


def test_a_slow_upload_after_an_early_connect_is_the_clients():
    # The client kept sending for 300 ms after its head was read; the connect was done before.
    m = stream_marks(request_body=300.0, forwarded=301.0, upstream_connect_start=-50.0, upstream_tcp=-40.0,
                     upstream_tls=-1.0, response_head=360.0, first_token=370.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["client_upload"] == 300.0
    assert p["upstream_connect"] == p["upstream_tls"] == 0.0
    assert p["ttft"] == 370.0


def test_connect_and_tls_to_the_relay_are_connection_setup():
    # CONNECT + TLS: accepted at -301; mitmproxy finished the upstream's TLS (-80) before the
    # client's (-70); the request's first byte came after. None of that is the request's upload.
    m = stream_marks(client_connect=-301.0, client_tls=-70.0, request_body=30.0, forwarded=31.0,
                     upstream_connect_start=-300.0, upstream_tcp=-280.0, upstream_tls=-80.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 301.0
    assert p["client_upload"] == 30.0
    assert p["upstream_connect"] == p["upstream_tls"] == 0.0
    assert sum(p[name] for name in CRITICAL_UP_TO_TTFT if name in p) == p["ttft"]


def test_connect_overlapping_the_upload_counts_only_past_forwarded():
    # A slow upload (0 → 500) while the connect ran from 100 to 600.
    m = stream_marks(request_body=500.0, forwarded=501.0, upstream_connect_start=100.0, upstream_tcp=150.0,
                     upstream_tls=600.0, response_head=650.0, first_token=660.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["client_upload"] == 500.0
    assert p["upstream_connect"] == 0.0
    assert p["upstream_tls"] == 99.0
    assert p["upstream_wait"] == 50.0


def test_non_streamed_ttft_is_time_to_full_response():
    m = {"request_body": 1.0, "forwarded": 2.0, "response_head": 800.0, "end": 805.0}
    p = phases.compute(m, tokens_expected=False)
    assert p["response_body"] == 5.0
    assert p["ttft"] == p["total"] == 805.0
    assert "head_to_first_token" not in p


def test_streamed_without_a_token_has_no_ttft():
    m = {k: v for k, v in stream_marks().items() if k not in ("first_token", "last_token")}
    p = phases.compute(m, tokens_expected=True)
    assert "ttft" not in p and "stream" not in p
    assert p["total"] == 401.0


ms = st.floats(min_value=0, max_value=5000, allow_nan=False)


@given(body=ms, relay=ms, conn_at=st.floats(-5000, 5000), connect=ms, tls=ms, tls_on=st.booleans(),
       new=st.booleans(), wait=ms, prefill=ms, accept=ms, upload=st.none() | st.floats(-100, 6000))
def test_critical_phases_add_up_to_ttft(body, relay, conn_at, connect, tls, tls_on, new, wait, prefill, accept, upload):
    fwd = body + relay
    m = {"request_body": body, "forwarded": fwd}
    if new and conn_at < 0:
        m["client_connect"] = conn_at - accept
    ready = fwd
    if new:
        m["upstream_connect_start"] = conn_at
        m["upstream_tcp"] = conn_at + connect
        ready = conn_at + connect
        if tls_on:
            m["upstream_tls"] = ready = conn_at + connect + tls
    head = max(fwd, ready) + wait
    m |= {"response_head": head, "first_token": head + prefill, "last_token": head + prefill, "end": head + prefill}
    if upload is not None:  # the kernel's last send of the request: any reading, even a wrong one
        m["upstream_sent"] = max(fwd, ready) + upload
    p = phases.compute(m, tokens_expected=True)
    assert all(p[name] >= 0 for name in CRITICAL_UP_TO_TTFT if name in p)
    assert ("upstream_upload" in p) == (upload is not None)
    assert sum(p.get(name, 0.0) for name in CRITICAL_UP_TO_TTFT) == pytest.approx(p["ttft"], abs=0.01)
    assert ("upstream_connect" in p) == new
    assert ("upstream_tls" in p) == (new and tls_on)


def test_rtt_from_tls_handshake_or_tcp_connect():
    assert phases.handshake_rtt_ms({"upstream_connect_start": 0, "upstream_tcp": 1, "upstream_tls": 201}, "TLSv1.3") == 200
    assert phases.handshake_rtt_ms({"upstream_connect_start": 0, "upstream_tcp": 1, "upstream_tls": 201}, "TLSv1.2") == 100
    assert phases.handshake_rtt_ms({"upstream_connect_start": 0, "upstream_tcp": 30}, None) == 30
    assert phases.handshake_rtt_ms({}, None) is None


def test_verdict_far_upstream_differs_from_slow_upstream():
    p = {"client_upload": 1, "relay": 1, "upstream_wait": 300, "head_to_first_token": 20}
    assert phases.verdict(p, rtt_ms=250) == phases.UPSTREAM_NETWORK
    assert phases.verdict(p, rtt_ms=5) == phases.UPSTREAM_WAIT
    assert phases.verdict(p) == phases.UPSTREAM_WAIT
    # Prefill after an early head is the upstream's wait too.
    assert phases.verdict({"upstream_wait": 20, "head_to_first_token": 400}, rtt_ms=10) == phases.UPSTREAM_WAIT


def test_a_handshake_is_named_only_where_it_cost_most_of_the_link():
    # A fresh TLS connection to a far upstream: the handshake and the request cost one round trip
    # each, the link as a whole is named; a handshake that cost more than the rest is named itself.
    p = {"client_upload": 1, "relay": 1, "upstream_connect": 1, "upstream_tls": 203, "upstream_wait": 255}
    assert phases.verdict(p, rtt_ms=205) == phases.UPSTREAM_NETWORK
    assert phases.verdict(p | {"upstream_tls": 900}, rtt_ms=205) == phases.UPSTREAM_TLS


def far_provider_phases(connect: float = 100.0, tls: float = 105.0, upload_rtt: float = 120.0) -> dict[str, float]:
    """A fresh TLS connection 100 ms from the relay, a 16 kB request that takes a second flight."""
    m = stream_marks(upstream_connect_start=3.5, upstream_tcp=3.5 + connect, upstream_tls=3.5 + connect + tls)
    sent = m["upstream_tls"]
    m |= {"upstream_sent": sent + upload_rtt, "response_head": sent + upload_rtt + 130.0}
    m |= {"first_byte": m["response_head"] + 1, "first_event": m["response_head"] + 1,
          "first_token": m["response_head"] + 40.0}
    return phases.compute(m, tokens_expected=True)


def test_the_requests_upload_beyond_its_first_flight_is_the_links_not_the_upstreams_wait():
    p = far_provider_phases()
    assert p["upstream_upload"] == 120.0 and p["upstream_wait"] == 130.0
    assert sum(p.get(name, 0.0) for name in CRITICAL_UP_TO_TTFT) == pytest.approx(p["ttft"])
    c = phases.contributions(p, rtt_ms=100.0)
    assert c[phases.UPSTREAM_NETWORK] == 100.0 + 120.0
    assert c[phases.UPSTREAM_WAIT] == 30.0 + 40.0  # the upstream's own: what prefill is learned from
    # A kernel reading past the head (a clock's jiffy) never makes the wait negative.
    late = stream_marks(upstream_sent=90.0, response_head=60.0)
    assert phases.compute(late, tokens_expected=True)["upstream_wait"] == 0.0


@pytest.mark.parametrize("connect, tls, upload, words", [
    (100.0, 105.0, 120.0, phases.UPSTREAM_NETWORK),  # each part under a quarter of the wait: the link is one hop
    (100.0, 105.0, 0.0, phases.UPSTREAM_NETWORK),  # a round trip in each part: none dominates
    (100.0, 500.0, 0.0, phases.UPSTREAM_TLS),  # a server slow in its handshake
    (1100.0, 105.0, 0.0, phases.UPSTREAM_CONNECT),  # a SYN lost: the connect took its 1 s timeout
])
def test_a_far_providers_link_is_judged_as_one_hop_named_after_its_largest_part(connect, tls, upload, words):
    p = far_provider_phases(connect, tls, upload)
    v = phases.judge(p, rtt_ms=100.0)
    assert v.words == words, (v, p)
    assert v.detail is not None and v.detail.startswith("the link to the upstream")
    assert "round trips" in v.detail


def test_a_link_whose_every_part_is_under_a_quarter_of_the_wait_is_named_as_one_hop():
    # connect, TLS and the request's round trip 100 ms each, the upstream's own 150 ms: no part
    # is a quarter of the ~460 ms wait (each was judged alone, and the verdict was `ok`).
    p = far_provider_phases(100.0, 100.0, 0.0) | {"upstream_wait": 210.0, "head_to_first_token": 40.0}
    p["ttft"] = sum(p.get(name, 0.0) for name in CRITICAL_UP_TO_TTFT)
    c = phases.contributions(p, rtt_ms=100.0)
    assert all(c[part] < phases.SHARE * p["ttft"] for part in phases.UPSTREAM_LINK), (c, p["ttft"])
    assert phases.verdict(p, rtt_ms=100.0) == phases.UPSTREAM_NETWORK


@pytest.mark.parametrize("phase, words", [
    ("client_upload", phases.CLIENT_UPLOAD), ("relay", phases.RELAY),
    ("upstream_connect", phases.UPSTREAM_CONNECT), ("upstream_tls", phases.UPSTREAM_TLS),
])
def test_verdict_names_the_dominant_phase(phase, words):
    p = {"client_upload": 5, "relay": 5, "upstream_wait": 5, phase: 500}
    assert phases.verdict(p) == words


def test_the_longest_gap_counts_as_a_stall_only_after_the_first_token():
    m = stream_marks(first_byte=61.0, first_token=461.0, last_token=1400.0, end=1401.0)
    assert phases.gap_after_first_token(m | {"longest_gap": 61.0}, 400.0, 100) is None  # the prefill
    gap = phases.gap_after_first_token(m | {"longest_gap": 800.0}, 400.0, 100)
    assert gap == phases.Gap(400.0, pytest.approx((1401.0 - 61.0 - 400.0) / 98))
    # An older record without the mark: only a gap longer than first byte → first token must be after it.
    assert phases.gap_after_first_token(m, 400.0, 100) is None
    assert phases.gap_after_first_token(m, 900.0, 100).ms == 900.0
    assert phases.gap_after_first_token({"first_byte": 1.0}, 900.0, 10) is None  # no token at all
    p = phases.compute(stream_marks(), tokens_expected=True)
    stalled = phases.gap_after_first_token(stream_marks(longest_gap=100.0), 600.0, 3)
    assert phases.verdict(p, gap=stalled) == phases.STREAM_STALL


def test_error_verdicts_name_the_phase():
    assert phases.verdict({}, error="boom", error_phase="upstream_tls") == "error in upstream TLS"
    assert phases.verdict({}, error="x", error_phase="upstream_wait", client_aborted=True) == "client aborted in upstream wait"


@pytest.mark.parametrize("error, phase, status, answered, words", [
    ("HTTP 429", "upstream_wait", 429, True, "upstream refused: rate limited (429)"),
    ("HTTP 529", "upstream_wait", 529, True, "upstream refused: overloaded (529)"),
    ("HTTP 500", "upstream_wait", 500, True, "upstream failed: internal error (500)"),
    ("HTTP 418", "upstream_wait", 418, True, "upstream refused: status 418 (418)"),
    ("relay access key not accepted", "relay", 401, False, "refused by relay: key not accepted"),
    (phases.RELAY_SHUTTING_DOWN, "upstream_wait", 503, False, phases.RELAY_SHUTTING_DOWN),
    (phases.RELAY_SHUTTING_DOWN, "relay", 503, False, phases.RELAY_SHUTTING_DOWN),
    ("connect timed out", "upstream_connect", 504, False, "error in upstream connect"),  # the relay's 504
    ("boom", "relay", None, False, "error in relay"),
])
def test_a_refusal_names_who_refused_and_why(error, phase, status, answered, words):
    p = {"client_upload": 1.0, "relay": 1.0, "upstream_wait": 1000.0, "total": 1002.0}
    v = phases.judge(p, error=error, error_phase=phase, status=status, upstream_answered=answered)
    assert v.words == words
    assert v.detail is not None and "upstream wait 1.0 s" in v.detail  # where its time went


def test_a_stops_cut_says_the_phase_it_cut():
    v = phases.judge({"upstream_wait": 1005.0, "total": 1006.0}, error=phases.RELAY_SHUTTING_DOWN,
                     error_phase="upstream_wait", status=503)
    assert v == phases.Verdict(phases.RELAY_SHUTTING_DOWN, "ended in upstream wait after 1.0 s (upstream wait 1.0 s)")


@pytest.mark.parametrize("marks, tls, expected", [
    ({}, True, "client_upload"),
    ({"request_body": 1}, True, "relay"),
    ({"request_body": 1, "forwarded": 2, "upstream_connect_start": 2}, True, "upstream_connect"),
    ({"request_body": 1, "forwarded": 2, "upstream_connect_start": 2, "upstream_tcp": 3}, True, "upstream_tls"),
    ({"request_body": 1, "forwarded": 2, "upstream_connect_start": 2, "upstream_tcp": 3}, False, "upstream_wait"),
    ({"request_body": 1, "forwarded": 2}, True, "upstream_wait"),
    ({"request_body": 1, "forwarded": 2, "response_head": 3}, True, "head_to_first_token"),
    ({"request_body": 1, "forwarded": 2, "response_head": 3, "first_token": 4}, True, "stream"),
])
def test_error_phase_is_the_first_unfinished(marks, tls, expected):
    assert phases.error_phase(marks, tls_expected=tls, tokens_expected=True) == expected


def test_server_timing_has_only_head_time_phases():
    p = phases.compute(stream_marks(), tokens_expected=True)
    assert phases.server_timing(p) == "client_upload;dur=2.0, relay;dur=1.0, upstream_wait;dur=57.0"


# --- what the kernel held for a busy relay (selfwatch's *_arrived marks) ------------


def test_relay_queue_is_what_the_kernel_held_and_the_wait_starts_at_arrival():
    # The connection sat 300 ms in the accept queue, the first token 40 ms in the upstream socket.
    m = stream_marks(client_arrived=-300.0, head_arrived=58.0, token_arrived=62.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["relay_queue"] == pytest.approx(300.0 + 8.0)  # accept queue + the token read 8 ms late
    assert p["upstream_wait"] == 55.0  # forwarded (3) → head in the kernel (58)
    assert p["head_to_first_token"] == 4.0  # 58 → 62, the upstream's
    assert p["ttft"] == 370.0  # what the client saw
    assert phases.verdict(p) == phases.RELAY_SATURATED


def test_a_queue_held_before_the_relay_process_served_is_relay_starting():
    # The same 300 ms in the accept queue, 280 of them before this process began to serve.
    m = stream_marks(client_arrived=-300.0, relay_serving=-20.0, head_arrived=58.0, token_arrived=62.0)
    p = phases.compute(m, tokens_expected=True)
    assert phases.starting_ms(m, p) == 280.0
    v = phases.judge(p, starting_ms=phases.starting_ms(m, p))
    assert v.words == phases.RELAY_STARTING and "while it started" in v.detail
    assert phases.advice(v.words, p, None) is None  # no "run more workers" for a start
    # Served for most of the wait: the queue is the relay's load, as before.
    late = stream_marks(client_arrived=-300.0, relay_serving=-200.0, head_arrived=58.0, token_arrived=62.0)
    assert phases.starting_ms(late, p) == 100.0
    assert phases.verdict(p, starting_ms=phases.starting_ms(late, p)) == phases.RELAY_SATURATED
    assert phases.starting_ms(stream_marks(client_arrived=-300.0), p) is None


def test_without_arrival_marks_there_is_no_relay_queue_phase():
    assert "relay_queue" not in phases.compute(stream_marks(), tokens_expected=True)


def test_arrivals_later_than_the_reads_change_nothing():
    # A kernel clock a jiffy behind, or the bytes read at once: no queue, the same phases.
    m = stream_marks(client_arrived=1.0, body_arrived=3.0, head_arrived=61.0, token_arrived=75.0)
    p = phases.compute(m, tokens_expected=True)
    assert p.pop("relay_queue") == 0.0
    assert p == phases.compute(stream_marks(), tokens_expected=True)


def test_a_body_read_late_by_a_busy_relay_is_not_a_slow_upload():
    # An eager 400 ms connect; head and body were both in the kernel at accept (-401), the
    # busy relay read the body 11 ms after the head.
    m = stream_marks(client_connect=-401.0, upstream_connect_start=-400.0, upstream_tcp=-1.0,
                     request_body=11.0, forwarded=12.0)
    blind = phases.compute(m, tokens_expected=True)
    assert blind["upstream_connect"] == 0.0 and blind["connection_setup"] == 401.0  # missed without the kernel's view
    m |= {"client_arrived": -401.0, "body_arrived": -401.0}
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 0.0
    assert p["upstream_connect"] == 399.0
    assert p["client_upload"] == 0.0
    assert p["relay_queue"] == 1.0 + 1.0 + 11.0  # before the connect, after it, the body read late
    assert phases.verdict(p) == phases.UPSTREAM_CONNECT


def test_not_streamed_answer_read_late():
    m = {"request_body": 1.0, "forwarded": 2.0, "head_arrived": 50.0, "response_head": 250.0, "end": 260.0}
    p = phases.compute(m, tokens_expected=False)
    assert p["upstream_wait"] == 48.0 and p["relay_queue"] == 200.0 and p["response_body"] == 10.0
    assert p["ttft"] == 260.0


def test_a_stall_the_event_loop_explains_is_the_relays():
    p = phases.compute(stream_marks(), tokens_expected=True)
    stall = phases.Gap(600.0, 5.0)
    assert phases.verdict(p, gap=stall, loop_lag_ms=550.0) == phases.RELAY_SATURATED
    assert phases.verdict(p, gap=stall, loop_lag_ms=5.0) == phases.STREAM_STALL


def test_the_client_link_is_named_even_on_a_kept_alive_connection():
    p = phases.compute(stream_marks(), tokens_expected=True)  # every phase small
    assert phases.verdict(p, client_rtt_ms=400.0) == phases.CLIENT_NETWORK
    assert phases.verdict(p, client_rtt_ms=0.1) == phases.UPSTREAM_WAIT


def test_advice_only_for_a_saturated_relay_with_its_numbers():
    text = phases.advice(phases.RELAY_SATURATED, {"relay_queue": 312.4}, 287.0)
    assert "312 ms" in text and "287 ms" in text and "--workers" in text
    assert phases.advice(phases.UPSTREAM_WAIT, {}, 900.0) is None


@given(queue_in=ms, body=ms, body_late=ms, relay=ms, wait=ms, head_late=ms, prefill=ms, token_late=ms)
def test_phases_with_arrivals_add_up_to_what_the_client_saw(queue_in, body, body_late, relay, wait, head_late,
                                                            prefill, token_late):
    # Kernel timeline: arrival, body in, upstream head in, first token in; each read some time later.
    m = {"client_arrived": -queue_in, "body_arrived": body, "request_body": body + body_late}
    fwd = m["request_body"] + relay
    head_in = fwd + wait
    token_in = head_in + prefill
    m |= {"forwarded": fwd, "head_arrived": head_in, "response_head": head_in + head_late,
          "token_arrived": token_in, "first_token": max(token_in, head_in + head_late) + token_late}
    m |= {"last_token": m["first_token"], "end": m["first_token"]}
    p = phases.compute(m, tokens_expected=True)
    assert all(v >= 0 for v in p.values())
    assert sum(p.get(name, 0.0) for name in ("relay_queue", *CRITICAL_UP_TO_TTFT)) == pytest.approx(p["ttft"], abs=0.01)
    assert p["ttft"] == pytest.approx(m["first_token"] + queue_in, abs=0.01)
    assert p["upstream_wait"] == pytest.approx(wait, abs=0.01)


# --- verdicts: ok unless a phase is out of line ------------------------------------------


def healthy_stream(first_token: float, cadence: float, chunks: int, **overrides: float) -> tuple[dict, dict]:
    """Marks and phases of a kept-alive request whose events come `cadence` ms apart."""
    m = {"request_body": 0.3, "forwarded": 0.8, "response_head": first_token - 1.0, "first_byte": first_token - 0.5,
         "first_event": first_token - 0.5, "first_token": first_token,
         "last_token": first_token + cadence * (chunks - 2), "end": first_token + cadence * (chunks - 2) + 0.2}
    m |= overrides
    return m, phases.compute(m, tokens_expected=True)


@given(first_token=st.floats(2, 40), cadence=st.floats(1, 30), jitter=st.floats(1, 3), chunks=st.integers(3, 400),
       client_rtt=st.floats(0, 7), lag=st.floats(0, 20))
def test_a_healthy_request_is_ok_whatever_its_cadence_and_the_loopback_noise(first_token, cadence, jitter, chunks,
                                                                              client_rtt, lag):
    # 5 ms first tokens and events 10 ms apart read "stream stall" in 19 of 20 requests before;
    # a kept loopback connection's smoothed RTT of 2.4-7 ms read "client network".
    m, p = healthy_stream(first_token, cadence, chunks)
    gap = phases.gap_after_first_token(m | {"longest_gap": first_token + cadence}, cadence * jitter, chunks)
    v = phases.judge(p, gap=gap, client_rtt_ms=client_rtt, loop_lag_ms=lag)
    assert v.words == phases.OK, v
    assert "nothing out of line" in v.detail


def test_a_stall_is_named_against_the_streams_own_cadence():
    m, p = healthy_stream(20.0, 350.0, 30)
    slow_pace = phases.gap_after_first_token(m | {"longest_gap": 300.0}, 400.0, 30)  # events 350 ms apart anyway
    assert slow_pace.cadence_ms > 300 and phases.verdict(p, gap=slow_pace) == phases.OK
    m, p = healthy_stream(20.0, 10.0, 100, end=3000.0 + 10 * 98)
    stalled = phases.gap_after_first_token(m | {"longest_gap": 500.0}, 3000.0, 100)
    v = phases.judge(p, gap=stalled)
    assert v.words == phases.STREAM_STALL and v.detail.startswith("3.0 s of silence after the first token, ")
    assert "the stream's 10 ms between chunks" in v.detail


@given(tls=st.floats(0, 40), wait=st.floats(0, 12), client_rtt=st.floats(0, 7))
def test_a_websocket_handshake_is_never_prefill_and_a_quick_one_is_ok(tls, wait, client_rtt):
    m = {"request_body": 0.2, "forwarded": 0.5, "upstream_connect_start": 0.6, "upstream_tcp": 1.0,
         "upstream_tls": 1.0 + tls, "response_head": 1.0 + tls + wait, "end": 1.0 + tls + wait}
    p = phases.compute(m, tokens_expected=False)
    p.pop("ttft")  # a handshake has no first token (record.build_record)
    assert phases.verdict(p, no_prefill=True, client_rtt_ms=client_rtt) == phases.OK


def test_a_slow_handshake_names_its_phase_and_never_prefill_or_queue():
    p = {"client_upload": 0.2, "relay": 0.3, "upstream_connect": 0.4, "upstream_tls": 2.0, "upstream_wait": 900.0,
         "total": 903.0}
    expectation = phases.Expectation(own_ms=100.0, tolerance_ms=250.0, prompt_ms=50.0, uncached_tokens=500,
                                     cached_tokens=0, ms_per_1k=100.0, learned_from=20)
    v = phases.judge(p, no_prefill=True, expectation=expectation)
    assert v.words == phases.UPSTREAM_ANSWER == "upstream wait" and v.expected_ttft_ms is None
    assert phases.verdict(p | {"upstream_tls": 600.0, "upstream_wait": 3.0, "total": 606.0},
                          no_prefill=True) == phases.UPSTREAM_TLS
    # A prewarm turn: response.created at once, response.completed 400 ms later: the upstream's work.
    prewarm = phases.compute({"request_body": 0.0, "forwarded": 0.5, "response_head": 2.0, "end": 402.0},
                             tokens_expected=False)
    assert phases.verdict(prewarm, no_prefill=True) == phases.UPSTREAM_ANSWER


def expect(own: float, prompt: float, tokens: int = 10_000, cached: int = 0) -> phases.Expectation:
    return phases.Expectation(own_ms=own, tolerance_ms=max(250.0, own / 2), prompt_ms=prompt, uncached_tokens=tokens,
                              cached_tokens=cached, ms_per_1k=prompt / (tokens / 1000), learned_from=40)


def waiting(own: float) -> dict[str, float]:
    """A kept-alive request whose upstream waited `own` ms before its first token."""
    return {"client_upload": 1.0, "relay": 1.0, "upstream_wait": own, "ttft": own + 2.0, "total": own + 500.0}


def test_context_length_when_the_prompt_explains_the_wait():
    v = phases.judge(waiting(1100.0), expectation=expect(1100.0, 1000.0))
    assert v.words == phases.CONTEXT_LENGTH
    assert v.detail == ("first token 1.1 s: 10.0k prompt tokens (0 cached) at 100 ms per 1k explain 1.0 s of it "
                        "(this prompt predicts 1.1 s)")
    assert v.expected_ttft_ms == 1102.0


def test_upstream_queueing_when_the_wait_is_far_beyond_what_the_prompt_predicts():
    v = phases.judge(waiting(1900.0), expectation=expect(300.0, 25.0, tokens=250))
    assert v.words == phases.UPSTREAM_QUEUEING
    assert v.detail == ("first token 1.9 s, 6.3× the 302 ms this prompt predicts (250 prompt tokens (0 cached); "
                        "the upstream's own wait 1.9 s against 300 ms)")
    # A long prompt's wait with a 1.5 s queue on top: queueing too, though it is "only" 2.4x.
    assert phases.verdict(waiting(2600.0), expectation=expect(1100.0, 1000.0)) == phases.UPSTREAM_QUEUEING


def test_a_wait_in_line_with_a_short_prompt_is_ok_and_a_small_excess_is_noise():
    v = phases.judge(waiting(130.0), expectation=expect(110.0, 10.0, tokens=100))
    assert v.words == phases.OK and v.detail == "first token 132 ms, in line with the 112 ms this prompt predicts"
    assert phases.verdict(waiting(330.0), expectation=expect(110.0, 10.0, tokens=100)) == phases.OK


def test_a_prompt_cache_miss_is_named_where_the_uncached_prompt_explains_the_wait():
    miss = "this conversation's previous request, 12 s earlier, had 45,000 tokens cached"
    v = phases.judge(waiting(2000.0), expectation=expect(2000.0, 1900.0, tokens=48_000), cache_miss=miss)
    assert v.words == phases.PROMPT_CACHE_MISS and v.detail.endswith("although " + miss)
    assert phases.verdict(waiting(130.0), expectation=expect(110.0, 10.0), cache_miss=miss) == phases.OK


def test_before_anything_is_learned_the_wait_is_prefill_or_queue_and_says_why():
    v = phases.judge(waiting(1900.0), unlearned="learning this upstream · model: 3 of 8 requests")
    assert v.words == phases.UPSTREAM_WAIT and v.expected_ttft_ms is None
    assert v.detail.endswith("prefill and queueing not told apart (learning this upstream · model: 3 of 8 requests)")
    assert phases.verdict(waiting(20.0)) == phases.OK  # quick: nothing to tell apart


def test_a_far_link_that_adds_little_to_a_long_wait_is_not_the_verdict():
    # 150 ms to the client on top of a 2 s context-length wait: the prompt is why it was slow.
    assert phases.verdict(waiting(2000.0), client_rtt_ms=150.0,
                          expectation=expect(2000.0, 1900.0)) == phases.CONTEXT_LENGTH
    # The same link on a quick answer is the slow hop.
    v = phases.judge(waiting(20.0), client_rtt_ms=150.0, expectation=expect(20.0, 2.0))
    assert v.words == phases.CLIENT_NETWORK and v.detail.startswith("a 150 ms round trip to the client")


@pytest.mark.parametrize("marks, unfinished", [
    # A first-token deadline: the head came at 37 ms, the relay gave up at 3021 ms.
    ({"request_body": 1.0, "forwarded": 2.0, "response_head": 37.0, "first_byte": 37.0, "end": 3021.0},
     "head_to_first_token"),
    # A WebSocket handshake that hung until the client left at 14,986 ms.
    ({"request_body": 0.0, "forwarded": 1.0, "end": 14986.0}, "upstream_wait"),
    # An upstream connect that never completed.
    ({"request_body": 1.0, "forwarded": 2.0, "upstream_connect_start": 2.5, "end": 10002.0}, "upstream_connect"),
    # A client that never finished its body.
    ({"end": 5000.0}, "client_upload"),
])
def test_every_wait_of_a_failed_request_is_in_a_phase(marks, unfinished):
    p = phases.compute(marks, tokens_expected=True, unfinished=unfinished)
    assert phases.error_phase(marks, tls_expected=False, tokens_expected=True) == unfinished
    assert sum(p.get(name, 0.0) for name in phases.CRITICAL_PHASES) == pytest.approx(p["total"])
    assert p[unfinished] >= 0.9 * p["total"]
    assert "ttft" not in p


def test_a_request_cut_after_its_first_token_keeps_its_phases():
    p = phases.compute(stream_marks(), tokens_expected=True, unfinished="stream")
    assert p == phases.compute(stream_marks(), tokens_expected=True)


@given(queue_in=ms, body=ms, relay=ms, wait=ms, cut=ms, head=st.booleans(), arrived=st.booleans())
def test_a_failed_requests_phases_add_up_to_its_total(queue_in, body, relay, wait, cut, head, arrived):
    m = {"request_body": body, "forwarded": body + relay}
    if arrived:
        m["client_arrived"] = -queue_in
    if head:
        m["response_head"] = body + relay + wait
    m["end"] = max(m.values()) + cut
    unfinished = phases.error_phase(m, tls_expected=False, tokens_expected=True)
    p = phases.compute(m, tokens_expected=True, unfinished=unfinished)
    covered = sum(p.get(name, 0.0) for name in phases.CRITICAL_PHASES)
    assert covered == pytest.approx(p["total"], abs=0.01)


# --- the first request on a connection: the wait the client felt, from its SYN ------------


def first_request_marks(*, syn: float, tcp: float, accepted: float, tls: float | None, **more: float) -> dict[str, float]:
    m = stream_marks(client_syn=syn, client_tcp=tcp, client_connect=accepted, **more)
    if tls is not None:
        m["client_tls"] = tls
    return m


def test_a_far_clients_handshakes_are_client_network_and_its_idle_time_no_ones():
    # 150 ms round trips: the TCP handshake, one TLS 1.3 round trip; the client then idled 500 ms.
    m = first_request_marks(syn=-1150.0, tcp=-1000.0, accepted=-1000.0, tls=-850.0)
    split = phases.setup(m, client_rtt_ms=150.0, round_trips=1)
    assert split == phases.Setup(client_ms=300.0, relay_ms=0.0, starting_ms=0.0, upstream_connect_ms=0.0,
                                 upstream_tls_ms=0.0)
    # Its first token 700 ms after the request, in line with what its prompt predicts: alone, a
    # 150 ms round trip is not a quarter of it; with the handshakes it felt 1 s, 450 ms the link.
    p = {"client_upload": 2.0, "relay": 1.0, "upstream_wait": 680.0, "head_to_first_token": 17.0, "ttft": 700.0}
    line = phases.Expectation(own_ms=690.0, tolerance_ms=250.0, prompt_ms=0.0, uncached_tokens=10, cached_tokens=0,
                              ms_per_1k=None, learned_from=8)
    assert phases.verdict(p, client_rtt_ms=150.0, expectation=line) == phases.OK
    v = phases.judge(p, client_rtt_ms=150.0, expectation=line, setup=split)
    assert v.words == phases.CLIENT_NETWORK and "handshakes 300 ms" in v.detail, v


@pytest.mark.parametrize("tls", [None, -3000.0])
def test_a_connection_the_relay_accepted_late_is_the_relays_on_every_listener(tls):
    # The kernel did the handshake at -4010; the relay accepted the connection at -3010 (plain: the
    # request had arrived with it, the kernel held it: relay_queue from client_arrived on).
    m = first_request_marks(syn=-4012.0, tcp=-4010.0, accepted=-3010.0, tls=tls)
    if tls is None:
        m |= {"client_arrived": -4009.0}
    else:
        m |= {"client_connect": -3010.0}
    # The relay's event loop ran up to 1.2 s late meanwhile.
    split = phases.setup(m, client_rtt_ms=1.0, round_trips=0 if tls is None else 1, loop_lag_ms=1200.0)
    p = phases.compute(m, tokens_expected=True)
    if tls is None:
        # What the kernel held after the request's first byte is relay_queue already: never twice.
        assert split.relay_ms == pytest.approx(1.0) and p["relay_queue"] == pytest.approx(4009.0)
    else:
        assert split.relay_ms == pytest.approx(1000.0 + 9.0)  # the accept queue, the handshake's end read late
        assert p[phases.SETUP_PHASE] == pytest.approx(4012.0)
    v = phases.judge(p, client_rtt_ms=1.0, setup=split, starting_ms=phases.starting_ms(m, p))
    assert v.words == phases.RELAY_SATURATED, v
    advice = phases.advice(v.words, p, 1200.0, split)
    assert advice is not None and f"{p.get('relay_queue', 0.0) + split.relay_ms:.0f} ms in its own queues" in advice


def test_a_tls_handshake_queued_for_a_starting_relay_is_relay_starting():
    # The supervisor's listener took the connection 4.3 s before this worker served (relay_serving).
    m = first_request_marks(syn=-4350.0, tcp=-4349.0, accepted=-60.0, tls=-55.0, relay_serving=-62.0)
    p = phases.compute(m, tokens_expected=True)
    split = phases.setup(m, client_rtt_ms=0.5, round_trips=1)
    assert split.starting_ms == pytest.approx(4349.0 - 62.0)
    v = phases.judge(p, client_rtt_ms=0.5, setup=split, starting_ms=phases.starting_ms(m, p))
    assert v.words == phases.RELAY_STARTING and "while it started" in v.detail, v
    assert v.detail is not None and "before the relay read the new connection's request" in v.detail


def test_an_upstream_connect_the_client_handshake_waited_on_is_the_upstreams():
    # HTTPS-proxy mode: mitmproxy connects upstream (300 ms) inside the client's TLS handshake.
    m = first_request_marks(syn=-402.0, tcp=-401.0, accepted=-400.0, tls=-50.0,
                            upstream_connect_start=-399.0, upstream_tcp=-250.0, upstream_tls=-100.0)
    split = phases.setup(m, client_rtt_ms=1.0, round_trips=2, loop_lag_ms=20.0)
    assert (split.upstream_connect_ms, split.upstream_tls_ms) == (pytest.approx(149.0), pytest.approx(150.0))
    assert split.client_ms == pytest.approx(1.0 + 2.0)  # the TCP handshake, two TLS 1.2 round trips
    # The accept; of the handshake's 49 ms after the connect, what the loop's lag explains (the
    # rest: the handshake's own work at either end, no one's hop).
    assert split.relay_ms == pytest.approx(1.0 + 20.0)


def test_a_slow_tls_handshake_of_a_relay_neither_busy_nor_starting_is_no_ones():
    # 80 ms of crypto on a loaded machine: no lag, no start. Not a reason to run more workers.
    m = first_request_marks(syn=-82.0, tcp=-81.0, accepted=-81.0, tls=-0.5)
    split = phases.setup(m, client_rtt_ms=0.1, round_trips=1, loop_lag_ms=2.0)
    assert split.relay_ms == pytest.approx(2.0)
    p = {"client_upload": 0.5, "relay": 0.5, "upstream_wait": 60.0, "head_to_first_token": 9.0, "ttft": 70.0}
    line = phases.Expectation(own_ms=69.0, tolerance_ms=250.0, prompt_ms=0.0, uncached_tokens=10, cached_tokens=0,
                              ms_per_1k=None, learned_from=8)
    assert phases.verdict(p, client_rtt_ms=0.1, expectation=line, setup=split) == phases.OK


def test_a_kept_alive_request_has_no_setup():
    assert phases.setup(stream_marks(), client_rtt_ms=150.0, round_trips=1) is None


def test_an_early_connect_that_never_finished_is_upstream_connect_not_the_relays_queue():
    # An address that black-holes: the connect opened as the client connected ran 10 s until it
    # failed; the request, in the kernel all along, was read after (it read relay_queue 9,996 ms).
    m = {"client_connect": -10001.0, "client_arrived": -10000.0, "upstream_connect_start": -9999.0,
         "request_body": 0.5, "forwarded": 1.0, "end": 2.0}
    unfinished = phases.error_phase(m, tls_expected=True, tokens_expected=True)
    assert unfinished == "upstream_connect"
    p = phases.compute(m, tokens_expected=True, unfinished=unfinished)
    assert p["upstream_connect"] == pytest.approx(9999.0 + 1.0)
    assert p["relay_queue"] == pytest.approx(1.0)
    assert sum(p.get(name, 0.0) for name in phases.CRITICAL_PHASES) == pytest.approx(p["total"])
