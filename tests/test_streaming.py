import gzip
import zlib

import brotli
import pytest
from mitmproxy import http
from mitmproxy.net import encoding

from ttft_relay import flows
from ttft_relay.stream import streaming


class RecordingWatcher:
    def __init__(self):
        self.fed = []

    def feed(self, chunk, now):
        self.fed.append(chunk)


def headers(**kv) -> http.Headers:
    return http.Headers(**{k.replace("_", "-"): v for k, v in kv.items()})


@pytest.mark.parametrize(
    "hdrs, asked, expected",
    [
        (headers(content_type="text/event-stream; charset=utf-8", content_length="10"), False, True),
        (headers(content_type="application/json", transfer_encoding="chunked"), False, True),
        (headers(content_type="application/json"), False, True),  # HTTP/2: no length
        (headers(content_type="application/json", content_length="12"), False, False),
        (headers(content_type="application/json", content_length="12"), True, True),
    ],
)
def test_should_stream(hdrs, asked, expected):
    assert streaming.should_stream(hdrs, asked) is expected


def test_tap_passes_chunks_through_unchanged_and_feeds_watcher():
    w = RecordingWatcher()
    tap = streaming.StreamTap(w, None, view_max=1024)
    chunks = [b"data: 1\n\n", b"data: 2\n", b"\n"]
    assert [tap(c) for c in chunks] == chunks
    assert tap(b"") == b""  # end of message passes as end of message
    assert w.fed == chunks
    assert tap.stored_body() == b"".join(chunks)


def test_tap_bounds_the_stored_body():
    tap = streaming.StreamTap(RecordingWatcher(), None, view_max=5)
    assert tap(b"abc") == b"abc"
    assert tap(b"defgh") == b"defgh"  # the client still gets everything
    assert tap(b"ijk") == b"ijk"
    assert tap.stored_body().startswith(b"abcde")
    assert tap.stored_body().endswith(streaming.TRUNCATED_NOTE)


def _compressors():
    def zstd_stream(data):
        return encoding.encode_zstd(data)

    return {
        "gzip": lambda d: gzip.compress(d),
        "deflate": lambda d: zlib.compress(d),
        "br": lambda d: brotli.compress(d),
        "zstd": zstd_stream,
    }


@pytest.mark.parametrize("enc", ["gzip", "deflate", "br", "zstd"])
def test_incremental_decoding_emits_data_before_the_end(enc):
    body = b"".join(b"data: {\"n\": %d}\n\n" % i for i in range(200))
    compressed = _compressors()[enc](body)
    tap = streaming.StreamTap(RecordingWatcher(), streaming.incremental_decoder(enc), view_max=1 << 20)
    out = []
    for i in range(0, len(compressed), 7):
        res = tap(compressed[i : i + 7])
        out.extend([res] if isinstance(res, bytes) else res)
        assert res != b""  # never an empty chunk mid-stream: clients read it as the end
    assert b"".join(out) == body


@pytest.mark.parametrize("enc", ["gzip", "deflate", "br", "zstd"])
def test_a_compressed_stream_is_decoded_no_further_than_its_bound(enc):
    body = b": " + b"x" * 1_000_000 + b"\n"
    compressed = _compressors()[enc](body)
    within = streaming.incremental_decoder(enc, len(body))
    assert within.decompress(compressed) == body  # exactly the bound: fine
    tap = streaming.StreamTap(RecordingWatcher(), streaming.incremental_decoder(enc, 1000), view_max=10)
    said = []
    tap.on_too_far = said.append
    assert tap(compressed) == [] and tap(b"more") == []  # the rest dropped
    assert said == ["the upstream's compressed stream expands beyond 1000 bytes when decoded"]


def test_unknown_encoding_has_no_decoder():
    assert streaming.incremental_decoder("compress") is None


def test_corrupt_compressed_stream_is_passed_on_not_raised():
    tap = streaming.StreamTap(RecordingWatcher(), streaming.incremental_decoder("gzip"), view_max=10)
    assert tap(b"definitely not gzip") == b"definitely not gzip"
    assert tap.decoder is None


def _flow_with_response(method="POST", path="/v1/responses", status=200, in_scope=True, **response_headers):
    from mitmproxy.test import tflow

    from ttft_relay import apis, state

    f = tflow.tflow(resp=True)
    f.request.method, f.request.path = method, path
    f.response.status_code = status
    f.response.headers.clear()
    f.response.headers.update({k.replace("_", "-"): v for k, v in response_headers.items()})
    if in_scope:
        state.attach(f, state.FlowState(api=apis.get(apis.OPENAI_RESPONSES), stream=True))
    return f


@pytest.mark.parametrize(
    "method, status, hdrs",
    [
        ("GET", 101, {"upgrade": "websocket", "connection": "Upgrade", "sec_websocket_accept": "x"}),
        ("POST", 204, {}),
        ("POST", 304, {"content_type": "text/event-stream"}),
        ("HEAD", 200, {"content_type": "text/event-stream"}),
        ("POST", 103, {"link": "</a>; rel=preload"}),
    ],
)
def test_responses_without_a_body_pass_exactly_as_received(method, status, hdrs):
    from mitmproxy.test import taddons

    addon = streaming.Streaming()
    with taddons.context(addon):
        f = _flow_with_response(method=method, status=status, **hdrs)
        before = f.response.headers.fields
        addon.responseheaders(f)
        assert f.response.headers.fields == before  # no chunked framing, no buffering hints
        assert f.response.stream is False
        assert not flows.carries_body(f.request, f.response)


def test_event_streams_out_of_scope_are_streamed_and_left_alone():
    from mitmproxy.test import taddons

    addon = streaming.Streaming()
    with taddons.context(addon):
        f = _flow_with_response(path="/events", in_scope=False, content_type="text/event-stream",
                                transfer_encoding="chunked")
        before = f.response.headers.fields
        addon.responseheaders(f)
        assert f.response.stream is True and f.response.headers.fields == before
        sized = _flow_with_response(path="/page", in_scope=False, content_type="text/html", content_length="5")
        addon.responseheaders(sized)
        assert sized.response.stream is False  # a body of known length that is no stream: mitmproxy's way


def test_relay_stream_off_streams_nothing():
    from mitmproxy.test import taddons

    addon = streaming.Streaming()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, relay_stream=False)
        f = _flow_with_response(path="/events", in_scope=False, content_type="text/event-stream")
        addon.responseheaders(f)
        assert f.response.stream is False
