"""Per-flow errors: one writer (`FlowState.record_error`) and its precedence, the first error stands."""

from __future__ import annotations

import asyncio

from mitmproxy.test import taddons, tflow

from ttft_relay import apis, state
from ttft_relay.faults import addons as faults
from ttft_relay.timing import addon as timing


def fresh() -> state.FlowState:
    return state.FlowState(api=apis.get(apis.OPENAI_CHAT))


def error_of(st: state.FlowState) -> tuple:
    return st.error, st.error_phase, st.error_status


def test_the_first_error_stands_with_what_was_known_of_it():
    st = fresh()
    st.record_error("first token timeout after 1 s", status=504)
    st.record_error("relay shutting down", phase="relay", status=503)  # the relay stops with it in flight
    st.record_error("Server disconnected.")  # the connection the relay closed fails the flow
    assert error_of(st) == ("first token timeout after 1 s", None, 504)  # its phase: from the marks


def test_what_the_relay_knows_of_mitmproxys_failure_goes_with_mitmproxys_text():
    st = fresh()
    st.record_error(None, status=504)  # a connect timeout: mitmproxy's text, the relay's status
    assert error_of(st) == (None, None, 504)
    st.record_error("upstream connect timeout after 5 s")
    assert error_of(st) == ("upstream connect timeout after 5 s", None, 504)
    trailers = fresh()
    trailers.record_error(None, phase="relay")
    trailers.record_error("HTTP/1 request trailers are not supported", phase="upstream_wait")
    assert error_of(trailers) == ("HTTP/1 request trailers are not supported", "relay", None)


def test_nothing_known_records_nothing():
    st = fresh()
    st.record_error(None)
    assert error_of(st) == (None, None, None)
    st.record_error("HTTP 500", phase="upstream_wait")
    assert error_of(st) == ("HTTP 500", "upstream_wait", None)


def test_a_flow_the_relay_stops_after_its_deadline_passed_keeps_the_deadline_as_its_cause():
    # The deadline closed the upstream connection; before the flow's error arrives the relay
    # stops. The record and the client's reply name the deadline, not the stop (the stop
    # overwrote it before `record_error`).
    async def run() -> state.FlowState:
        stop = faults.Shutdown()
        with taddons.context(stop) as tctx:
            tctx.configure(stop, relay_shutdown_grace=0)  # the grace would only wait for the flow to end
            f = tflow.tflow()
            st = state.attach(f, fresh())
            st.marks["forwarded"] = f.request.timestamp_start
            stop.in_flight.add(f)
            st.record_error("stream idle for 5 s", status=504)
            await stop.done()
        return st

    assert error_of(asyncio.run(run())) == ("stream idle for 5 s", None, 504)


def test_timing_records_the_relays_cause_over_mitmproxys_and_the_streams(tmp_path):
    addon = timing.Timing()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, relay_timing_log="", relay_timing_console=False)
        f = tflow.tflow(resp=True, err=True)
        f.response.status_code = 500
        st = state.attach(f, fresh())
        st.record_error("first token timeout after 1 s", status=504)
        addon.error(f)
        rec = f.metadata[timing.METADATA_KEY]
        assert (rec["error"], rec["status"]) == ("first token timeout after 1 s", 504)
        plain = tflow.tflow(resp=True)
        plain.response.status_code = 500
        state.attach(plain, fresh())
        addon.response(plain)
        rec = plain.metadata[timing.METADATA_KEY]
        assert (rec["error"], rec["error_phase"]) == ("HTTP 500", "upstream_wait")
