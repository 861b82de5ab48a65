"""scope.parse_json_body: request bodies are decompressed no further than a limit, and a
body that would expand beyond it is refused with a 413 in the API's format."""

from __future__ import annotations

import brotli
import orjson
import pytest
from mitmproxy.net import encoding
from mitmproxy.test import tflow

from ttft_relay import scope




def request_with(raw: bytes, ce: str | None):
    f = tflow.tflow()
    f.request.headers.clear()
    if ce:
        f.request.headers["content-encoding"] = ce
    f.request.raw_content = raw
    return f


@pytest.mark.parametrize("ce", ["gzip", "deflate", "br", "zstd", "identity", None])
def test_parse_json_body_decodes_what_mitmproxy_decodes(ce):
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hé " * 1000}]}
    raw = orjson.dumps(body)
    f = request_with(encoding.encode(raw, ce) if ce else raw, ce)
    assert scope.parse_json_body(f.request) == body


def test_abrotli_bomb_is_never_expanded_beyond_the_limit():
    bomb = brotli.compress(b'{"messages":[{"role":"user","content":"' + b"a" * 200_000_000 + b'"}]}', quality=11)
    assert len(bomb) < 2000
    f = request_with(bomb, "br")
    with pytest.raises(scope.BodyTooLarge, match="expands beyond 64 MiB"):
        scope.parse_json_body(f.request)
    with pytest.raises(scope.BodyTooLarge):
        scope.parse_json_body(f.request, max_bytes=1000)


@pytest.mark.parametrize("ce", ["gzip", "deflate", "zstd"])
def test_other_bombs_stop_at_the_limit_too(ce):
    f = request_with(encoding.encode(b"[" + b"0," * 5_000_000 + b"0]", ce), ce)
    with pytest.raises(scope.BodyTooLarge):
        scope.parse_json_body(f.request, max_bytes=1_000_000)
    assert scope.parse_json_body(f.request, max_bytes=20_000_000)[-1] == 0


@pytest.mark.parametrize("raw, ce", [(b"\x1f\x8b garbage", "gzip"), (b"nope", "br"), (b"nope", "zstd"),
                                     (b"{}", "compress"), (encoding.encode(b'{"a": 1}', "gzip")[:-12], "gzip")])
def test_corrupt_or_unknownencodings_are_left_alone(raw, ce):
    assert scope.parse_json_body(request_with(raw, ce).request) is None


def test_uncompressed_body_over_the_limit_is_not_parsed():
    raw = orjson.dumps({"messages": ["x" * 2000]})
    assert scope.parse_json_body(request_with(raw, None).request, max_bytes=1000) is None


def test_zstd_with_two_frames():
    from backports import zstd

    raw = zstd.compress(b'{"a": ') + zstd.compress(b"1}")
    assert scope.parse_json_body(request_with(raw, "zstd").request) == {"a": 1}


def test_scope_refuses_a_bomb_with_413_in_the_apis_format():
    s = scope.Scope()
    f = request_with(brotli.compress(b" " * 100_000_000, quality=11), "br")
    f.request.path = "/v1/messages"
    f.response = None
    s.requestheaders(f)
    s.request(f)
    assert f.response.status_code == 413
    assert orjson.loads(f.response.content)["error"]["type"] == "request_too_large"
