"""mitmproxy's error texts the relay reads meaning into (no patch).

mitmproxy gives a flow's failure only as text (`flow.error.msg`); where the relay must
know why a flow failed, it matches that text:

- a client that went away: HTTP/1's "Client disconnected." (`Http1Connection.wait`),
  HTTP/2's "stream reset by client (…)" (`Http2Connection.handle_h2_event`), and
  "client disconnected", with which mitmproxy cancels the upstream connections of a
  client that left (`ConnectionHandler.handle_client`);
- a flow killed (`flow.Error.KILLED_MESSAGE`, `HttpStream.check_killed`): the relay
  answered it itself (`answer_on_head`);
- an upstream connection's error passed on verbatim as the error of the flows waiting
  for it (see `connections`), which is how the relay recognises its own connect
  timeout and a failed connect's marks (`faults`).
"""

from __future__ import annotations

from mitmproxy.flow import Error as FlowError
from mitmproxy.proxy import server
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._http1 import Http1Connection
from mitmproxy.proxy.layers.http._http2 import Http2Connection

PINS = {
    "Http1Connection.wait": (Http1Connection.wait, "c99d0494a840a2b6"),
    "Http2Connection.handle_h2_event": (Http2Connection.handle_h2_event, "f6b6a52b12548102"),
    "ConnectionHandler.handle_client": (server.ConnectionHandler.handle_client, "01f1b7cc991c4711"),
    "HttpStream.check_killed": (HttpStream.check_killed, "368cad352d1e82b6"),
}

CLIENT_GONE = ("client disconnected", "stream reset by client")
"""How mitmproxy's messages for a client that went away begin, lowercased."""
KILLED = FlowError.KILLED_MESSAGE


def client_gone(message: str) -> bool:
    """Whether a flow's error says its client went away (HTTP/1 or HTTP/2)."""
    return message.lower().startswith(CLIENT_GONE)
