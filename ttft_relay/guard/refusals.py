"""The relay's own answer to a request it does not let through, in its client's API's error format."""

from __future__ import annotations

from mitmproxy import http

from .. import apis
from ..apis.api import Api
from ..faults import apierrors


def api_shape(request: http.Request) -> Api:
    """Which API's error format a client expects. Read from the request itself: this
    runs before the scope addon, and covers paths outside its scope too."""
    return apis.for_refusal(request.path, request.headers)


def refusal(api: Api, status: int, message: str) -> http.Response:
    """The relay's own answer to a request it does not let through."""
    headers = {"www-authenticate": 'Bearer realm="ttft-relay"'} if status == 401 else None
    return apierrors.error_response(api, status, message, headers)
