"""The Trim addon: options, byte identity when untouched, compressed bodies, failing open."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import orjson
import pytest
from mitmproxy import exceptions
from mitmproxy.net import encoding
from mitmproxy.test import taddons, tflow, tutils

from ttft_relay import apis, launch, state
from ttft_relay.trim import policy, tokens
from ttft_relay.trim import addon as trim_addon
from ttft_relay.trim.addon import HEADER, Trim


@pytest.fixture(scope="module")
def loaded() -> tokens.TokenizerLoader:
    loader = tokens.TokenizerLoader(tiktoken_cache=False)
    loader.load()
    return loader


def run(hook_result):
    """The request hook is a coroutine (mitmproxy awaits it): run it to its end."""
    return asyncio.run(hook_result)


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


def make_flow(raw: bytes, *, api: str = apis.OPENAI_CHAT, content_encoding: str | None = None, parsed=None):
    headers = [(b"content-type", b"application/json")]
    if content_encoding:
        headers.append((b"content-encoding", content_encoding.encode()))
        raw = encoding.encode(raw, content_encoding)
    headers.append((b"content-length", str(len(raw)).encode()))
    request = tutils.treq(path=b"/v1/chat/completions", headers=tutils.http.Headers(headers), content=b"")
    request.raw_content = raw
    flow = tflow.tflow(req=request, resp=tutils.tresp())
    body = json.loads(encoding.decode(raw, content_encoding) if content_encoding else raw) if parsed is None else parsed
    st = state.attach(flow, state.FlowState(api=apis.get(api), model=body.get("model"), request_json=body))
    return flow, st


def sent_messages(flow) -> list[dict]:
    return json.loads(flow.request.content)["messages"]


def test_untouched_request_keeps_its_exact_bytes(addon):
    # Odd spacing and key order: any re-serialization would show.
    raw = b'{ "messages" : [ {"content":"hi",  "role":"user"} ],\n "model":"gpt-4o" }'
    flow, st = make_flow(raw)
    before = flow.request.raw_content
    run(addon.request(flow))
    assert flow.request.raw_content is before
    assert st.trim["reason"] == "fits" and st.prompt_tokens == st.trim["tokens_after"] > 0
    addon.responseheaders(flow)
    assert HEADER not in flow.response.headers


def test_trims_and_says_so(addon):
    body = conversation()
    flow, st = make_flow(orjson.dumps(body))
    run(addon.request(flow))
    sent = sent_messages(flow)
    assert sent[0]["role"] == "system" and sent[-1] == {"role": "user", "content": "And now?"}
    assert len(sent) < len(body["messages"])
    assert flow.request.headers["content-length"] == str(len(flow.request.raw_content))
    assert st.trim["trimmed"] and st.trim["budget"] == 2000 and st.trim["budget_source"] == "user"
    assert st.trim["encoding"] == tokens.O200K and st.trim["count_source"] == tokens.EXACT  # from bpe-openai
    assert st.prompt_tokens == st.trim["tokens_after"] <= 2000
    addon.responseheaders(flow)
    assert flow.response.headers[HEADER] == policy.summary(st.trim)
    assert flow.response.headers[HEADER].startswith(f"dropped={st.trim['dropped_units']}; shrunk=")


@pytest.mark.parametrize("ce", ["gzip", "deflate", "br", "zstd"])
def test_compressed_request_bodies(addon, ce):
    flow, st = make_flow(orjson.dumps(conversation()), content_encoding=ce)
    run(addon.request(flow))
    assert st.trim["trimmed"]
    assert flow.request.headers["content-encoding"] == ce
    assert flow.request.headers["content-length"] == str(len(flow.request.raw_content))
    decoded = json.loads(encoding.decode(flow.request.raw_content, ce))
    assert decoded["messages"][-1]["content"] == "And now?"
    assert len(decoded["messages"]) == st.trim["messages_after"]


def test_compressed_untouched_body_is_not_recompressed(addon):
    flow, st = make_flow(orjson.dumps(conversation(1)), content_encoding="gzip")
    raw = flow.request.raw_content
    run(addon.request(flow))
    assert st.trim["reason"] == "fits" and flow.request.raw_content is raw


def test_window_budget_from_options(addon, tctx):
    tctx.configure(addon, relay_trim_max_tokens=0, relay_context_windows=["gpt-4o=5000"], relay_trim_reserve_tokens=1000)
    flow, st = make_flow(orjson.dumps(conversation()))
    run(addon.request(flow))
    assert st.trim["budget"] == 4000 and st.trim["budget_source"] == "configured" and st.trim["window"] == 5000
    assert st.trim["trimmed"]


def test_bad_context_windows_option(addon, tctx):
    with pytest.raises(exceptions.OptionsError, match="relay_context_windows"):
        tctx.configure(addon, relay_context_windows=["gpt-4o"])


def agent_loop(rounds: int) -> dict:
    """One question, then `rounds` tool calls and their results: nothing to drop, only to shrink."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Search on."}]
    for t in range(rounds):
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{t}", "type": "function", "function": {"name": "search", "arguments": '{"q": "relays"}'}}]},  # fmt: skip
            {"role": "tool", "tool_call_id": f"call_{t}", "content": f"Result {t}: " + "relays forward traffic " * 20},
        ]
    return {"model": "gpt-4o", "stream": True, "messages": messages}


@pytest.mark.parametrize("order", policy.SHRINK_ORDERS)
def test_shrink_order_option(addon, tctx, order):
    tctx.configure(addon, relay_trim_shrink_order=order, relay_trim_max_tokens=3000)
    flow, st = make_flow(orjson.dumps(agent_loop(30)))
    run(addon.request(flow))
    results = [m["content"] for m in sent_messages(flow) if m["role"] == "tool"]
    assert st.trim["trimmed"] and st.trim["dropped_messages"] == 0 and len(results) == 30
    shrunk = ["[ttft-relay: tool result removed" in r for r in results]
    assert not shrunk[-1] and 0 < sum(shrunk) == st.trim["shrunk_messages"] < 29  # the calls' arguments are short
    # Oldest first the model keeps what it read last; newest first, what it read first.
    assert shrunk[0] == (order == policy.OLDEST) and shrunk[-2] == (order == policy.NEWEST)


def test_bad_shrink_order_option(addon, tctx):
    with pytest.raises(exceptions.OptionsError, match="relay_trim_shrink_order: 'newer' is not one of oldest, newest"):
        tctx.configure(addon, relay_trim_shrink_order="newer")


def test_notice_option(addon, tctx):
    tctx.configure(addon, relay_trim_notice=True)
    flow, st = make_flow(orjson.dumps(conversation()))
    run(addon.request(flow))
    first_kept = [m for m in sent_messages(flow) if m["role"] == "user"][1]  # after the pinned first question
    assert first_kept["content"].startswith(f"[ttft-relay: {st.trim['dropped_units']} earlier turns")


def test_switched_off(addon, tctx):
    tctx.configure(addon, relay_trim=False)
    flow, st = make_flow(orjson.dumps(conversation()))
    raw = flow.request.raw_content
    run(addon.request(flow))
    assert flow.request.raw_content is raw and st.trim is None


def test_out_of_scope_and_untrimmable_flows(addon):
    flow = tflow.tflow()
    raw = flow.request.raw_content
    run(addon.request(flow))  # no FlowState: not the relay's business
    assert flow.request.raw_content is raw
    flow, st = make_flow(orjson.dumps({"contents": []}), api=apis.GEMINI)
    run(addon.request(flow))
    assert st.trim is None
    flow, st = make_flow(b"{}")
    st.request_json = None  # as for a body that did not parse
    run(addon.request(flow))
    assert st.trim is None


def test_no_tokenizer(addon):
    addon.tokenizers = tokens.TokenizerLoader(tiktoken_cache=False)  # never loaded
    flow, st = make_flow(orjson.dumps(conversation()))
    raw = flow.request.raw_content
    run(addon.request(flow))
    assert flow.request.raw_content is raw and st.trim["reason"] == "no tokenizer"


def test_failure_forwards_the_original_bytes_and_logs_once(addon, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("policy bug")

    monkeypatch.setattr(policy, "trim", broken)
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        flow, st = make_flow(orjson.dumps(conversation()))
        raw = flow.request.raw_content
        run(addon.request(flow))
        assert flow.request.raw_content is raw
        assert st.trim == policy.untouched_stats("error: RuntimeError: policy bug")
        addon.responseheaders(flow)
        assert HEADER not in flow.response.headers
    assert len([r for r in caplog.records if "Trimming failed" in r.getMessage()]) == 1


def test_unserializable_result_forwards_the_original_bytes(addon):
    # Python's json parses integers beyond 64 bits; orjson refuses to write them back.
    body = conversation()
    body["seed"] = 2**70
    raw = json.dumps(body).encode()
    flow, st = make_flow(raw, parsed=json.loads(raw))
    run(addon.request(flow))
    assert flow.request.raw_content == raw
    assert st.trim["reason"].startswith("error: ")


def test_over_budget_header(addon):
    # Over budget, the earlier turns still go: the smallest request, marked.
    body = conversation(2)
    body["messages"][-1]["content"] = "huge " * 5000
    flow, st = make_flow(orjson.dumps(body))
    run(addon.request(flow))
    assert st.trim["over_budget"] and st.trim["trimmed"] and st.trim["dropped_units"] == 2
    assert orjson.loads(flow.request.content)["messages"][-1] == body["messages"][-1]
    addon.responseheaders(flow)
    assert flow.response.headers[HEADER].startswith("dropped=2; ") and "; over_budget; " in flow.response.headers[HEADER]
    # Nothing can go (the head is the huge prompt): sent as it came.
    flow, st = make_flow(orjson.dumps(conversation(0) | {"messages": [body["messages"][0], body["messages"][-1]]}))
    raw = flow.request.raw_content
    run(addon.request(flow))
    assert flow.request.raw_content is raw and st.trim["over_budget"] and not st.trim["trimmed"]
    addon.responseheaders(flow)
    assert flow.response.headers[HEADER].startswith("over_budget; tokens=")


def test_the_tokenizers_loaded_before_mitmproxy_are_the_addons_and_said_once_it_runs(monkeypatch, caplog):
    monkeypatch.setattr(tokens, "_LOADERS", {})  # a fresh process's
    launch.load_tokenizers_early(["--set", "relay_trim=false"], "mitmdump")
    assert not tokens.loader_for(None).ready
    launch.load_tokenizers_early([], "mitmdump")  # as `ttft-relay run` does, before mitmproxy logs
    early = tokens.loader_for(None)
    assert early.ready
    loads = []
    monkeypatch.setattr(tokens, "load_o200k_file", lambda path, cache: loads.append(path))
    caplog.set_level(logging.INFO)
    trim = Trim()
    with taddons.context(trim) as tctx:
        tctx.configure(trim, relay_trim=True)
    assert trim.tokenizers is early and loads == []  # not loaded twice
    said = [r.getMessage() for r in caplog.records if r.name == tokens.__name__]
    assert said == ["tokenizer ready: cl100k_base, o200k_base (trimming on)"]


def test_tokenizers_load_when_configured_and_only_while_trimming_is_on(monkeypatch):
    trim = Trim()
    loads = []
    monkeypatch.setattr(tokens.TokenizerLoader, "load", lambda self: loads.append(self))
    with taddons.context(trim) as tctx:
        tctx.configure(trim, relay_trim=False)
        assert loads == []
        tctx.configure(trim, relay_trim=True)
        assert loads == [trim.tokenizers]
        tctx.configure(trim, relay_tiktoken_file="/nonexistent/o200k_base.tiktoken")
        assert loads[-1] is trim.tokenizers and trim.tokenizers.o200k_file == "/nonexistent/o200k_base.tiktoken"


def test_anthropic_long_context_header_and_prompt_tokens(addon, tctx):
    tctx.configure(addon, relay_trim_max_tokens=0)
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64000, "messages": [{"role": "user", "content": "hi"}]}
    flow, st = make_flow(orjson.dumps(body), api=apis.ANTHROPIC_MESSAGES)
    flow.request.headers["anthropic-beta"] = "context-1m-2025-08-07"
    run(addon.request(flow))
    assert st.trim["budget"] == 1_000_000 - 64000 and st.trim["reason"] == "fits"
    assert st.prompt_tokens == st.trim["tokens_after"] > 0


def test_unknown_model_is_still_counted(addon, tctx):
    tctx.configure(addon, relay_trim_max_tokens=0)
    flow, st = make_flow(orjson.dumps({"model": "my-llama", "messages": [{"role": "user", "content": "hi"}]}))
    run(addon.request(flow))
    assert st.trim["reason"].startswith("no budget") and st.prompt_tokens > 0


def test_counting_runs_in_the_worker_thread(addon, monkeypatch):
    threads = []
    real = policy.trim

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "trim", spy)
    flow, st = make_flow(orjson.dumps(conversation()))
    run(addon.request(flow))
    assert st.trim["trimmed"] and threads and threads[0].startswith("relay-trim")


def test_a_small_request_is_counted_on_the_event_loop_while_the_worker_is_idle(addon, monkeypatch):
    counted = []  # (messages, thread)
    entered, release = threading.Event(), threading.Event()
    real = policy.trim

    def spy(body, *args, **kwargs):
        counted.append((len(body["messages"]), threading.current_thread().name))
        if len(body["messages"]) > 1:  # the big one holds the worker
            entered.set()
            assert release.wait(10)
        return real(body, *args, **kwargs)

    monkeypatch.setattr(policy, "trim", spy)
    small = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert len(small) <= trim_addon.INLINE_MAX_BYTES

    async def scenario() -> list[state.FlowState]:
        flow, first = make_flow(small)
        await addon.request(flow)
        big_flow, big = make_flow(orjson.dumps(conversation()))
        busy = asyncio.create_task(addon.request(big_flow))
        await asyncio.to_thread(entered.wait, 10)
        flow, queued = make_flow(small)
        # Started at once, up to its wait: the worker's caches are in use, so it queues.
        behind = asyncio.Task(addon.request(flow), loop=asyncio.get_running_loop(), eager_start=True)
        release.set()
        await asyncio.gather(busy, behind)
        return [first, big, queued]

    results = run(scenario())
    loop_thread = threading.current_thread().name
    assert [(n, t == loop_thread) for n, t in counted] == [(1, True), (len(conversation()["messages"]), False), (1, False)]
    assert all(st.trim and st.prompt_tokens for st in results)
    same = [{k: v for k, v in st.trim.items() if k != "trim_ms"} for st in (results[0], results[2])]
    assert same[0] == same[1]  # the same stats wherever it was counted


def test_consecutive_requests_keep_their_cut(addon):
    body = conversation(60)
    sent = []
    for extra in range(3):
        body["messages"] += [{"role": "assistant", "content": f"ok {extra}"}, {"role": "user", "content": f"more {extra}"}]
        flow, st = make_flow(orjson.dumps(body))
        run(addon.request(flow))
        sent.append((st.trim["plan"], sent_messages(flow)))
    assert [plan for plan, _ in sent] == ["new", "kept", "kept"]
    assert sent[1][1][:-2] == sent[0][1] and sent[2][1][:-2] == sent[1][1]
