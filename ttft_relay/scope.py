"""Which LLM API a request speaks, and what it asks for.

The relay only touches flows whose path matches its scope; within scope the path
decides the API (one module of `ttft_relay/apis/` each), which in turn decides how the
body is trimmed and how the response stream is read. That is decided here, once: the
`Scope` addon attaches the per-flow state the other addons share, with the request's
`Api` in it, so that none of them looks an API up again. The functions are pure.
"""

from __future__ import annotations

import re
import sys
import zlib
from typing import Any

import orjson
from mitmproxy import ctx, exceptions, http

from . import apis, state
from .faults import apierrors
from .timing import record

DEFAULT_SCOPE = "|".join((r"/v1(?:beta|alpha)?/", *(api.scope for api in apis.ALL if api.scope)))
"""Where LLM APIs live: a version segment anywhere in the path (`/v1/`, OpenRouter's
`/api/v1/`, Azure's `/openai/v1/`, Gemini's `/v1beta/`), or an API's endpoint under
any prefix (each API module's `scope`: Azure's `/openai/deployments/<d>/chat/completions`,
Codex with a ChatGPT sign-in at `/backend-api/codex/responses`, the Anthropic-compatible
base URLs providers give, like `/anthropic/v1/messages`, Gemini's native methods)."""


def is_websocket_upgrade(headers: http.Headers) -> bool:
    """An upgrade request to a WebSocket (RFC 6455: `Upgrade: websocket`)."""
    return "websocket" in headers.get("upgrade", "").lower()


class Scope:
    """Decides which flows are the relay's: attaches a `FlowState` to each request
    whose path matches `relay_scope`, and reads the model and stream flag from its
    body (parsed, kept until the flow's record is out). Flows out of scope get no state,
    and every other relay addon leaves them alone."""

    def __init__(self) -> None:
        self.pattern = re.compile(DEFAULT_SCOPE)

    def load(self, loader) -> None:
        loader.add_option(
            "relay_scope",
            str,
            DEFAULT_SCOPE,
            "Regular expression over the request path (with query) that selects "
            "the flows the relay streams, times and trims.",
        )

    def configure(self, updated) -> None:
        if "relay_scope" in updated:
            try:
                self.pattern = re.compile(ctx.options.relay_scope)
            except re.error as e:
                raise exceptions.OptionsError(f"relay_scope is not a valid regex: {e}") from e

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        path = flow.request.path
        if self.pattern.search(path):
            st = state.attach(flow, state.FlowState(api=apis.for_path(path)))
            if is_websocket_upgrade(flow.request.headers):
                st.transport = record.WEBSOCKET

    def request(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or flow.response is not None:
            # Already answered by the relay (e.g. refused): no body work for it.
            return
        try:
            st.request_json = parse_json_body(flow.request)
        except BodyTooLarge as e:
            st.record_error(str(e), phase="relay", status=413)  # refused here: nothing went upstream
            flow.response = apierrors.error_response(st.api, 413, str(e))
            return
        # A malformed body yields (None, False), not an error: the relay forwards what it
        # does not understand.
        st.model, st.stream = st.api.model_and_stream(flow.request.path, st.request_json)
        st.prefill_traits = st.api.prefill_traits(st.request_json)
        if st.model is None and st.transport == record.WEBSOCKET:
            st.model = flow.request.query.get("model")  # the Realtime API's ?model=

    def timing_record(self, rec: record.Record, flow: http.HTTPFlow) -> None:
        """The flow's record is judged and out: nothing reads its parsed body any more
        (`FlowState.request_json`), which a flow kept in mitmweb would keep for its life."""
        if (st := state.get(flow)) is not None:
            st.request_json = None


MAX_DECODED_BODY = 64 * 1024 * 1024
"""Largest request body (bytes, after decompression) the relay parses as JSON. A body
beyond it is not parsed (forwarded untouched, never trimmed); a compressed one is never
expanded beyond it (a 1.7 KB brotli body can expand to 1 GB): it is refused with 413."""


class BodyTooLarge(ValueError):
    """A compressed request body that expands beyond the limit."""


def parse_json_body(request: http.Request, max_bytes: int = MAX_DECODED_BODY) -> Any:
    """The request body as parsed JSON, or None when it is absent, undecodable, larger
    than `max_bytes` or not JSON: the relay then forwards it untouched.

    Raises BodyTooLarge for a compressed body that would expand beyond `max_bytes`; it
    is decompressed no further than that.
    """
    if request.raw_content is None:  # streamed request body: not ours to read
        return None
    encoding = request.headers.get("content-encoding", "").strip().lower()
    try:
        body = request.raw_content if encoding in ("", "identity") else decompress(request.raw_content, encoding, max_bytes)
    except BodyTooLarge:
        raise
    except Exception:  # unknown or corrupt encoding: zlib.error, brotli.error, ZstdError, ValueError
        return None
    if not body or len(body) > max_bytes:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def decompress(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """`data` decoded as mitmproxy would (gzip/zlib, deflate, br, zstd), but never to more
    than `max_bytes`: BodyTooLarge beyond, ValueError for an encoding it does not know or
    a body that ends early."""
    too_large = BodyTooLarge(f"request body expands beyond {max_bytes // (1024 * 1024)} MiB when decompressed")
    if encoding in ("gzip", "x-gzip", "deflate"):
        # gzip: zlib's header auto-detection, as mitmproxy; deflate: zlib-wrapped, else raw
        attempts = (47,) if encoding != "deflate" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)
        for i, wbits in enumerate(attempts):
            decoder = zlib.decompressobj(wbits)
            try:
                out = decoder.decompress(data, max_bytes + 1)
            except zlib.error:
                if i + 1 < len(attempts):
                    continue
                raise
            if len(out) > max_bytes or decoder.unconsumed_tail:
                raise too_large
            if not decoder.eof:
                raise ValueError("compressed body ends early")
            return out
    if encoding == "br":
        import brotli  # mitmproxy depends on it

        decoder = brotli.Decompressor()
        out = decoder.process(data, output_buffer_limit=max_bytes + 1)
        if len(out) > max_bytes or not decoder.can_accept_more_data():
            raise too_large
        if not decoder.is_finished():
            raise ValueError("compressed body ends early")
        return out
    if encoding == "zstd":
        # As mitmproxy chooses (net/encoding.py): the standard library's from 3.14 on.
        if sys.version_info >= (3, 14):
            from compression import zstd
        else:
            from backports import zstd
        frames, rest = bytearray(), data
        while rest:  # one decompressor per frame, as zstd.decompress does
            frame = zstd.ZstdDecompressor()
            frames += frame.decompress(rest, max_bytes + 1 - len(frames))
            if len(frames) > max_bytes or not frame.needs_input and not frame.eof:
                raise too_large
            if not frame.eof:
                raise ValueError("compressed body ends early")
            rest = frame.unused_data
        return bytes(frames)
    raise ValueError(f"unknown content-encoding {encoding!r}")
