"""The Trim addon: options, byte identity when untouched, compressed bodies, failing open."""

from __future__ import annotations

import json
import logging

import orjson
import pytest
from mitmproxy import exceptions
from mitmproxy.net import encoding
from mitmproxy.test import taddons, tflow, tutils

from addons import scope, state, tokens, trimming
from addons.trim import HEADER, Trim


@pytest.fixture(scope="module")
def loaded() -> tokens.TokenizerLoader:
    loader = tokens.TokenizerLoader(download=None)
    loader.start()
    assert loader.wait(60)
    return loader


@pytest.fixture
def tctx(loaded):
    trim = Trim()
    trim.tokenizers = loaded
    with taddons.context(trim) as tctx:
        tctx.configure(trim, relay_trim_max_tokens=2000)
        yield tctx


@pytest.fixture
def addon(tctx) -> Trim:
    return tctx.master.addons.get("trim")


def conversation(turns: int = 30) -> dict:
    messages = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"Question {t}: " + "tell me more about relays " * 20},
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{t}", "type": "function", "function": {"name": "search", "arguments": '{"q": "relays"}'}}]},  # fmt: skip
            {"role": "tool", "tool_call_id": f"call_{t}", "content": "Relays forward traffic. " * 20},
            {"role": "assistant", "content": "Relays forward traffic."},
        ]
    messages.append({"role": "user", "content": "And now?"})
    return {"model": "gpt-4o", "stream": True, "messages": messages}


def make_flow(raw: bytes, *, api: str = scope.OPENAI_CHAT, content_encoding: str | None = None, parsed=None):
    headers = [(b"content-type", b"application/json")]
    if content_encoding:
        headers.append((b"content-encoding", content_encoding.encode()))
        raw = encoding.encode(raw, content_encoding)
    headers.append((b"content-length", str(len(raw)).encode()))
    request = tutils.treq(path=b"/v1/chat/completions", headers=tutils.http.Headers(headers), content=b"")
    request.raw_content = raw
    flow = tflow.tflow(req=request, resp=tutils.tresp())
    body = json.loads(encoding.decode(raw, content_encoding) if content_encoding else raw) if parsed is None else parsed
    st = state.attach(flow, state.FlowState(api=api, model=body.get("model"), request_json=body))
    return flow, st


def sent_messages(flow) -> list[dict]:
    return json.loads(flow.request.content)["messages"]


def test_untouched_request_keeps_its_exact_bytes(addon):
    # Odd spacing and key order: any re-serialization would show.
    raw = b'{ "messages" : [ {"content":"hi",  "role":"user"} ],\n "model":"gpt-4o" }'
    flow, st = make_flow(raw)
    before = flow.request.raw_content
    addon.request(flow)
    assert flow.request.raw_content is before
    assert st.trim["reason"] == "fits" and st.prompt_tokens == st.trim["tokens_after"] > 0
    addon.responseheaders(flow)
    assert HEADER not in flow.response.headers


def test_trims_and_says_so(addon):
    body = conversation()
    flow, st = make_flow(orjson.dumps(body))
    addon.request(flow)
    sent = sent_messages(flow)
    assert sent[0]["role"] == "system" and sent[-1] == {"role": "user", "content": "And now?"}
    assert len(sent) < len(body["messages"])
    assert flow.request.headers["content-length"] == str(len(flow.request.raw_content))
    assert st.trim["trimmed"] and st.trim["budget"] == 2000 and st.trim["budget_source"] == "user"
    assert st.trim["encoding"] == tokens.CL100K  # o200k_base is not available offline
    assert st.prompt_tokens == st.trim["tokens_after"] <= 2000
    addon.responseheaders(flow)
    assert flow.response.headers[HEADER] == trimming.summary(st.trim)
    assert flow.response.headers[HEADER].startswith(f"dropped={st.trim['dropped_units']}; messages=")


@pytest.mark.parametrize("ce", ["gzip", "deflate", "br", "zstd"])
def test_compressed_request_bodies(addon, ce):
    flow, st = make_flow(orjson.dumps(conversation()), content_encoding=ce)
    addon.request(flow)
    assert st.trim["trimmed"]
    assert flow.request.headers["content-encoding"] == ce
    assert flow.request.headers["content-length"] == str(len(flow.request.raw_content))
    decoded = json.loads(encoding.decode(flow.request.raw_content, ce))
    assert decoded["messages"][-1]["content"] == "And now?"
    assert len(decoded["messages"]) == st.trim["messages_after"]


def test_compressed_untouched_body_is_not_recompressed(addon):
    flow, st = make_flow(orjson.dumps(conversation(1)), content_encoding="gzip")
    raw = flow.request.raw_content
    addon.request(flow)
    assert st.trim["reason"] == "fits" and flow.request.raw_content is raw


def test_window_budget_from_options(addon, tctx):
    tctx.configure(addon, relay_trim_max_tokens=0, relay_context_windows=["gpt-4o=5000"], relay_trim_reserve_tokens=1000)
    flow, st = make_flow(orjson.dumps(conversation()))
    addon.request(flow)
    assert st.trim["budget"] == 4000 and st.trim["budget_source"] == "window"
    assert st.trim["trimmed"]


def test_bad_context_windows_option(addon, tctx):
    with pytest.raises(exceptions.OptionsError, match="relay_context_windows"):
        tctx.configure(addon, relay_context_windows=["gpt-4o"])


def test_notice_option(addon, tctx):
    tctx.configure(addon, relay_trim_notice=True)
    flow, st = make_flow(orjson.dumps(conversation()))
    addon.request(flow)
    first_user = next(m for m in sent_messages(flow) if m["role"] == "user")
    assert first_user["content"].startswith(f"[ttft-relay: {st.trim['dropped_units']} earlier turns")


def test_switched_off(addon, tctx):
    tctx.configure(addon, relay_trim=False)
    flow, st = make_flow(orjson.dumps(conversation()))
    raw = flow.request.raw_content
    addon.request(flow)
    assert flow.request.raw_content is raw and st.trim is None


def test_out_of_scope_and_untrimmable_flows(addon):
    flow = tflow.tflow()
    raw = flow.request.raw_content
    addon.request(flow)  # no FlowState: not the relay's business
    assert flow.request.raw_content is raw
    flow, st = make_flow(orjson.dumps({"contents": []}), api=scope.GEMINI)
    addon.request(flow)
    assert st.trim is None
    flow, st = make_flow(b"{}")
    st.request_json = None  # as for a body that did not parse
    addon.request(flow)
    assert st.trim is None


def test_tokenizer_still_loading(addon):
    addon.tokenizers = tokens.TokenizerLoader(download=None)  # not started
    flow, st = make_flow(orjson.dumps(conversation()))
    raw = flow.request.raw_content
    addon.request(flow)
    assert flow.request.raw_content is raw and st.trim["reason"] == "tokenizer loading"


def test_failure_forwards_the_original_bytes_and_logs_once(addon, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("policy bug")

    monkeypatch.setattr(trimming, "trim", broken)
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        flow, st = make_flow(orjson.dumps(conversation()))
        raw = flow.request.raw_content
        addon.request(flow)
        assert flow.request.raw_content is raw
        assert st.trim == trimming.untouched_stats("error: RuntimeError: policy bug")
        addon.responseheaders(flow)
        assert HEADER not in flow.response.headers
    assert len([r for r in caplog.records if "Trimming failed" in r.getMessage()]) == 1


def test_unserializable_result_forwards_the_original_bytes(addon):
    # Python's json parses integers beyond 64 bits; orjson refuses to write them back.
    body = conversation()
    body["seed"] = 2**70
    raw = json.dumps(body).encode()
    flow, st = make_flow(raw, parsed=json.loads(raw))
    addon.request(flow)
    assert flow.request.raw_content == raw
    assert st.trim["reason"].startswith("error: ")


def test_over_budget_header(addon):
    body = conversation(2)
    body["messages"][-1]["content"] = "huge " * 5000
    flow, st = make_flow(orjson.dumps(body))
    raw = flow.request.raw_content
    addon.request(flow)
    assert flow.request.raw_content is raw and st.trim["over_budget"]
    addon.responseheaders(flow)
    assert flow.response.headers[HEADER].startswith("over_budget; tokens=")


def test_running_starts_loading_without_waiting(monkeypatch):
    trim = Trim()
    started = []
    monkeypatch.setattr(trim.tokenizers, "start", lambda: started.append(True))
    with taddons.context(trim) as tctx:
        tctx.configure(trim)
        trim.running()
        assert started == [True]
        # a new tiktoken file while running: a new loader, started at once
        tctx.configure(trim, relay_tiktoken_file="/nonexistent/o200k_base.tiktoken")
        assert trim.tokenizers.o200k_file == "/nonexistent/o200k_base.tiktoken"
        assert trim.tokenizers.wait(60) and trim.tokenizers.ready


def test_no_tokenizer_loading_while_trimming_is_off(monkeypatch):
    trim = Trim()
    started = []
    monkeypatch.setattr(trim.tokenizers, "start", lambda: started.append(True))
    with taddons.context(trim) as tctx:
        tctx.configure(trim, relay_trim=False)
        trim.running()
        assert started == []
        tctx.configure(trim, relay_trim=True)  # switched on while running: load now
        assert started == [True]
