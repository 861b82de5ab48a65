"""What the relay reads of a mitmproxy flow the same way wherever it reads it: which
upstream the request goes to, whose access key sent it, and whether its answer carries a
body (pure)."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable

from mitmproxy import http
from mitmproxy.net.http import http1
from mitmproxy.proxy import mode_specs


def upstream_name(flow: http.HTTPFlow) -> str:
    """The upstream as "host", or "host:port" on a non-default port."""
    req = flow.request
    mode = flow.client_conn.proxy_mode
    if not req.host and isinstance(mode, mode_specs.ReverseMode):
        # Refused before mitmproxy filled in the target (header validation): the listener's.
        (host, port), default = mode.address, 443 if mode.scheme in ("https", "http3") else 80
        return host if port == default else f"{host}:{port}"
    default = 443 if req.scheme == "https" else 80
    return req.host if req.port == default else f"{req.host}:{req.port}"


_client_keys: weakref.WeakKeyDictionary[http.HTTPFlow, str] = weakref.WeakKeyDictionary()


def note_client_key(flow: http.HTTPFlow, credentials: Iterable[str]) -> None:
    """Remember whose key sent `flow` (the credentials the client presented: a relay access
    key, or its own API key), before the relay swaps a relay key for the upstream's."""
    creds = sorted(credentials)
    if not creds:
        return
    h = hashlib.blake2b(b"\0".join(c.encode("utf-8", "surrogatepass") for c in creds), digest_size=6,
                        person=b"ttft-relay-key")
    _client_keys[flow] = h.hexdigest()


def client_key(flow: http.HTTPFlow) -> str:
    """A short digest of the access key that sent `flow`, never the key; "" when it sent none.
    What the relay learns from one key's requests is told apart from another's by it."""
    return _client_keys.get(flow, "")


def carries_body(request: http.Request, response: http.Response) -> bool:
    """Whether a response has a body to stream: not an upgrade or other 1xx, not a
    204 or 304, not the answer to HEAD or CONNECT (HTTP/1.1's rules, RFC 9112 6.3,
    as mitmproxy reads them). A response whose framing headers mitmproxy cannot read
    is left to mitmproxy as well."""
    try:
        return http1.expected_http_body_size(request, response) != 0
    except ValueError:
        return False
