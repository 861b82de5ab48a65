"""HTTP hygiene: what no peer should be sent, whatever the client or the upstream wrote.

    FieldSyntax     no header value with CR, LF or NUL, no unknown HTTP version passes:
                    a request with them is refused, an answer's are replaced by spaces.
    OriginForm      reverse listeners send the configured upstream's origin-form
                    target, never a client's absolute-form one.
    RequestFraming  an HTTP/2 request body goes to an HTTP/1 upstream with its length.
"""

from __future__ import annotations

import logging
import re
import weakref

from mitmproxy import http

from .. import state
from ..faults import apierrors
from ..patches import pins
from ..patches.fixes import answer_on_head
from ..text import cut_text
from .exposure import is_http_reverse
from .refusals import api_shape

logger = logging.getLogger(__name__)


class OriginForm:
    """A reverse listener sends every request to its configured upstream, so the
    target it sends is that upstream's origin-form path. mitmproxy connects to the
    configured upstream but keeps an absolute-form target (`POST
    https://evil.example/v1/…`) in the request line it sends: with relay keys that
    request would carry the upstream key, addressed to someone else. (HTTP/2's
    `:authority` is the Host header, which mitmproxy sets to the upstream already.)"""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if request.authority and request.http_version.startswith("HTTP/1") and is_http_reverse(
            flow.client_conn.proxy_mode
        ):
            request.authority = ""


class RequestFraming:
    """Every request goes upstream with its body's length. HTTP/2 requests need no
    Content-Length (the stream's end ends the body), and mitmproxy translates one for
    an HTTP/1 upstream without adding it: the upstream reads a request without a body,
    then the body's bytes as the start of another request (a body that is itself a
    request head would be smuggled in). The relay buffers request bodies, so the
    length is known by the `request` hook; a Transfer-Encoding is left to frame it."""

    def request(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if (
            request.raw_content
            and request.http_version == "HTTP/2.0"
            and "content-length" not in request.headers
            and "transfer-encoding" not in request.headers
        ):
            request.headers["content-length"] = str(len(request.raw_content))


_UNSAFE_IN_VALUES = re.compile(r"[\r\n\x00]")
HTTP_VERSIONS = frozenset({"HTTP/1.0", "HTTP/1.1", "HTTP/2.0", "HTTP/3"})


def unsafe_fields(headers: http.Headers) -> list[str]:
    """The names of the fields whose values hold a CR, LF or NUL."""
    return [name for name, value in headers.items(multi=True) if _UNSAFE_IN_VALUES.search(value)]


class FieldSyntax:
    """What no HTTP/1 peer should be sent: header values with CR, LF or NUL in them (RFC 9110
    5.5: a recipient MUST reject the message or replace each with SP; a bare CR is a line end
    to some servers: a header smuggled in), and a version the relay does not speak
    (`HTTP/9.9`). mitmproxy passed both on verbatim. A request with them is refused on its
    head (400, or 505 for the version), in the API's format where the path is one; an
    upstream's answer has them replaced by SP."""

    def __init__(self) -> None:
        self.refused: weakref.WeakKeyDictionary[http.HTTPFlow, str] = weakref.WeakKeyDictionary()

    def load(self, loader) -> None:
        if pins.on(answer_on_head):
            answer_on_head.install(by="field syntax")

    def done(self) -> None:
        answer_on_head.uninstall(by="field syntax")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if request.http_version not in HTTP_VERSIONS:
            status, message = 505, f"HTTP version {request.http_version!r} not supported (HTTP/1.1 or HTTP/2)"
        elif names := unsafe_fields(request.headers):
            status, message = 400, f"header value with CR, LF or NUL in it: {', '.join(sorted(set(names)))}"
        else:
            return
        message = cut_text(message)
        self.refused[flow] = message
        answer_on_head.answer_now(flow, apierrors.error_response(api_shape(request), status, message,
                                                                 {"connection": "close"}))

    def error(self, flow: http.HTTPFlow) -> None:
        # As for AccessKeys: the scope addon attached its state meanwhile; the record says why.
        st = state.get(flow)
        if st is not None and (reason := self.refused.get(flow)) is not None:
            st.record_error(reason, phase="relay")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        headers = flow.response.headers if flow.response is not None else None
        if headers is None or not (names := unsafe_fields(headers)):
            return
        logger.debug("%s: CR, LF or NUL in the upstream's %s replaced by spaces", flow.request.host, names)
        for name in {n.lower() for n in names}:
            headers.set_all(name, [_UNSAFE_IN_VALUES.sub(" ", v) for v in headers.get_all(name)])
