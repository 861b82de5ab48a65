import re

import pytest
from mitmproxy.test import taddons, tflow

from ttft_relay import apis, scope, state


@pytest.mark.parametrize(
    "path, shape",
    [
        ("/v1/chat/completions", apis.OPENAI_CHAT),
        ("/v1/chat/completions?api-version=1", apis.OPENAI_CHAT),
        ("/v1/responses", apis.OPENAI_RESPONSES),
        ("/v1/messages", apis.ANTHROPIC_MESSAGES),
        ("/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", apis.GEMINI),
        ("/v1/embeddings", apis.OTHER),
        ("/v1/responses/resp_123", apis.OTHER),
        # The same endpoints under the prefixes providers put in front of them.
        ("/backend-api/codex/responses", apis.OPENAI_RESPONSES),
        ("/openai/deployments/my-gpt4o/chat/completions?api-version=2024-10-21", apis.OPENAI_CHAT),
        ("/openai/v1/responses", apis.OPENAI_RESPONSES),
        ("/api/v1/chat/completions", apis.OPENAI_CHAT),
        ("/v1beta/openai/chat/completions", apis.OPENAI_CHAT),
        ("/anthropic/v1/messages", apis.ANTHROPIC_MESSAGES),
        ("/v1/threads/thread_1/messages", apis.OTHER),  # OpenAI Assistants, not Anthropic's shape
    ],
)
def test_api_shape(path, shape):
    assert apis.for_path(path).name == shape


def test_model_and_stream():
    chat, anthropic, gemini = (apis.get(name) for name in (apis.OPENAI_CHAT, apis.ANTHROPIC_MESSAGES, apis.GEMINI))
    assert chat.model_and_stream("/v1/chat/completions", {"model": "gpt-4o", "stream": True}) == ("gpt-4o", True)
    assert chat.model_and_stream("/", {"model": 3, "stream": "yes"}) == (None, False)
    assert anthropic.model_and_stream("/", [1, 2]) == (None, False)
    assert gemini.model_and_stream("/v1beta/models/g-1:generateContent", None) == ("g-1", False)


def _flow(path: str, body: bytes, **headers):
    f = tflow.tflow()
    f.request.path = path
    f.request.headers.update(headers)
    f.request.content = body
    return f


def test_scope_addon_attaches_state_only_in_scope():
    sc = scope.Scope()
    with taddons.context(sc) as tctx:
        inside = _flow("/v1/chat/completions", b'{"model":"gpt-4o","stream":true}')
        outside = _flow("/index.html", b"")
        for f in (inside, outside):
            sc.requestheaders(f)
            sc.request(f)
        st = state.get(inside)
        assert st is not None and st.api is apis.get(apis.OPENAI_CHAT)
        assert (st.model, st.stream) == ("gpt-4o", True)
        assert state.get(outside) is None

        tctx.configure(sc, relay_scope="^/api/")
        f = _flow("/api/chat/completions", b"{}")
        sc.requestheaders(f)
        assert state.get(f) is not None


@pytest.mark.parametrize("body", [b"not json", b"\xff\xfe", b"[1,2]", b'"str"', b""])
def test_scope_addon_tolerates_bad_bodies(body):
    sc = scope.Scope()
    with taddons.context(sc):
        f = _flow("/v1/chat/completions", body)
        sc.requestheaders(f)
        sc.request(f)
        st = state.get(f)
        assert (st.model, st.stream) == (None, False)
        assert f.request.raw_content == body


def test_scope_addon_reads_compressed_bodies():
    sc = scope.Scope()
    with taddons.context(sc):
        f = _flow("/v1/messages", b"")
        f.request.headers["content-encoding"] = "gzip"
        f.request.content = b'{"model":"claude-sonnet-4","stream":true}'  # encodes to gzip
        assert f.request.raw_content != f.request.content
        sc.requestheaders(f)
        sc.request(f)
        assert state.get(f).model == "claude-sonnet-4"


def test_invalid_scope_regex_is_an_options_error():
    sc = scope.Scope()
    with taddons.context(sc) as tctx:
        with pytest.raises(Exception, match="relay_scope"):
            tctx.configure(sc, relay_scope="(")


def test_answered_requests_are_not_parsed():
    sc = scope.Scope()
    with taddons.context(sc):
        f = _flow("/v1/chat/completions", b'{"model":"gpt-4o"}')
        sc.requestheaders(f)
        f.response = tflow.tresp(status_code=401)
        sc.request(f)
        st = state.get(f)
        assert st is not None and st.request_json is None and st.model is None


@pytest.mark.parametrize(
    "path, inside",
    [
        ("/v1/chat/completions", True),
        ("/backend-api/codex/responses", True),
        ("/openai/deployments/d/chat/completions?api-version=1", True),
        ("/openai/v1/responses", True),
        ("/api/v1/chat/completions", True),
        ("/v1beta/openai/chat/completions", True),
        ("/anthropic/v1/messages", True),
        ("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", True),
        ("/v1/realtime?model=gpt-realtime", True),
        ("/health", False),
        ("/", False),
        ("/v2/models", False),
        ("/static/messages-page.js", False),
    ],
)
def test_default_scope_knows_where_llm_apis_live(path, inside):
    assert bool(re.search(scope.DEFAULT_SCOPE, path)) is inside


def test_an_upgrade_request_is_a_websocket_flow():
    sc = scope.Scope()
    with taddons.context(sc):
        f = _flow("/v1/responses", b"", upgrade="websocket", connection="Upgrade")
        sc.requestheaders(f)
        assert state.get(f).transport == "websocket"
        g = _flow("/v1/responses", b"{}")
        sc.requestheaders(g)
        assert state.get(g).transport == "http"
