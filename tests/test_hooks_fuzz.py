"""Fuzz the relay's hooks in the order relay.py runs them: random paths, headers, request
bodies, response heads, streamed chunks, and an ending (response, upstream error, client
gone). mitmproxy runs all relay addons inside one script, and an exception in one addon's
hook skips every later addon for that event (the timing record first of all), so no hook
may raise, whatever arrives, and every in-scope flow gets exactly one record.
"""

from __future__ import annotations

import asyncio
import inspect

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy import flow as mflow
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from ttft_relay import relay, scope, state
from ttft_relay.faults import addons as faults
from ttft_relay.stream import streaming
from ttft_relay.timing import addon as timing
from ttft_relay.trim import addon as trim
from ttft_relay.trim import tokens

PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/embeddings",
         "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", "/v1beta/models/x:generateContent",
         "/other", "/v1/", "/v1/chat/completions?x=%ff"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "stream", "messages", "role", "content", "input", "system", "tools", "type",
                         "text", "max_tokens", "tool_calls", "id", "contents", "parts"]), children, max_size=5),
    max_leaves=25,
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(orjson.dumps),
    st.builds(lambda m, s: orjson.dumps({"model": "gpt-4o", "stream": s, "messages": m}),
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
                                              "content": json_values}), max_size=6), st.booleans()),
)
header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20)
request_headers = st.dictionaries(
    st.sampled_from(["content-type", "content-encoding", "accept-encoding", "x-request-id", "authorization"]),
    header_values, max_size=4)
response_headers = st.dictionaries(
    st.sampled_from(["content-type", "content-encoding", "content-length", "transfer-encoding"]),
    st.sampled_from(["text/event-stream", "application/json", "gzip", "br", "zstd", "deflate", "identity",
                     "chunked", "12", "x"]), max_size=4)
chunks = st.lists(st.one_of(st.binary(max_size=120), st.sampled_from([
    b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', b"event: error\ndata: {}\n\n", b"data: [DONE]\n\n",
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"x"}}\n\n', b"\r", b"\n"])),
    max_size=8)
endings = st.sampled_from(["response", "upstream error", "client gone", "before head"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), method=st.sampled_from(["POST", "GET", "PUT"]), body=bodies,
       req_headers=request_headers, status=st.sampled_from([200, 400, 429, 500, 101]), resp_headers=response_headers,
       pieces=chunks, ending=endings, budget=st.sampled_from([0, 50]))
def test_no_hook_raises_and_each_in_scope_flow_gets_one_record(tmp_path, loop, loaded_tokenizers, path, method, body,
                                                               req_headers, status, resp_headers, pieces, ending, budget):
    loop.run_until_complete(_run_flow(tmp_path, loaded_tokenizers, path, method, body, req_headers, status, resp_headers,
                          pieces, ending, budget))


def in_relays_order(*addons):
    """`addons` in the order relay.py composes them: reordering relay.py reorders this test."""
    order = [type(addon) for addon in relay.addons]
    return sorted(addons, key=lambda addon: order.index(type(addon)))


async def _run_flow(tmp_path, loaded, path, method, body, req_headers, status, resp_headers, pieces, ending, budget):
    trimmer = trim.Trim()
    trimmer.tokenizers = loaded
    addons = in_relays_order(scope.Scope(), streaming.Streaming(), trimmer, faults.FailedConnects(),
                             faults.Deadlines(), timing.Timing(), faults.ErrorReplies())
    of = {type(addon): addon for addon in addons}
    log = tmp_path / "timing.jsonl"
    log.unlink(missing_ok=True)
    with taddons.context(*addons) as tctx:
        tctx.configure(of[timing.Timing], relay_timing_log=str(log))
        tctx.configure(trimmer, relay_trim_max_tokens=budget)

        async def hook(name: str, f: http.HTTPFlow) -> None:
            for addon in addons:
                if (fn := getattr(addon, name, None)) and inspect.isawaitable(result := fn(f)):
                    await result  # as mitmproxy does

        f = tflow.tflow()
        f.request.method, f.request.path = method, path
        f.request.headers.clear()
        f.request.headers.update(req_headers)
        f.request.raw_content = body
        await hook("requestheaders", f)
        await hook("request", f)
        if ending == "before head":
            f.error = mflow.Error("Connection refused")
            await hook("error", f)
        else:
            f.response = http.Response.make(status, b"", resp_headers)
            f.response.raw_content = None
            await hook("responseheaders", f)
            tap = f.response.stream
            for piece in pieces:
                if callable(tap):
                    out = tap(piece)
                    assert out != b"" or piece == b""  # never an end-of-body chunk mid-stream
            if ending == "response":
                if callable(tap):
                    tap(b"")
                f.response.timestamp_end = f.response.timestamp_start
                await hook("response", f)
            else:
                f.error = mflow.Error("Client disconnected." if ending == "client gone" else "peer reset")
                await hook("error", f)
            st = state.get(f)
            if st is not None:
                # What the seam would ask for: never raises, and is the API's error or nothing.
                reply = of[faults.ErrorReplies].render(f, "peer reset", head_sent=True)
                assert reply is None or reply[0] is None
        in_scope = state.get(f) is not None
        assert of[faults.Deadlines].timers == {}
        for addon in addons:
            if fn := getattr(addon, "done", None):
                fn()
    recs = log.read_bytes().splitlines() if log.exists() else []
    assert len(recs) == (1 if in_scope else 0)


@pytest.fixture(scope="module")
def loop():
    """One event loop for every example: mitmproxy's log handler keeps the loop it was made on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def loaded_tokenizers() -> tokens.TokenizerLoader:
    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    loader.load()
    return loader
